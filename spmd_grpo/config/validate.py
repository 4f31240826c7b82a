"""`validate(cfg, world_size)`: the rules across sections and with the world size, before any process group
or model exists (a field's own range and its section's rules were checked at load); `ignored_settings`: the
one place that names settings with nothing to do on a device."""

from __future__ import annotations

from spmd_grpo.config.checks import BUILTIN_REWARD_KEYS, BUILTIN_REWARDS, C_INT_MAX, require
from spmd_grpo.config.schema import Config


def validate(cfg: Config, world_size: int) -> None:
    """Raise ConfigError naming the dotted key at the first violation. What must exist on this machine is
    `spmd_grpo.run.preflight` (a `--dry-run` plans for another one and skips it)."""
    d, a, r = cfg.data, cfg.worker.actor, cfg.worker.rollout
    require(world_size >= 1, f"world size must be >= 1, got {world_size}")
    require(
        a.model.model_path != "", "worker.actor.model.model_path must be set (a local directory or HF id)"
    )
    batch, gbs, n = "worker.actor.global_batch_size", a.global_batch_size, r.n
    for what, value, by_what, by in [  # the DAPO row repeats the third unless filter_groups sets its own size
        ("data.rollout_batch_size", d.rollout_batch_size, "the world size", world_size),
        (batch, gbs, "the world size", world_size),
        ("data.rollout_batch_size * worker.rollout.n", d.rollout_batch_size * n, batch, gbs),
        ("algorithm.filter_groups.train_batch_size * worker.rollout.n", cfg.num_train_groups * n, batch, gbs),
        (f"{batch} / world size", gbs // world_size, "worker.actor.micro_batch_size_per_device_for_update",
         a.micro_batch_size_per_device_for_update),
    ]:  # fmt: skip
        require(value % by == 0, f"{what} ({value}) must be divisible by {by_what} ({by})")
    for key, size in [("rollout.tensor_parallel_size", r.tensor_parallel_size),
                      ("actor.fsdp.expert_parallel_size", a.fsdp.expert_parallel_size)]:  # fmt: skip
        require(world_size % size == 0, f"worker.{key} ({size}) must divide the world size ({world_size})")
    _rules_across_sections(cfg)


def _rules_across_sections(cfg: Config) -> None:
    """Settings that are only wrong together (each message says how to resolve it)."""
    d, a, r, fg, t = cfg.data, cfg.worker.actor, cfg.worker.rollout, cfg.algorithm.filter_groups, cfg.trainer
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
        not (lora.enabled and r.lora_sync == "adapter")
        or (lora.target_modules == "all-linear" or "lm_head" not in lora.target_modules),
        "worker.rollout.lora_sync=adapter cannot serve an adapter on lm_head "
        "(worker.actor.model.lora.target_modules): vLLM has no LoRA on the output head; use merged",
    )
    require(
        a.reuse_image_features is not True or r.limit_videos == 0,
        "worker.actor.reuse_image_features=true needs worker.rollout.limit_videos=0 (transformers takes "
        "precomputed features for all modalities of a forward or none); auto turns it on where it applies",
    )
    on_policy = (  # one mini-batch, one epoch, no rejection: the update's first forward is the old policy's
        a.global_batch_size == cfg.num_train_groups * r.n
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
        a.moe.routing_replay != "rollout" or r.tensor_parallel_size == 1,
        "worker.actor.moe.routing_replay=rollout needs worker.rollout.tensor_parallel_size=1 (got "
        f"{r.tensor_parallel_size}): vLLM 0.32 returns routed experts from a TP group's first rank only, which "
        "fails the other ranks' schedulers under torchrun; use old or none",
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
