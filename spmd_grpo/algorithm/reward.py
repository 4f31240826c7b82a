"""Rule-based rewards: the batch reward-function interface, the geometry3k math reward, user reward files,
validation of what a reward function returns, and DAPO's overlong penalty.

Interface (EasyR1's batch reward functions): a reward function takes `list[dict]`, one dict per sample with
at least `response: str`, `response_length: int`, `ground_truth: str` (plus any extra keys the data carries,
e.g. `data_source`, `prompt`, `uid`), and returns `list[dict[str, float]]` of the same length, every dict with
the same keys, among them `overall` (the score used for advantages; the other keys are logged). A user
function that cannot be called with that one argument (verl's per-sample `compute_score(data_source,
solution_str, ground_truth, extra_info)`) is refused when it is loaded, before any model exists.

Papers and sources:
- Geometry3k math reward: verl `verl/utils/reward_score/geo3k.py` and EasyR1
  `examples/reward_function/math.py`: overall = (1 - w) * accuracy + w * format, w =
  `worker.reward.format_weight` (0.1, as both).
- Overlong reward shaping: DAPO, Yu et al. 2025 (arXiv:2503.14476), "soft overlong punishment".

Deviations:
- `math_reward` follows EasyR1 exactly, which differs from verl's geo3k in one step: before grading, the
  response is normalised with `re.sub(r"\\s*(<|>|/)\\s*", r"\\1", response)` (whitespace around '<', '>' and
  '/' removed; EasyR1 added it for Qwen2.5-VL-32B, which writes "< think >"). Format is then
  `re.fullmatch(r"<think>.*</think>.*\\boxed\\{.*\\}.*", response, re.DOTALL)` and accuracy is mathruler's
  `grade_answer(extract_boxed_content(response), ground_truth)`, both on the normalised response.
- The overlong penalty is returned as its own [B] tensor for the caller to add to `overall` (verl adds it
  inside its DAPO reward manager). As in DAPO/verl it is not clamped below -penalty_factor for responses
  longer than max_response_length (which the sampler's length limit prevents anyway).
"""

import contextlib
import functools
import importlib.util
import inspect
import io
import math
import numbers
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from mathruler.grader import extract_boxed_content, grade_answer
from torch import Tensor

RewardFn = Callable[[list[dict[str, Any]]], list[dict[str, float]]]

_FORMAT_PATTERN = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
_TAG_WHITESPACE = re.compile(r"\s*(<|>|/)\s*")


class RewardError(ValueError):
    """A reward function raised, or returned something that is not one finite score dict per sample."""


def math_reward(samples: list[dict[str, Any]], format_weight: float = 0.1) -> list[dict[str, float]]:
    """Geometry3k reward: overall = (1 - format_weight) * accuracy + format_weight * format.

    accuracy is 1.0 iff mathruler grades the last \\boxed{...} content equal to `ground_truth`; format is 1.0
    iff the response is `<think>...</think>...\\boxed{...}...` (see the module docstring for the exact steps).
    """
    if not 0.0 <= format_weight <= 1.0:
        raise ValueError(f"format_weight must be in [0, 1], got {format_weight}")
    scores = []
    for sample in samples:
        response = _TAG_WHITESPACE.sub(r"\1", sample["response"])
        format_score = 1.0 if _FORMAT_PATTERN.fullmatch(response) else 0.0
        accuracy = 1.0 if grade_answer(extract_boxed_content(response), sample["ground_truth"]) else 0.0
        scores.append(
            {
                "overall": (1.0 - format_weight) * accuracy + format_weight * format_score,
                "format": format_score,
                "accuracy": accuracy,
            }
        )
    return scores


def color_reward(samples: list[dict[str, Any]], format_weight: float = 0.1) -> list[dict[str, float]]:
    """Reward of the built-in smoke task (`builtin:color`): the answer is one digit naming the image's colour.

    accuracy = 1 if the first digit in the response is the ground truth; format = 1 if the response starts
    with a digit; overall = (1 - w) * accuracy + w * format, weighted like the geometry3k reward. A tiny
    random model starts near 0 (digits are 10 of ~500 tokens) and learns it under GRPO in a few minutes.
    """
    out = []
    for sample in samples:
        response = str(sample["response"]).strip()
        digits = [c for c in response if c.isdigit()]
        accuracy = float(bool(digits) and digits[0] == str(sample["ground_truth"]).strip())
        fmt = float(response[:1].isdigit())
        out.append(
            {
                "overall": (1 - format_weight) * accuracy + format_weight * fmt,
                "format": fmt,
                "accuracy": accuracy,
            }
        )
    return out


_BUILTIN_REWARDS: dict[str, RewardFn] = {"math": math_reward, "color": color_reward}


def load_reward_function(spec: str, format_weight: float = 0.1) -> RewardFn:
    """Resolve a reward spec: a built-in name ("math", "color"), whose overall weighs format by
    `format_weight` (`worker.reward.format_weight`), or "path/to/file.py:function_name" (a user batch
    function, which computes its own overall)."""
    if spec in _BUILTIN_REWARDS:
        if not 0.0 <= format_weight <= 1.0:
            raise ValueError(f"format_weight must be in [0, 1], got {format_weight}")
        builtin = _BUILTIN_REWARDS[spec]
        return functools.update_wrapper(functools.partial(builtin, format_weight=format_weight), builtin)
    path_str, sep, fn_name = spec.rpartition(":")
    if not sep or not path_str or not fn_name:
        raise ValueError(
            f"reward function spec {spec!r} must be one of {sorted(_BUILTIN_REWARDS)} or 'path/to/file.py:fn_name'"
        )
    path = Path(path_str).expanduser()
    if not path.is_file():
        raise ValueError(f"reward function spec {spec!r}: file {str(path)!r} does not exist")
    # A unique module name per file, registered in sys.modules before exec: dataclasses and pickling in the
    # user's file look their module up there. The file runs once per process: the trainer takes the module
    # the preflight check imported.
    module_name = "spmd_grpo_user_reward_" + re.sub(r"\W", "_", str(path.resolve()))
    module = sys.modules.get(module_name) or _import_reward_file(spec, path, module_name)
    if not hasattr(module, fn_name):
        raise ValueError(f"reward function spec {spec!r}: {str(path)!r} has no attribute {fn_name!r}")
    fn = getattr(module, fn_name)
    if not callable(fn):
        raise ValueError(f"reward function spec {spec!r}: {fn_name!r} is a {type(fn).__name__}, not callable")
    _check_batch_signature(spec, fn_name, fn)
    return fn


def _check_batch_signature(spec: str, fn_name: str, fn: Callable) -> None:
    """`fn` can be called as the trainer calls it, `fn(samples)`: a function of verl's per-sample shape,
    `compute_score(data_source, solution_str, ground_truth, extra_info=None)`, failed only at the first
    step's reward, after the model and vLLM had loaded and generated. A callable without an inspectable
    signature is taken as it is."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind([])
    except TypeError as e:
        raise ValueError(
            f"reward function spec {spec!r}: {fn_name}{signature} cannot be called with one argument ({e}); "
            "the trainer calls it once per batch with a list of sample dicts (response, response_length, "
            "ground_truth, ...) and takes a list of score dicts back"
        ) from None


def _import_reward_file(spec: str, path: Path, module_name: str):
    """Run the user's reward file as module `module_name`; anything it raises or exits with at import is one
    ValueError naming the file (with the last line it printed, e.g. argparse's usage error)."""
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"reward function spec {spec!r}: cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    printed = io.StringIO()  # argparse at import prints its usage: kept for the one-line error, else replayed
    try:
        with contextlib.redirect_stderr(printed):
            module_spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 - sys.exit / argparse (SystemExit) and KeyboardInterrupt too
        del sys.modules[module_name]
        lines = [line.strip() for line in printed.getvalue().splitlines() if line.strip()]
        said = f", having printed {lines[-1]!r}" if lines else ""
        raise ValueError(
            f"reward function spec {spec!r}: importing {str(path)!r} raised {_describe(e)}{said}"
        ) from e
    sys.stderr.write(printed.getvalue())
    return module


def _describe(error: BaseException) -> str:
    """An exception from user code in one phrase; `SystemExit` (not an `Exception`: it once ended the job
    with exit code 0 and nothing trained) says where it comes from."""
    if isinstance(error, SystemExit):
        return f"SystemExit({error.code!r}) (sys.exit, or argparse reading the trainer's command line)"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _source_file(fn: Callable) -> str:
    """The file that defines `fn` (through functools wrappers), for errors; '?' when it has none."""
    try:
        return inspect.getsourcefile(inspect.unwrap(fn)) or "?"
    except TypeError:
        return "?"


def _describe_sample(samples: Sequence[dict[str, Any]], index: int) -> str:
    uid = samples[index].get("uid") if isinstance(samples[index], dict) else None
    return f"sample {index}" + (f" (uid={uid!r})" if uid is not None else "")


def score_samples(
    fn: RewardFn, samples: list[dict[str, Any]], *, batch_name: str = "batch"
) -> dict[str, Tensor]:
    """Run a batch reward function and validate its output: {key: float32 [B]} for every returned key.

    Raises RewardError (naming `batch_name`, the sample index and uid, and the offending key/value) if `fn`
    raises, or returns something other than one dict per sample, all with the same keys including
    `overall`, all values finite real numbers. An empty batch returns {"overall": empty} without calling fn.
    """
    fn_name = getattr(fn, "__qualname__", repr(fn))
    if not samples:
        return {"overall": torch.zeros(0, dtype=torch.float32)}
    try:
        results = fn(samples)
    except BaseException as e:  # noqa: BLE001 - a SystemExit from user code must fail the job, not end it
        uids = [s.get("uid") for s in samples if isinstance(s, dict) and "uid" in s]
        uid_note = f", uids {uids[0]!r}..{uids[-1]!r}" if uids else ""
        raise RewardError(
            f"reward function {fn_name} ({_source_file(fn)}) raised {_describe(e)} on {batch_name} "
            f"({len(samples)} samples{uid_note})"
        ) from e

    where = f"reward function {fn_name} on {batch_name}"
    if not isinstance(results, (list, tuple)):
        raise RewardError(f"{where} returned a {type(results).__name__}, expected a list of dicts")
    if len(results) != len(samples):
        raise RewardError(f"{where} returned {len(results)} results for {len(samples)} samples")

    keys: list[str] | None = None
    for i, result in enumerate(results):
        sample = _describe_sample(samples, i)
        if not isinstance(result, dict):
            raise RewardError(f"{where}: {sample}: result is a {type(result).__name__}, expected a dict")
        if "overall" not in result:
            raise RewardError(f"{where}: {sample}: result has no 'overall' key (keys: {sorted(result)})")
        if keys is None:
            keys = list(result)
        elif set(result) != set(keys):
            raise RewardError(
                f"{where}: {sample}: keys {sorted(result)} differ from sample 0's keys {sorted(keys)}"
            )
        for key, value in result.items():
            if not isinstance(value, numbers.Real):
                raise RewardError(
                    f"{where}: {sample}: key {key!r} = {value!r} ({type(value).__name__}) is not a real number"
                )
            if not math.isfinite(value):
                raise RewardError(f"{where}: {sample}: key {key!r} = {value!r} is not finite")

    assert keys is not None
    return {key: torch.tensor([float(r[key]) for r in results], dtype=torch.float32) for key in keys}


def overlong_penalty(
    response_lengths: Tensor, max_response_length: int, buffer_length: int, penalty_factor: float
) -> Tensor:
    """DAPO soft overlong punishment, float32 [B] (0 or negative), to be added to the score.

    expected = max_response_length - buffer_length;
    penalty = min(-(length - expected) / buffer_length * penalty_factor, 0):
    0 up to `expected` tokens, then linear down to -penalty_factor at max_response_length.
    """
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(
            f"buffer_length must be in (0, max_response_length={max_response_length}], got {buffer_length}"
        )
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    expected = max_response_length - buffer_length
    excess = response_lengths.to(torch.float32) - expected
    return torch.clamp(-excess / buffer_length * penalty_factor, max=0.0)
