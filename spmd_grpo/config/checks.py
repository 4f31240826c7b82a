"""`ConfigError`, the field types the config sections declare their ranges with, and the built-in names.

Where numbers go decides how large they may be. Every integer key is a C int (vLLM's and torch's sizes and
token counts; seeds: numpy takes < 2**32 and the engine adds the rank to trainer.seed); every float key meets
float32 tensors and must be finite. Durations in seconds are C ints too: `datetime.timedelta` (the process
group's timeout; gloo keeps int64 milliseconds) and `time.sleep` both take that, where 10**20 s raised
OverflowError only when the process group was built. YAML 1.1 reads `1e-6` (no dot) as a string: a float key
takes a numeric string. A bool is never a number.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, Strict


class ConfigError(ValueError):
    """A configuration problem the user can fix; the message is one line naming the key."""


C_INT_MIN, C_INT_MAX = -(2**31), 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38

SECTION = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
"""Every section: unknown keys refused, immutable, each field's docstring is its description."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _number(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected a number, got a bool")
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return value  # pydantic names the type
    if isinstance(value, float):
        require(math.isfinite(value), "must be a finite number")
        require(abs(value) <= FLOAT32_MAX, f"is beyond float32 (|x| <= {FLOAT32_MAX:.4g})")
    return value


def _off_or_positive(value: int) -> int:
    require(value == -1 or value >= 1, "must be -1 (off) or >= 1")
    return value


def _nonempty(value: str) -> str:
    require(bool(value.strip()), "must be a non-empty string")
    return value


Int = Annotated[int, Strict(), Field(ge=C_INT_MIN, le=C_INT_MAX)]
Float = Annotated[float, BeforeValidator(_number)]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
NonEmpty = Annotated[Str, AfterValidator(_nonempty)]
Positive = Annotated[Int, Field(gt=0)]
NonNegative = Annotated[Int, Field(ge=0)]
OffOrPositive = Annotated[Int, AfterValidator(_off_or_positive)]
"""-1 means off / all; 0 and -5 are mistakes."""
PositiveFloat = Annotated[Float, Field(gt=0)]
NonNegativeFloat = Annotated[Float, Field(ge=0)]
Fraction = Annotated[Float, Field(ge=0, le=1)]
TopK = Annotated[Int, Field(ge=-1)]
"""-1 or 0: off (as vLLM)."""
TopP = Annotated[Float, Field(gt=0, le=1)]


# ------------------------------------------------------------------------------------------ built-in names
BUILTIN_REWARDS = ("math", "color")
"""The reward names `spmd_grpo.algorithm.reward` resolves itself (the rest must be `path/file.py:function`)."""

BUILTIN_DATASETS = ("color", "geo3k", "video_color")
"""The `builtin:<task>` data sets `spmd_grpo.data.synthetic` generates."""

HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+(@[\w.\[\]:%+-]+)?$")
"""`owner/name`, for data sets optionally `@split`."""
