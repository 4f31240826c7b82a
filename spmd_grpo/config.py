"""Configuration: YAML -> frozen dataclasses, dotted command-line overrides, strict validation.

Section names follow EasyR1/verl so their users recognise them: ``data``, ``algorithm``, ``worker.actor``,
``worker.rollout``, ``worker.ref``, ``worker.reward``, ``trainer``.

Everything a user can get wrong is caught here, before any process group or model exists:
  * unknown keys (with the full dotted name and the closest valid key), a key given twice in one YAML
    mapping (file and both lines),
  * wrong types (with the expected type); a float must be finite (NaN and inf are refused everywhere),
  * value rules, checked by ``validate(cfg, world_size)``: first each section's own (ranges, enums, a
    built-in name), in the section's ``check(prefix)`` method where ``prefix`` is its dotted key
    (``worker.rollout.``), then the rules across sections and the world size (batch sizes vs world size and
    group size, TP dividing the world, DAPO's batch and length settings, validation without a validation
    set), then what must exist on this machine, in the sections' ``check_files(prefix)`` (model and
    tokenizer directory or hub id, data files, prompt template, reward file and function, resume directory)
    and the training set's rows against the rollout batch. ``--dry-run`` skips the last part: it plans a job
    for another machine.
``ConfigError`` carries a one-line message naming the key, the value and what is allowed; ``spmd_grpo.train``
prints it and exits with code 2. Values derived from several fields (``Config.max_model_len``,
``Config.num_train_groups``, ``Config.total_steps``) are computed here and nowhere else.

Deviations from EasyR1's schema: ``algorithm.norm_adv_by_std_in_grpo`` and ``algorithm.adv_std_scope`` are
verl's names; DAPO's switches live under ``algorithm.filter_groups`` and ``algorithm.overlong_buffer`` (verl
names them ``algorithm.filter_groups`` and ``reward_model.overlong_buffer``).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import importlib.util
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A configuration problem the user can fix; the message is one line naming the key."""


# ------------------------------------------------------------------------------------------ section rules
def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _require_positive(section: Any, prefix: str, *names: str) -> None:
    """`<prefix><name> must be positive` for the first of the section's fields `names` that is not > 0."""
    for name in names:
        value = getattr(section, name)
        _require(value > 0, f"{prefix}{name} must be positive, got {value}")


def _require_at_least(section: Any, prefix: str, minimum: float, *names: str) -> None:
    """`<prefix><name> must be >= minimum` for the first of the section's fields `names` below it."""
    for name in names:
        value = getattr(section, name)
        _require(value >= minimum, f"{prefix}{name} must be >= {minimum}, got {value}")


def _require_off_or_positive(section: Any, prefix: str, *names: str) -> None:
    """Fields where -1 means "off / all" and any other value must be >= 1 (0 and -5 are mistakes)."""
    for name in names:
        value = getattr(section, name)
        _require(value == -1 or value >= 1, f"{prefix}{name} must be -1 (off) or >= 1, got {value}")


def _require_nonempty(section: Any, prefix: str, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        _require(bool(value and value.strip()), f"{prefix}{name} must be a non-empty string, got {value!r}")


def _require_top_k(prefix: str, top_k: int) -> None:
    _require(top_k >= -1, f"{prefix}top_k must be -1 or 0 (off) or >= 1 (as vLLM), got {top_k}")


# ------------------------------------------------------------------------ what must exist on this machine
BUILTIN_REWARDS = ("math", "color")
"""The reward names `spmd_grpo.reward` resolves itself (the rest must be `path/file.py:function`)."""
BUILTIN_DATASETS = ("color", "geo3k")
"""The `builtin:<task>` data sets `spmd_grpo.data` generates."""
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+(@[\w.\[\]:%+-]+)?$")
"""`owner/name`, for data sets optionally `@split`."""


def _looks_like_hub_id(value: str) -> bool:
    """`owner/name[@split]` that cannot be a local path: no leading `/`, `.` or `~`, and `owner` is not a
    directory here (`models/qwen` with a `models/` directory is a missing local path, not a hub id)."""
    if not HUB_ID.match(value) or value[0] in "/.~":
        return False
    return not Path(value.split("/")[0]).is_dir()


def _hub_cache_has(repo_id: str) -> bool:
    """Whether the Hugging Face cache holds a snapshot of model `repo_id` with its config.json."""
    home = os.environ.get("HF_HOME", str(Path("~/.cache/huggingface").expanduser()))
    cache = Path(os.environ.get("HF_HUB_CACHE", os.path.join(home, "hub")))
    return any((cache / f"models--{repo_id.replace('/', '--')}" / "snapshots").glob("*/config.json"))


def _check_model_path(key: str, value: str) -> None:
    """A local checkpoint directory with config.json, or a hub id. Hub ids are downloaded at start-up, so
    they are accepted as they are, except offline (`HF_HUB_OFFLINE=1`), where the cache must hold them."""
    path = Path(value).expanduser()
    if path.is_dir():
        _require(
            (path / "config.json").is_file(),
            f"{key}: {value!r} has no config.json (expected a Hugging Face checkpoint directory)",
        )
        return
    _require(
        _looks_like_hub_id(value),
        f"{key} must be an existing checkpoint directory or a hub id owner/name, got {value!r}: "
        f"{'not a directory' if path.exists() else 'no such directory'}",
    )
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")
    _require(
        not offline or _hub_cache_has(value),
        f"{key}: {value!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set",
    )


def _check_data_source(key: str, source: str) -> None:
    """A parquet file, a directory holding *.parquet, `builtin:<task>` (checked by the section), a hub id."""
    if source.startswith("builtin:"):
        return
    path = Path(source).expanduser()
    if path.is_file():
        return
    if path.is_dir():
        _require(any(path.glob("*.parquet")), f"{key}: directory {source!r} holds no *.parquet file")
        return
    _require(
        _looks_like_hub_id(source),
        f"{key} must be a parquet file or directory, builtin:<task> or a hub id owner/name[@split], "
        f"got {source!r}: no such file or directory",
    )


def count_rows(source: str, num_builtin_examples: int) -> int | None:
    """Rows of a data source before any is read (parquet footers only); None for a hub data set."""
    if source.startswith("builtin:"):
        return num_builtin_examples
    path = Path(source).expanduser()
    if not (path.is_file() or path.is_dir()):
        return None
    import pyarrow.parquet as pq

    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    rows, unreadable = 0, []
    for file in files:
        try:
            rows += pq.read_metadata(file).num_rows
        except Exception as e:  # pyarrow raises several types for a file that is not parquet
            unreadable.append(f"{file} is not a readable parquet file: {type(e).__name__}: {e}")
    # A bad file among good ones in a directory is skipped by the loader (named in its log), not fatal here.
    if unreadable and (path.is_file() or len(unreadable) == len(files)):
        raise ConfigError(unreadable[0])
    return rows


def _check_reward_file(key: str, spec: str) -> None:
    """`path/file.py:fn`: the file exists, parses, and defines or imports `fn` at its top level (read, not
    run: importing it runs the user's code, which `spmd_grpo.train` does next, before any process group)."""
    path_str, _, fn = spec.rpartition(":")
    path = Path(path_str).expanduser()
    _require(path.is_file(), f"{key}: {spec!r}: file {path_str!r} does not exist")
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except SyntaxError as e:
        raise ConfigError(f"{key}: {spec!r}: {path_str} line {e.lineno}: {e.msg}") from None
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    _require(fn in names, f"{key}: {spec!r}: {path_str} defines no function {fn!r}")


# --------------------------------------------------------------------------------------------- sections
@dataclass(frozen=True)
class DataConfig:
    train_files: str = "builtin:color"
    """`hub/repo@split`, a local parquet file or directory, or `builtin:<task>` (synthetic, see tools/synthetic_data.py)."""
    val_files: str | None = None
    prompt_key: str = "problem"
    answer_key: str = "answer"
    image_key: str = "images"
    format_prompt: str | None = None
    """Path to a jinja file rendering `content` (the problem) into the user message; None = problem as is."""
    system_prompt: str | None = None
    max_prompt_length: int = 512
    """Prompt tokens after image-token expansion; longer prompts are filtered at load, never truncated."""
    max_response_length: int = 512
    rollout_batch_size: int = 16
    """Prompts drawn per step across all ranks; each yields worker.rollout.n samples."""
    val_batch_size: int = -1
    """Validation prompts per generation batch, over all ranks (-1: the whole validation set in one batch)."""
    val_max_samples: int = -1
    """Validate on the first N examples of the validation set (-1: all)."""
    min_pixels: int = 3136
    max_pixels: int = 262144
    shuffle: bool = True
    seed: int = 1
    max_bad_fraction: float = 0.1
    """Rows failing to decode are skipped; more than this fraction is an error."""
    num_builtin_examples: int = 256
    """Size of a `builtin:` dataset."""

    def check(self, prefix: str) -> None:
        _require_positive(
            self,
            prefix,
            "max_prompt_length",
            "max_response_length",
            "rollout_batch_size",
            "min_pixels",
            "num_builtin_examples",
        )
        _require_nonempty(self, prefix, "train_files", "prompt_key", "answer_key", "image_key")
        _require_off_or_positive(self, prefix, "val_batch_size", "val_max_samples")
        _require_at_least(self, prefix, 0, "seed")
        _require(
            self.max_pixels >= self.min_pixels,
            f"{prefix}max_pixels ({self.max_pixels}) must be >= {prefix}min_pixels ({self.min_pixels})",
        )
        _require(
            0 <= self.max_bad_fraction <= 1,
            f"{prefix}max_bad_fraction must be in [0, 1], got {self.max_bad_fraction}",
        )
        for name in ("train_files", "val_files"):
            source = getattr(self, name)
            if source is not None and source.startswith("builtin:"):
                _require(
                    source.removeprefix("builtin:") in BUILTIN_DATASETS,
                    f"{prefix}{name}: unknown builtin data set {source!r}; available: "
                    f"{', '.join('builtin:' + t for t in BUILTIN_DATASETS)}",
                )

    def check_files(self, prefix: str) -> None:
        _check_data_source(f"{prefix}train_files", self.train_files)
        if self.val_files is not None:
            _check_data_source(f"{prefix}val_files", self.val_files)
        if self.format_prompt is not None:
            _require(
                Path(self.format_prompt).expanduser().is_file(),
                f"{prefix}format_prompt must be an existing jinja file, got {self.format_prompt!r}: no such file",
            )


@dataclass(frozen=True)
class FilterGroupsConfig:
    """DAPO dynamic sampling (Yu et al. 2025, sec. 3.2)."""

    enable: bool = False
    metric: str = "accuracy"
    """Reward key whose spread decides whether a group is kept (`accuracy`, `overall`, or a custom key)."""
    max_num_gen_batches: int = 10
    """Generation batches per step before giving up with an error; <= 0 means unlimited."""
    train_batch_size: int = -1
    """Prompt groups to train on per step (-1: data.rollout_batch_size); each generation batch draws
    data.rollout_batch_size prompts, so a larger rollout batch needs fewer generation batches."""

    def num_train_groups(self, rollout_batch_size: int) -> int:
        """Prompt groups trained on per step: train_batch_size when DAPO is on and it is set, else the
        rollout batch."""
        return self.train_batch_size if self.enable and self.train_batch_size > 0 else rollout_batch_size

    def check(self, prefix: str) -> None:
        _require_nonempty(self, prefix, "metric")
        _require_off_or_positive(self, prefix, "train_batch_size")


@dataclass(frozen=True)
class OverlongBufferConfig:
    """DAPO overlong reward shaping (Yu et al. 2025, sec. 3.4)."""

    enable: bool = False
    length: int = 512
    penalty_factor: float = 1.0

    def check(self, prefix: str) -> None:
        _require_at_least(self, prefix, 0, "penalty_factor")


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Rollout correction (verl's ``algorithm.rollout_correction``): importance weights and rejection for the
    gap between vLLM's sampling distribution and the trainer's old policy (formulas in correction.py)."""

    rollout_is: str | None = None
    """IS weight level: token | sequence | null (off). Weights are truncated at rollout_is_threshold (TIS)."""
    rollout_is_threshold: float = 2.0
    """TIS cap C >= 1: w = min(pi_old / pi_rollout, C)."""
    rollout_rs: str | None = None
    """Rejection (masked IS) level: token | sequence | geometric | null (off); tokens or whole sequences whose
    ratio lies outside [rollout_rs_threshold_lower, rollout_rs_threshold] leave the loss and its normaliser."""
    rollout_rs_threshold: float = 2.0
    rollout_rs_threshold_lower: float | None = None
    """null: 1 / rollout_rs_threshold."""

    def check(self, prefix: str) -> None:
        _require(
            self.rollout_is in (None, "token", "sequence"),
            f"{prefix}rollout_is must be one of 'token', 'sequence' or null, got {self.rollout_is!r}",
        )
        _require(
            self.rollout_rs in (None, "token", "sequence", "geometric"),
            f"{prefix}rollout_rs must be one of 'token', 'sequence', 'geometric' or null, got {self.rollout_rs!r}",
        )
        cap, upper = self.rollout_is_threshold, self.rollout_rs_threshold
        lower = self.rollout_rs_threshold_lower
        _require(
            cap >= 1, f"{prefix}rollout_is_threshold must be >= 1 (a cap on pi_old/pi_rollout), got {cap}"
        )
        _require(upper >= 1, f"{prefix}rollout_rs_threshold must be >= 1, got {upper}")
        _require(
            lower is None or 0 < lower <= 1,
            f"{prefix}rollout_rs_threshold_lower must be in (0, 1] (or null: 1 / rollout_rs_threshold), got {lower}",
        )


@dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: Literal["grpo", "drgrpo"] = "grpo"
    """grpo: (s - mean) / (std + eps) per group; drgrpo: s - mean (Liu et al. 2025)."""
    norm_adv_by_std_in_grpo: bool = True
    adv_std_scope: Literal["group", "batch"] = "group"
    adv_eps: float = 1e-6
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    use_kl_loss: bool = True
    kl_penalty: Literal["low_var_kl", "kl", "abs", "mse"] = "low_var_kl"
    kl_coef: float = 0.01

    def check(self, prefix: str) -> None:
        _require_positive(self, prefix, "adv_eps")
        _require_at_least(self, prefix, 0, "kl_coef")


@dataclass(frozen=True)
class ModelConfig:
    model_path: str = ""
    """Local directory or HF hub id of a checkpoint of a supported family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)."""
    tokenizer_path: str | None = None
    """Where the processor (tokenizer + image processor) comes from; None = model_path."""
    trust_remote_code: bool = False
    """Passed to transformers (config, processor) and to vLLM: allow code shipped with the checkpoint."""
    freeze_vision_tower: bool = False
    enable_gradient_checkpointing: bool = False

    def check(self, prefix: str) -> None:
        _require(self.model_path != "", f"{prefix}model_path must be set (a local directory or HF id)")

    def check_files(self, prefix: str) -> None:
        _check_model_path(f"{prefix}model_path", self.model_path)
        if self.tokenizer_path is not None:
            _check_model_path(f"{prefix}tokenizer_path", self.tokenizer_path)


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 1e-2
    lr_warmup_steps: int = 0
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0

    def check(self, prefix: str) -> None:
        _require_positive(self, prefix, "lr")
        _require(
            all(0 <= b < 1 for b in self.betas),
            f"{prefix}betas must both be in [0, 1), got {list(self.betas)}",
        )
        _require_at_least(self, prefix, 0, "weight_decay", "lr_warmup_steps")
        _require(
            0 <= self.min_lr_ratio <= 1, f"{prefix}min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}"
        )


@dataclass(frozen=True)
class FSDPConfig:
    param_dtype: Literal["bfloat16", "float16", "float32", "auto"] = "auto"
    """auto: bfloat16 on accelerators, float32 on CPU."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    offload_params: bool = False
    """Keep the policy's shards (and gradients, optimizer step) in host memory (FSDP2 CPUOffloadPolicy)."""
    offload_optimizer: bool = False


@dataclass(frozen=True)
class ActorConfig:
    """The policy and its update; the reference model (worker.ref) is loaded from the same model_path."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    global_batch_size: int = 16
    """Samples (not prompts) per optimizer step, across all ranks."""
    micro_batch_size_per_device_for_update: int = 4
    """Samples per forward/backward; gradients accumulate over the rank's share of global_batch_size."""
    micro_batch_size_per_device_for_experience: int = 16
    """Samples per forward when computing the old and reference logprobs (no gradient)."""
    ppo_epochs: int = 1
    loss_mode: Literal["vanilla", "gspo"] = "vanilla"
    """vanilla: PPO's token-level ratio; gspo: GSPO's sequence-level ratio (no dual clip)."""
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    """The ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high] (DAPO's clip-higher: high > low)."""
    clip_ratio_dual: float | None = 3.0
    """Dual-clip PPO's c > 1 (null: off); used by loss_mode vanilla only."""
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = "token-mean"
    entropy_coef: float = 0.0
    max_grad_norm: float = 1.0
    logprob_chunk_size: int = 1024
    """Tokens per chunk of the vocabulary-sized log-softmax (bounds its memory)."""
    padding_free: bool | Literal["auto"] = "auto"
    """Pack each micro-batch's sequences into one row (no padding tokens). auto: on where the device has a
    varlen attention path (flash attention on CUDA with `flash_attn`, the fused kernel on Ascend, causal
    sdpa per sequence length on the CPU), off on CUDA without `flash_attn`, where true packs with a dense
    block-diagonal mask (correct, not faster)."""
    reuse_image_features: bool = True
    """With model.freeze_vision_tower: encode each prompt's images once per step, reused by all its samples
    and every trainer pass; ignored (images re-encoded in every forward) when the tower is trained."""
    dynamic_batching: bool = False
    """Micro-batches by token budget (the two keys below, prompt + response tokens per rank) instead of
    the micro_batch_size_* counts: balanced token sums, the same number of forwards on every rank."""
    max_token_len_per_device_for_update: int = 16384
    max_token_len_per_device_for_experience: int = 16384
    old_logprobs_from_update: bool = True
    """When a step is exactly on-policy (one mini-batch, one epoch, no rollout_rs), take the old logprobs
    detached from the update's forward instead of a separate forward-only pass."""

    def check(self, prefix: str) -> None:
        _require_positive(
            self,
            prefix,
            "global_batch_size",
            "micro_batch_size_per_device_for_update",
            "micro_batch_size_per_device_for_experience",
            "ppo_epochs",
            "logprob_chunk_size",
            "max_token_len_per_device_for_update",
            "max_token_len_per_device_for_experience",
        )
        low, high, dual = self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_dual
        _require(0 <= low < 1, f"{prefix}clip_ratio_low must be in [0, 1), got {low}")
        _require(high >= 0, f"{prefix}clip_ratio_high must be >= 0, got {high}")
        _require(dual is None or dual > 1, f"{prefix}clip_ratio_dual must be > 1 (or null), got {dual}")
        _require_at_least(self, prefix, 0, "entropy_coef")
        _require_positive(self, prefix, "max_grad_norm")


@dataclass(frozen=True)
class ValOverrideConfig:
    """Sampling for validation, instead of worker.rollout's."""

    temperature: float = 0.6
    """0: greedy."""
    top_p: float = 0.95
    top_k: int = -1
    n: int = 1

    def check(self, prefix: str) -> None:
        _require_positive(self, prefix, "n")
        _require_at_least(self, prefix, 0, "temperature")
        _require(
            self.temperature > 0 or self.n == 1,
            f"{prefix}n must be 1 with temperature 0 (greedy: vLLM refuses n > 1), got {self.n}",
        )
        _require(0 < self.top_p <= 1, f"{prefix}top_p must be in (0, 1], got {self.top_p}")
        _require_top_k(prefix, self.top_k)


@dataclass(frozen=True)
class RolloutConfig:
    n: int = 8
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    tensor_parallel_size: int = 1
    dtype: Literal["bfloat16", "float16", "float32", "auto"] = "auto"
    """auto: bfloat16 on accelerators, float32 on CPU (exact parity with an fp32 trainer)."""
    gpu_memory_utilization: float = 0.6
    enforce_eager: bool = True
    enable_sleep_mode: bool = True
    """Ignored (one log line) on CPU, where vLLM has no sleep mode."""
    sleep_level: Literal[1, 2] = 2
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 256
    limit_images: int = 1
    """Most images per prompt (vLLM's limit_mm_per_prompt)."""
    kv_cache_memory_gb: float = 1.0
    """CPU only: KV cache size (VLLM_CPU_KVCACHE_SPACE)."""
    weight_sync_bucket_mb: int = 512
    val_override: ValOverrideConfig = field(default_factory=ValOverrideConfig)

    def check(self, prefix: str) -> None:
        _require_positive(
            self,
            prefix,
            "n",
            "tensor_parallel_size",
            "max_num_batched_tokens",
            "weight_sync_bucket_mb",
            "limit_images",
            "max_num_seqs",
            "kv_cache_memory_gb",
        )
        _require(self.temperature > 0, f"{prefix}temperature must be > 0, got {self.temperature}")
        _require(0 < self.top_p <= 1, f"{prefix}top_p must be in (0, 1], got {self.top_p}")
        _require_top_k(prefix, self.top_k)
        _require(
            0 < self.gpu_memory_utilization <= 1,
            f"{prefix}gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )


@dataclass(frozen=True)
class RefConfig:
    """The frozen reference model for the KL loss (built only with algorithm.use_kl_loss)."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The dtype the reference is held and run in; auto = worker.actor.fsdp.param_dtype resolved (bfloat16 on
    accelerators, float32 on CPU): the same numbers as an fp32 copy cast at the all-gather, at half the
    memory."""
    offload_params: bool = False
    """Keep the reference's shards in host memory between its forwards (FSDP2 CPUOffloadPolicy)."""


@dataclass(frozen=True)
class RewardConfig:
    reward_function: str = "math"
    """`math` (geometry3k accuracy + format), `color` (the smoke task), or `path/file.py:fn`."""
    format_weight: float = 0.1
    """The built-in rewards' overall = (1 - format_weight) * accuracy + format_weight * format (EasyR1's
    `r1v` / `math`); a `path/file.py:fn` reward computes its own `overall` and does not get it."""

    def check(self, prefix: str) -> None:
        _require(
            0 <= self.format_weight <= 1, f"{prefix}format_weight must be in [0, 1], got {self.format_weight}"
        )
        spec, key = self.reward_function, f"{prefix}reward_function"
        path, sep, fn = spec.rpartition(":")
        _require(
            spec in BUILTIN_REWARDS or (bool(sep) and path.endswith(".py") and fn.isidentifier()),
            f"{key} must be one of {', '.join(BUILTIN_REWARDS)} or path/to/file.py:function, got {spec!r}",
        )

    def check_files(self, prefix: str) -> None:
        if self.reward_function not in BUILTIN_REWARDS:
            _check_reward_file(f"{prefix}reward_function", self.reward_function)


@dataclass(frozen=True)
class WorkerConfig:
    """EasyR1's worker roles: the trained policy, the vLLM rollout, the reference model, the reward."""

    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)


LoggerName = Literal["console", "jsonl", "tensorboard", "wandb", "swanlab", "mlflow"]
LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "swanlab": "swanlab", "mlflow": "mlflow"}
"""The optional loggers: the module each needs; the package extra that installs it has the logger's name."""


@dataclass(frozen=True)
class TrainerConfig:
    project_name: str = "spmd_grpo"
    """The project (wandb, swanlab) or experiment (mlflow) the run is logged under."""
    experiment_name: str = "run"
    """The run's name in the trackers, and its directory under output_dir."""
    logger: tuple[LoggerName, ...] = ("console", "jsonl")
    """Where rank 0 sends each step's metrics (verl's names): console (one line per step), jsonl
    (metrics.jsonl + val_generations.jsonl, what `python -m spmd_grpo.report` plots), tensorboard, wandb,
    swanlab, mlflow (each an optional extra: `pip install 'spmd_grpo[wandb]'`)."""
    output_dir: str = "runs"
    """The run's files go to output_dir/experiment_name."""
    total_epochs: int = 1
    max_steps: int | None = None
    """Stop after this many steps, >= 1 (null: total_epochs over the training set)."""
    device: Literal["auto", "cuda", "npu", "cpu"] = "auto"
    seed: int = 1
    val_freq: int = -1
    """Validate every N steps and after the last (-1: never; needs data.val_files)."""
    val_before_train: bool = False
    val_generations_to_log: int = 4
    save_freq: int = -1
    """Save every N steps and after the last (-1: only when a signal stops the run)."""
    save_limit: int = 2
    """Keep the newest N complete checkpoints (-1: all)."""
    resume: str = "auto"
    """auto: continue the run in the run directory (from its newest complete checkpoint; a new run if the
    directory holds none) | none: a new run (an error if the directory holds a run) | <path to a
    global_step_N dir>. What each does with the directory: resume.py."""
    allow_config_change: tuple[str, ...] = ()
    """Dotted keys that may differ from the saved config on resume although they change what the saved
    state means (model, data, batch shape, objective; list in resume.py); without them such a change is an
    error."""
    collective_timeout_s: int = 1800
    preempt_grace_s: float = 25.0
    """After SIGTERM/SIGINT the run stops at the next step boundary, saving that step; if it is not done
    this many seconds after the signal, the rank exits at once (128 + signal) without a new checkpoint. Keep
    it below torchrun's --shutdown_timeout and Slurm's KillWait (both 30 s by default), which SIGKILL."""
    log_every: int = 1
    log_memory: bool = True
    """Log one memory line per phase (rollout, update) on rank 0."""

    def check(self, prefix: str) -> None:
        _require_positive(
            self, prefix, "total_epochs", "collective_timeout_s", "log_every", "preempt_grace_s"
        )
        _require_nonempty(self, prefix, "project_name", "experiment_name", "output_dir")
        _require(
            self.max_steps is None or self.max_steps >= 1,
            f"{prefix}max_steps must be >= 1 or null (total_epochs over the data), got {self.max_steps}",
        )
        _require_off_or_positive(self, prefix, "val_freq", "save_freq", "save_limit")
        _require_at_least(self, prefix, 0, "seed", "val_generations_to_log")
        _require_nonempty(self, prefix, "resume")
        _require(
            len(set(self.logger)) == len(self.logger), f"{prefix}logger lists a logger twice: {self.logger}"
        )
        for name in self.logger:
            module = LOGGER_PACKAGES.get(name)
            # find_spec only looks the package up: nothing heavy is imported at config time.
            _require(
                module is None or importlib.util.find_spec(module) is not None,
                f"{prefix}logger: {name!r} needs the {module} package: pip install 'spmd_grpo[{name}]'",
            )

    def check_files(self, prefix: str) -> None:
        _require(
            self.resume in ("auto", "none") or Path(self.resume).expanduser().is_dir(),
            f"{prefix}resume must be auto, none or an existing checkpoint directory (global_step_N), "
            f"got {self.resume!r}: no such directory",
        )


@dataclass(frozen=True)
class Config:
    """The whole configuration, one field per top-level YAML section."""

    @property
    def run_dir(self) -> Path:
        """trainer.output_dir / trainer.experiment_name: the run's own directory."""
        return Path(self.trainer.output_dir) / self.trainer.experiment_name

    @property
    def max_model_len(self) -> int:
        """Prompt + response tokens: the longest sequence vLLM and the trainer see."""
        return self.data.max_prompt_length + self.data.max_response_length

    @property
    def num_train_groups(self) -> int:
        """Prompt groups trained on per step (DAPO's train_batch_size when set, else the rollout batch)."""
        return self.algorithm.filter_groups.num_train_groups(self.data.rollout_batch_size)

    def total_steps(self, steps_per_epoch: int) -> int:
        """trainer.max_steps, else trainer.total_epochs over the training set."""
        return self.trainer.max_steps or self.trainer.total_epochs * steps_per_epoch

    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


# ------------------------------------------------------------------------------------------- loading
def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """YAML file (may be None: defaults) plus `a.b.c=value` overrides -> Config. Raises ConfigError."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            with path.open() as stream:  # a stream, so that errors name the file
                raw = yaml.load(stream, Loader=_StrictLoader) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {_one_line(e)}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        try:
            parsed = yaml.load(value, Loader=_StrictLoader) if value.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"override {key}: value {value!r} is not valid YAML: {_one_line(e)}") from None
        _set_dotted(raw, key.strip(), parsed)
    return _build(Config, raw, prefix="")


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (SafeLoader keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                where = key_node.start_mark.name.replace("<unicode string>", "command-line override")
                raise ConfigError(
                    f"{where}: duplicate key {key!r} at line {line} "
                    f"(first at line {seen[key]}); a key may appear once per section"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _one_line(error: yaml.YAMLError) -> str:
    return " ".join(str(error).split())


def _set_dotted(raw: dict, dotted: str, value: Any) -> None:
    node = raw
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {part} is not a section")
        node = child
    node[parts[-1]] = value


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """The section's field types, evaluated once (the annotations are strings under `from __future__`)."""
    return typing.get_type_hints(cls)


def _build(cls: type, raw: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "<top level>"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a section (mapping), got {type(raw).__name__} {raw!r}")
    hints = _type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            raise ConfigError(f"unknown config key {prefix}{key}{_suggest(prefix, str(key), cls)}")
    kwargs = {}
    for name, value in raw.items():
        kwargs[name] = _coerce(hints[name], value, f"{prefix}{name}")
    return cls(**kwargs)


def _suggest(prefix: str, key: str, cls: type) -> str:
    """Closest valid key: among this section's keys first, then among every dotted key of the schema."""
    local = difflib.get_close_matches(key, [f.name for f in dataclasses.fields(cls)], n=1, cutoff=0.6)
    if local:
        return f"; did you mean {prefix}{local[0]}?"
    everywhere = difflib.get_close_matches(f"{prefix}{key}", _all_keys(Config), n=1, cutoff=0.6)
    return f"; did you mean {everywhere[0]}?" if everywhere else ""


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    hints = _type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += _all_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def _coerce(tp: Any, value: Any, key: str) -> Any:
    """Check (and minimally convert: int -> float, list -> tuple) one value against its annotation."""
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, f"{key}.")
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key)
            except ConfigError as e:
                if "finite" in str(e):  # the right type, a wrong value: say so, not "expected float or null"
                    raise
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: a list of any length
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return tuple(_coerce(args[0], v, key) for v in value)
    if origin is tuple:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(a, v, key) for a, v in zip(args, value, strict=True))
    if tp is float:
        number = _as_float(value)
        if number is not None:
            if not math.isfinite(number):
                raise ConfigError(f"{key}: must be a finite number, got {value!r}")
            return number
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is bool or tp is str:
        if isinstance(value, tp):
            return value
    else:
        raise AssertionError(f"config schema type {tp} of {key} is not handled")
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


def _as_float(value: Any) -> float | None:
    """A number, or a numeric string (YAML reads 1e-6, without a dot, as a string); None otherwise."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    if args and typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(_plain(to_dict(cfg)), sort_keys=False))
    tmp.replace(path)


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    return obj


# ---------------------------------------------------------------------------------------- validation
def env_world_size() -> int:
    """World size from torchrun's environment (1 without torchrun); read before any process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def validate(cfg: Config, world_size: int, *, local_files: bool = True) -> None:
    """Check `cfg` for `world_size` ranks; raise ConfigError on the first violation.

    Order: the world size itself, each section's own rules (its `check`, sections in declaration order),
    then the rules relating several sections or the world size. With `local_files` (everything but a
    `--dry-run`, which plans a job for another machine) also what must exist here: each section's
    `check_files` (model, data, prompt template, reward file, resume directory) and the training set's size
    against the batch.
    """
    _require(world_size >= 1, f"world size must be >= 1, got {world_size}")
    _check_sections(cfg, "", "check")
    _check_batch_split(cfg, world_size)
    _check_dapo(cfg)
    _check_across_sections(cfg)
    if local_files:
        _check_sections(cfg, "", "check_files")
        _check_data_size(cfg)


def _check_sections(section: Any, prefix: str, method: str) -> None:
    """`section.<method>(prefix)` where the section has one, then the same for its subsections, depth first."""
    if hasattr(section, method):
        getattr(section, method)(prefix)
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            _check_sections(value, f"{prefix}{f.name}.", method)


BUILTIN_REWARD_KEYS = ("overall", "accuracy", "format")
"""The keys the built-in rewards return (what algorithm.filter_groups.metric may name with them)."""


def _check_across_sections(cfg: Config) -> None:
    """Settings that are only wrong together: validation without a validation set, a DAPO metric the
    built-in reward does not return."""
    t, d = cfg.trainer, cfg.data
    _require(
        d.val_files is not None or (t.val_freq == -1 and not t.val_before_train),
        f"trainer.val_freq ({t.val_freq}) / trainer.val_before_train ({t.val_before_train}) ask for "
        "validation but data.val_files is not set (set it, or val_freq=-1 and val_before_train=false)",
    )
    fg = cfg.algorithm.filter_groups
    _require(
        not fg.enable
        or cfg.worker.reward.reward_function not in BUILTIN_REWARDS
        or fg.metric in BUILTIN_REWARD_KEYS,
        f"algorithm.filter_groups.metric must be one of {', '.join(BUILTIN_REWARD_KEYS)} with the built-in "
        f"reward {cfg.worker.reward.reward_function!r}, got {fg.metric!r}",
    )


def _check_data_size(cfg: Config) -> None:
    """The training set (counted from parquet footers, or the builtin size) holds one rollout batch; a hub
    data set is counted when it loads."""
    d = cfg.data
    try:
        rows = count_rows(d.train_files, d.num_builtin_examples)
    except ConfigError as e:
        raise ConfigError(f"data.train_files: {e}") from None
    _require(
        rows is None or rows >= d.rollout_batch_size,
        f"data.rollout_batch_size ({d.rollout_batch_size}) must be <= the rows of data.train_files "
        f"({rows} in {d.train_files})",
    )


def _check_batch_split(cfg: Config, world_size: int) -> None:
    """Prompts, samples, mini- and micro-batches split evenly over the ranks and the TP groups."""
    d, a, r = cfg.data, cfg.worker.actor, cfg.worker.rollout
    _require(
        d.rollout_batch_size % world_size == 0,
        f"data.rollout_batch_size ({d.rollout_batch_size}) must be divisible by the world size ({world_size})",
    )
    tp = r.tensor_parallel_size
    _require(
        world_size % tp == 0,
        f"worker.rollout.tensor_parallel_size ({tp}) must divide the world size ({world_size})",
    )
    num_samples = d.rollout_batch_size * r.n
    _require(
        a.global_batch_size % world_size == 0,
        f"worker.actor.global_batch_size ({a.global_batch_size}) must be divisible by the world size ({world_size})",
    )
    _require(
        num_samples % a.global_batch_size == 0,
        f"data.rollout_batch_size * worker.rollout.n ({num_samples}) must be divisible by "
        f"worker.actor.global_batch_size ({a.global_batch_size})",
    )
    per_rank_mini = a.global_batch_size // world_size
    _require(
        per_rank_mini % a.micro_batch_size_per_device_for_update == 0,
        f"worker.actor.global_batch_size / world size ({per_rank_mini}) must be divisible by "
        f"worker.actor.micro_batch_size_per_device_for_update ({a.micro_batch_size_per_device_for_update})",
    )


def _check_dapo(cfg: Config) -> None:
    """DAPO's switches against the batch sizes and the response length."""
    d, a, r = cfg.data, cfg.worker.actor, cfg.worker.rollout
    fg = cfg.algorithm.filter_groups
    if fg.enable:
        target = fg.num_train_groups(d.rollout_batch_size)
        _require(
            target * r.n % a.global_batch_size == 0,
            f"algorithm.filter_groups.train_batch_size * worker.rollout.n ({target * r.n}) must be divisible by "
            f"worker.actor.global_batch_size ({a.global_batch_size})",
        )
    ob = cfg.algorithm.overlong_buffer
    _require(
        not ob.enable or 0 < ob.length <= d.max_response_length,
        f"algorithm.overlong_buffer.length ({ob.length}) must be in (0, data.max_response_length={d.max_response_length}]",
    )
