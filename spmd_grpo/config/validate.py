"""`validate(cfg, world_size)`: the rules across sections and the world size (batch divisibility, tensor
parallelism, DAPO settings), before any process group or model exists; each field's own type and range, and
the rules within a section, were checked when the config was loaded. Errors are `ConfigError`s naming the
dotted key. `ignored_settings` is the one place that says which settings have nothing to do on this device.
"""

from __future__ import annotations

from spmd_grpo.config.checks import BUILTIN_REWARD_KEYS, BUILTIN_REWARDS, C_INT_MAX, require
from spmd_grpo.config.schema import Config


def validate(cfg: Config, world_size: int) -> None:
    """Check `cfg` for `world_size` ranks; raise ConfigError on the first violation. What must exist on
    this machine is `spmd_grpo.run.preflight` (a `--dry-run` plans for another one and skips it)."""
    d, a, r = cfg.data, cfg.worker.actor, cfg.worker.rollout
    require(world_size >= 1, f"world size must be >= 1, got {world_size}")
    require(
        a.model.model_path != "", "worker.actor.model.model_path must be set (a local directory or HF id)"
    )
    _divisible("data.rollout_batch_size", d.rollout_batch_size, "the world size", world_size)
    for key, size in [
        ("worker.rollout.tensor_parallel_size", r.tensor_parallel_size),
        ("worker.actor.fsdp.expert_parallel_size", a.fsdp.expert_parallel_size),
    ]:
        require(world_size % size == 0, f"{key} ({size}) must divide the world size ({world_size})")
    batch = "worker.actor.global_batch_size"
    _divisible(batch, a.global_batch_size, "the world size", world_size)
    _divisible(
        "data.rollout_batch_size * worker.rollout.n", d.rollout_batch_size * r.n, batch, a.global_batch_size
    )
    per_rank = a.global_batch_size // world_size
    micro = "worker.actor.micro_batch_size_per_device_for_update"
    _divisible(f"{batch} / world size", per_rank, micro, a.micro_batch_size_per_device_for_update)
    if cfg.algorithm.filter_groups.enable:
        what = "algorithm.filter_groups.train_batch_size * worker.rollout.n"
        _divisible(what, cfg.num_train_groups * r.n, batch, a.global_batch_size)
    _check_across_sections(cfg)


def _divisible(what: str, n: int, by_what: str, by: int) -> None:
    require(n % by == 0, f"{what} ({n}) must be divisible by {by_what} ({by})")


def _check_across_sections(cfg: Config) -> None:
    """Settings that are only wrong together (each message says how to resolve it)."""
    t, d, a, fg = cfg.trainer, cfg.data, cfg.worker.actor, cfg.algorithm.filter_groups
    require(
        cfg.max_model_len <= C_INT_MAX,
        f"data.max_prompt_length + data.max_response_length ({cfg.max_model_len}) must fit a C int "
        f"(<= {C_INT_MAX}): it is vLLM's max_model_len",
    )
    ob = cfg.algorithm.overlong_buffer
    require(
        not ob.enable or 0 < ob.length <= d.max_response_length,
        f"algorithm.overlong_buffer.length ({ob.length}) must be in (0, data.max_response_length={d.max_response_length}]",
    )
    require(
        d.val_files is not None or (t.val_freq == -1 and not t.val_before_train),
        f"trainer.val_freq ({t.val_freq}) / trainer.val_before_train ({t.val_before_train}) ask for "
        "validation but data.val_files is not set (set it, or val_freq=-1 and val_before_train=false)",
    )
    lora = a.model.lora
    require(
        not (lora.enabled and cfg.worker.rollout.lora_sync == "adapter")
        or (lora.target_modules == "all-linear" or "lm_head" not in lora.target_modules),
        "worker.rollout.lora_sync=adapter cannot serve an adapter on lm_head "
        "(worker.actor.model.lora.target_modules): vLLM has no LoRA on the output head; use merged",
    )
    require(
        a.reuse_image_features is not True or cfg.worker.rollout.limit_videos == 0,
        "worker.actor.reuse_image_features=true needs worker.rollout.limit_videos=0 (transformers takes "
        "precomputed features for all modalities of a forward or none); auto turns it on where it applies",
    )
    on_policy = (  # one mini-batch, one epoch, no rejection: the update's first forward is the old policy's
        a.global_batch_size == cfg.num_train_groups * cfg.worker.rollout.n
        and a.ppo_epochs == 1
        and cfg.algorithm.rollout_correction.rollout_rs is None
    )
    require(
        a.old_logprobs_from_update is not True or on_policy,
        "worker.actor.old_logprobs_from_update=true needs an exactly on-policy step: one mini-batch "
        "(worker.actor.global_batch_size = data.rollout_batch_size * worker.rollout.n), ppo_epochs 1 and no "
        "algorithm.rollout_correction.rollout_rs; auto takes them from the update where that holds",
    )
    require(
        a.moe.routing_replay != "rollout" or cfg.worker.rollout.tensor_parallel_size == 1,
        "worker.actor.moe.routing_replay=rollout needs worker.rollout.tensor_parallel_size=1 (got "
        f"{cfg.worker.rollout.tensor_parallel_size}): vLLM 0.32 returns routed experts from the first rank of a "
        "TP group only, and under torchrun every rank's own scheduler asks its worker for them (an assertion "
        "fails on the other ranks at the first step); use old or none",
    )
    require(
        not fg.enable
        or cfg.worker.reward.reward_function not in BUILTIN_REWARDS
        or fg.metric in BUILTIN_REWARD_KEYS,
        f"algorithm.filter_groups.metric must be one of {', '.join(BUILTIN_REWARD_KEYS)} with the built-in "
        f"reward {cfg.worker.reward.reward_function!r}, got {fg.metric!r}",
    )


def ignored_settings(cfg: Config, device_type: str) -> list[str]:
    """ "<key> ignored: <why>" for each setting that has nothing to do on `device_type` (logged once)."""
    notes, fsdp = [], cfg.worker.actor.fsdp
    if fsdp.offload_optimizer and (device_type == "cpu" or fsdp.offload_params):
        where = "on CPU" if device_type == "cpu" else "with offload_params"
        notes.append(
            f"worker.actor.fsdp.offload_optimizer ignored {where}: the optimizer state is in host memory"
        )
    if device_type == "cpu" and cfg.worker.rollout.enable_sleep_mode:
        notes.append("worker.rollout.enable_sleep_mode ignored: vLLM has no sleep mode on CPU")
    return notes
