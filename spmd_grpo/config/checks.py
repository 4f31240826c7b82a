"""`ConfigError`, the field types the sections declare their ranges with, and the built-in names. Every integer
is a C int (the sizes vLLM and torch take, seconds for `timedelta`) and every float finite within float32 (it
meets float32 tensors); a float key takes a numeric string (YAML 1.1 reads `1e-6` as one); a bool is no number.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, Strict


class ConfigError(ValueError):
    """A configuration problem the user can fix; the message is one line naming the key."""


C_INT_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
SECTION = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, use_attribute_docstrings=True)
"""Every section: unknown keys refused, immutable, floats finite, a field's docstring its description."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def rule(test: Callable[[Any], bool], message: str) -> AfterValidator:
    """A validator refusing a value that fails `test` with `message` (pydantic adds the key)."""

    def check(value: Any) -> Any:
        require(test(value), message)
        return value

    return AfterValidator(check)


def _float(value: Any) -> Any:
    try:
        value = float(value) if isinstance(value, str) else value
    except ValueError:
        return value  # pydantic names the type
    finite_beyond_float32 = isinstance(value, int | float) and FLOAT32_MAX < abs(value) < float("inf")
    require(not finite_beyond_float32, "is beyond float32")  # inf and nan: pydantic's "finite number"
    return value


Int = Annotated[int, Strict(), Field(ge=-C_INT_MAX - 1, le=C_INT_MAX)]
Float = Annotated[float, Strict(), BeforeValidator(_float)]
Bool = Annotated[bool, Strict()]
NonEmpty = Annotated[str, rule(lambda v: v.strip() != "", "must be a non-empty string")]
Positive = Annotated[Int, Field(gt=0)]
NonNegative = Annotated[Int, Field(ge=0)]
OffOrPositive = Annotated[Int, rule(lambda v: v == -1 or v >= 1, "must be -1 (off) or >= 1")]
"""-1 means off / all; 0 and -5 are mistakes."""
PositiveFloat = Annotated[Float, Field(gt=0)]
NonNegativeFloat = Annotated[Float, Field(ge=0)]
Fraction = Annotated[Float, Field(ge=0, le=1)]
TopK = Annotated[Int, Field(ge=-1)]  # -1 or 0: off (as vLLM)
TopP = Annotated[Float, Field(gt=0, le=1)]

BUILTIN_REWARDS = ("math", "color")
"""The reward names `spmd_grpo.algorithm.reward` resolves itself (the rest must be `path/file.py:function`)."""
BUILTIN_REWARD_KEYS = ("overall", "accuracy", "format")
"""The keys the built-in rewards return (what algorithm.filter_groups.metric may name with them)."""
BUILTIN_DATASETS = ("color", "geo3k", "video_color")
"""The `builtin:<task>` data sets `spmd_grpo.data.synthetic` generates."""
