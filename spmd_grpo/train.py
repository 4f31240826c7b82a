"""GRPO for Qwen2.5-VL as plain SPMD: `torchrun [...] -m spmd_grpo.train cfg.yaml [section.key=value ...]`.

The same code runs on every rank, top to bottom:
    rollout (push weights if the policy changed -> generate -> sleep) -> reward -> old logprobs
    -> reference logprobs -> advantages -> update (mini-batches x micro-batches x ppo_epochs) -> metrics

The config is loaded and validated against the world size from torchrun's environment BEFORE any process
group or model exists; a config error prints one line on stderr and exits with code 2.

Semantics (verl's unless noted; formulas in advantage.py / loss.py):
  * Each rank owns rollout_batch_size / world prompts and all n samples of each; group statistics use
    collectives anyway, so they stay right wherever a group's samples live.
  * Old logprobs are recomputed by the trainer (not taken from vLLM) before the update. With one
    mini-batch and one epoch they equal the current logprobs, so the ratio is exactly 1 at the update and
    only the clip-free policy gradient acts (as in verl).
  * Loss aggregation uses GLOBAL token/sequence counts of the mini-batch (all ranks, all micro-batches);
    verl's legacy mean of micro-batch means is not reproduced. FSDP averages gradients over ranks, so the
    per-rank loss is multiplied by the world size to recover the global sum.
  * Rollout logprobs from vLLM are only used for `rollout/logprob_diff_*` (the mismatch users must see).
"""

from __future__ import annotations

import sys

from .config import Config, ConfigError, env_world_size, load_config, validate


def parse_args(argv: list[str]) -> tuple[str | None, list[str], dict[str, int] | None]:
    """`cfg.yaml [key=value ...] [--dry-run [--nnodes N] [--nproc-per-node M] [--device-memory-gb G]]`."""
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0)
    dry_run = None
    rest = []
    it = iter(argv)
    for arg in it:
        if arg == "--dry-run":
            dry_run = dry_run or {}
        elif arg in ("--nnodes", "--nproc-per-node", "--device-memory-gb"):
            value = next(it, None)
            if value is None or not value.isdigit() or int(value) < 1:
                raise ConfigError(f"{arg} needs a positive integer, got {value!r}")
            dry_run = dry_run or {}
            dry_run[arg.lstrip("-").replace("-", "_")] = int(value)
        elif arg.startswith("--"):
            raise ConfigError(
                f"unknown option {arg} (options: --dry-run, --nnodes N, --nproc-per-node M, --device-memory-gb G)"
            )
        else:
            rest.append(arg)
    path = rest[0] if rest and "=" not in rest[0] else None
    return path, rest[1:] if path is not None else rest, dry_run


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        path, overrides, dry_run = parse_args(argv)
        cfg = load_config(path, overrides)
        if dry_run is not None:
            from .plan import dry_run as plan

            print(
                plan(
                    cfg,
                    dry_run.get("nnodes", 1),
                    dry_run.get("nproc_per_node", 8),
                    dry_run.get("device_memory_gb", 80),
                )
            )
            return
        validate(cfg, env_world_size())
    except (ConfigError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    run(cfg)


def run(cfg: Config) -> None:
    import logging
    import os
    import signal
    from functools import partial

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch
    from tqdm import tqdm
    from transformers import AutoProcessor

    from . import distributed as D
    from .advantage import compute_batch_std_advantages, compute_grpo_advantages
    from .checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
    from .config import dump_yaml
    from .data import PromptSampler, load_dataset
    from .dynamic_sampling import count_groups, kept_groups, select_and_rebalance
    from .engine import RolloutEngine, iter_sharded_weights
    from .metrics import MetricsWriter, Timer, console_line, global_means, global_stats
    from .model import (
        build_optimizer,
        build_policy,
        build_reference,
        clip_grad_norm,
        move_optimizer_state,
        resolve_dtype,
    )
    from .reward import load_reward_function, overlong_penalty, score_samples
    from .rollout import Prompt, SamplingConfig, attach_pixel_values, generate
    from .update import compute_logprobs, update_policy
    from .validation import validate

    world = D.init_distributed(cfg.trainer.device, cfg.trainer.collective_timeout_s)
    logging.basicConfig(
        level=logging.INFO if world.is_main else logging.WARNING,
        format=f"[rank{world.rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    log = logging.getLogger("spmd_grpo")
    D.seed_everything(cfg.trainer.seed)
    d, actor, rollout_cfg, alg = cfg.data, cfg.worker.actor, cfg.worker.rollout, cfg.algorithm

    # ---- data, models, engine: built once
    model_path = actor.model.model_path
    processor = AutoProcessor.from_pretrained(
        actor.model.tokenizer_path or model_path, min_pixels=d.min_pixels, max_pixels=d.max_pixels
    )
    dataset = load_dataset(d, processor, "train")
    val_examples = load_dataset(d, processor, "val") if d.val_files else []
    if d.val_max_samples > 0:
        val_examples = val_examples[: d.val_max_samples]
    sampler = PromptSampler(
        len(dataset), d.rollout_batch_size, world.rank, world.world_size, d.seed, d.shuffle
    )
    total_steps = cfg.trainer.max_steps or cfg.trainer.total_epochs * sampler.steps_per_epoch
    policy = build_policy(actor, world)
    optim = build_optimizer(policy, actor.optim, total_steps)
    reference = build_reference(actor, cfg.worker.ref.offload_params, world) if alg.use_kl_loss else None
    tp_group = D.new_tp_groups(world, rollout_cfg.tensor_parallel_size)
    tie = bool(policy.config.tie_word_embeddings)
    rollout_dtype = resolve_dtype(rollout_cfg.dtype, world.device_type)
    engine = RolloutEngine(
        model_path,
        rollout_cfg,
        world,
        max_model_len=d.max_prompt_length + d.max_response_length,
        dtype=rollout_dtype,
        min_pixels=d.min_pixels,
        max_pixels=d.max_pixels,
        seed=cfg.trainer.seed,
        tie_word_embeddings=tie,
    )
    engine.stats.synced_version = 0  # the engine loaded the same weights from disk
    reward_fn = load_reward_function(cfg.worker.reward.reward_function)
    tokenizer = processor.tokenizer
    stop_ids = [
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    ]
    sampling = SamplingConfig(
        rollout_cfg.n,
        rollout_cfg.temperature,
        rollout_cfg.top_p,
        rollout_cfg.top_k,
        d.max_response_length,
        cfg.trainer.seed,
    )
    frozen_vision = actor.model.freeze_vision_tower
    offload_optimizer = actor.fsdp.offload_optimizer and world.device_type != "cpu"
    if actor.fsdp.offload_optimizer and world.device_type == "cpu" and world.is_main:
        log.warning(
            "worker.actor.fsdp.offload_optimizer ignored on CPU: the optimizer state is already in host memory"
        )
    writer = MetricsWriter(cfg.run_dir, world.is_main)
    if world.is_main:
        dump_yaml(cfg, cfg.run_dir / "config.yaml")
        log.info(
            "run dir %s; %d prompts, %d steps, world %d",
            cfg.run_dir,
            len(dataset),
            total_steps,
            world.world_size,
        )

    def push_weights(timer: Timer, version: int) -> None:
        with timer("update_weights"):
            weights = iter_sharded_weights(
                policy,
                rollout_dtype,
                rollout_cfg.weight_sync_bucket_mb << 20,
                tie_word_embeddings=tie,
                skip=lambda name: frozen_vision and ".visual." in f".{name}",  # unchanged: the engine has it
            )
            engine.load_weights(weights, version)

    def run_validation(step: int, timer: Timer) -> dict[str, float]:
        with timer("testing"):
            engine.prepare_for_rollout(lambda: push_weights(timer, version))
            out = validate(
                cfg,
                world,
                engine,
                val_examples,
                reward_fn,
                step,
                tp_group=tp_group,
                stop_token_ids=stop_ids,
                run_dir=cfg.run_dir,
            )
            engine.sleep()
        return out

    def validation_due(step: int) -> bool:
        if not val_examples:
            return False
        if step == 0:
            return cfg.trainer.val_before_train
        return cfg.trainer.val_freq > 0 and (step % cfg.trainer.val_freq == 0 or step == total_steps)

    def rollout_and_score(step: int, gen_batch: int, timer: Timer) -> list:
        """One generation batch: this rank's prompts -> samples with reward scores (and overlong shaping)."""
        prompts = [
            Prompt(uid, ex.prompt_token_ids, ex.images, ex.answer, {"data_source": ex.data_source})
            for uid, pos in sampler.next_batch()
            for ex in [dataset[pos]]
        ]
        with timer("gen"):
            if offload_optimizer:  # AdamW state leaves the device while vLLM is awake
                move_optimizer_state(optim.optimizer, "cpu")
            D.set_expandable_segments(world.device_type, False)  # vLLM's allocator owns memory now
            engine.prepare_for_rollout(lambda: push_weights(timer, version))
            if cfg.trainer.log_memory:
                log.info(D.memory_line(world.device_type, "wake + weight push"))
            samples = generate(
                engine,
                prompts,
                sampling,
                step,
                tp_group=tp_group,
                stop_token_ids=stop_ids,
                gen_batch=gen_batch,
            )
            engine.sleep()
            D.set_expandable_segments(world.device_type, True)
            if offload_optimizer:
                move_optimizer_state(optim.optimizer, world.device)
            if cfg.trainer.log_memory:
                log.info(D.memory_line(world.device_type, "rollout + sleep"))
        attach_pixel_values(samples, processor.image_processor)
        with timer("reward"):
            rewards = score_samples(
                reward_fn, [s.reward_input() for s in samples], batch_name=f"step {step} rank {world.rank}"
            )
            ob = alg.overlong_buffer
            if ob.enable:  # DAPO overlong shaping, added to the score (logged as reward/overlong_penalty)
                lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
                penalty = overlong_penalty(lengths, d.max_response_length, ob.length, ob.penalty_factor)
                rewards["overlong_penalty"] = penalty
                rewards["overall"] = rewards["overall"] + penalty
        for i, s in enumerate(samples):
            s.scores = {k: float(v[i]) for k, v in rewards.items()}
        return samples

    # ---- resume: policy, optimizer, schedule, data position, policy version, RNG
    version, start_step = 0, 1
    checkpoint = find_checkpoint(cfg.run_dir, cfg.trainer.resume)
    if checkpoint is not None:
        state = load_checkpoint(checkpoint, policy=policy, optim=optim, world=world)
        sampler.load_state_dict(state["sampler"])
        version, start_step = state["version"], state["step"] + 1
        if writer.rollback(state["step"]):
            log.warning(
                "metrics of steps after %d moved to metrics.rolledback.jsonl: they are redone", state["step"]
            )

    def save(step: int, timer: Timer) -> None:
        with timer("save_checkpoint"):
            trainer_state = {"step": step, "version": version, "sampler": sampler.state_dict()}
            save_checkpoint(cfg.run_dir, step, policy=policy, optim=optim, trainer_state=trainer_state, world=world,
                            save_limit=cfg.trainer.save_limit, model_path=model_path)  # fmt: skip

    # SIGTERM/SIGINT (Slurm preemption, Ctrl-C): finish the step, save, exit non-zero. All ranks agree on the
    # stop at the step boundary (a collective), so they save together.
    stop_signal: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop_signal.append(signum))

    if validation_due(0) and start_step == 1:
        timer = Timer(world.device_type)
        m = run_validation(0, timer)
        m.update(timer.metrics())
        writer.write(0, m)
        if world.is_main:
            log.info(console_line(0, total_steps, m))
    bar = tqdm(
        total=total_steps, initial=start_step - 1, disable=not world.is_main, desc="grpo", dynamic_ncols=True
    )
    stopping = False
    for step in range(start_step, total_steps + 1):
        timer = Timer(world.device_type)
        with timer("step"):
            # ---- rollout + reward; with DAPO dynamic sampling, until enough groups have signal
            fg = alg.filter_groups
            target_groups = fg.train_batch_size if fg.train_batch_size > 0 else d.rollout_batch_size
            samples, num_gen_batches, num_groups_generated, generated_scores = [], 0, 0, []
            while True:
                batch_samples = rollout_and_score(step, num_gen_batches, timer)
                generated_scores += [s.scores["overall"] for s in batch_samples]
                num_gen_batches += 1
                if not fg.enable:
                    samples = batch_samples
                    break
                num_groups_generated += d.rollout_batch_size
                samples += kept_groups(batch_samples, fg.metric, d.rollout_batch_size)
                num_kept = count_groups(samples)
                if num_kept >= target_groups:  # every rank sees the same global count: same branch
                    samples = select_and_rebalance(samples, target_groups, world)
                    break
                if 0 < fg.max_num_gen_batches <= num_gen_batches:
                    raise RuntimeError(
                        f"DAPO dynamic sampling: only {num_kept} of {target_groups} groups had non-zero spread of "
                        f"'{fg.metric}' after {num_gen_batches} generation batches "
                        f"(algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches}); raise the limit, "
                        "set it <= 0 for no limit, or check the reward"
                    )
            rewards = {k: torch.tensor([s.scores[k] for s in samples]) for k in samples[0].scores}
            scores = rewards["overall"]

            # ---- old and reference logprobs (trainer side, forward only)
            temperature = rollout_cfg.temperature
            with timer("old_log_prob"):
                old_logprobs = compute_logprobs(policy, samples, actor, temperature, tokenizer.pad_token_id)
            ref_logprobs = None
            if reference is not None:
                with timer("ref"):
                    ref_logprobs = compute_logprobs(
                        reference, samples, actor, temperature, tokenizer.pad_token_id
                    )

            # ---- advantages: group statistics over all ranks
            with timer("adv"):
                group_index = torch.tensor([s.group_index for s in samples], dtype=torch.long)
                num_groups = target_groups if fg.enable else d.rollout_batch_size
                estimator = (
                    compute_batch_std_advantages
                    if alg.adv_std_scope == "batch"
                    else partial(
                        compute_grpo_advantages,
                        norm_by_std=alg.adv_estimator == "grpo" and alg.norm_adv_by_std_in_grpo,
                    )
                )
                advantages, adv_metrics = estimator(
                    scores, group_index, num_groups, eps=alg.adv_eps, all_reduce_sum=D.all_reduce_sum
                )

            # ---- update
            with timer("update_actor"):
                update_metrics = update_policy(
                    policy,
                    optim,
                    samples,
                    old_logprobs,
                    ref_logprobs,
                    advantages,
                    actor,
                    alg,
                    d,
                    temperature,
                    tokenizer.pad_token_id,
                    world,
                    clip_grad_norm,
                )
            if cfg.trainer.log_memory:
                log.info(D.memory_line(world.device_type, "update"))
            version += 1

        # ---- validation (after the update: it measures the new policy)
        val_metrics = run_validation(step, timer) if validation_due(step) else {}

        # ---- checkpoint: every save_freq steps, at the end, and when asked to stop
        stopping = D.any_rank(bool(stop_signal), world.device)
        save_freq = cfg.trainer.save_freq
        if stopping or (save_freq > 0 and (step % save_freq == 0 or step == total_steps)):
            save(step, timer)

        # ---- metrics (global over ranks)
        m = timer.metrics()
        m.update(val_metrics)
        if fg.enable:
            # The kept batch has spread by construction; this is the score of everything generated.
            m.update(global_stats("train/gen_score", torch.tensor(generated_scores)))
            m["train/num_gen_batches"] = float(num_gen_batches)
            m["train/kept_group_frac"] = num_kept / max(1, num_groups_generated)
        m.update(update_metrics)
        m.update({f"adv/{k.split('/')[-1]}": v for k, v in adv_metrics.items()})
        m.update(global_stats("critic/score", scores))
        m.update(global_stats("critic/rewards", scores))
        m.update(global_stats("critic/advantages", advantages))
        m.update(
            global_means(
                {f"reward/{k}": (float(v.sum()), v.numel()) for k, v in rewards.items() if k != "overall"}
            )
        )
        response_lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
        prompt_lengths = torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.float64)
        m.update(global_stats("response_length", response_lengths))
        m.update(global_stats("prompt_length", prompt_lengths))
        clipped = sum(len(s.response_ids) >= d.max_response_length for s in samples)
        diffs = [
            abs(a - b)
            for s, old in zip(samples, old_logprobs, strict=True)
            for a, b in zip(s.rollout_logprobs, old.tolist(), strict=True)
        ]
        m.update(
            global_means(
                {
                    "response_length/clip_ratio": (clipped, len(samples)),
                    "rollout/logprob_diff_mean": (sum(diffs), len(diffs)),
                }
            )
        )
        m["rollout/logprob_diff_max"] = float(D.all_reduce_max(torch.tensor([max(diffs, default=0.0)])))
        total_tokens = float(
            D.all_reduce_sum(
                torch.tensor([float(response_lengths.sum() + prompt_lengths.sum())], dtype=torch.float64)
            )
        )
        m["perf/total_num_tokens"] = total_tokens
        m["perf/time_per_step"] = m["timing_s/step"]
        m["perf/throughput"] = total_tokens / (m["timing_s/step"] * world.world_size)
        m["perf/max_memory_allocated_gb"] = float(
            D.all_reduce_max(torch.tensor([D.max_memory_allocated_gb(world.device_type)]))
        )
        m["perf/cpu_memory_used_gb"] = float(D.all_reduce_max(torch.tensor([D.cpu_memory_used_gb()])))
        writer.write(step, m)
        if world.is_main:
            bar.update(1)
            if step % cfg.trainer.log_every == 0 or step == total_steps:
                bar.write(console_line(step, total_steps, m))
        if stopping:
            log.warning(
                "stop requested by signal %s: checkpoint of step %d saved, exiting", stop_signal or "?", step
            )
            break
    bar.close()
    D.barrier()
    engine.shutdown()
    D.destroy()
    if stopping:
        raise SystemExit(128 + (stop_signal[0] if stop_signal else signal.SIGTERM))


if __name__ == "__main__":
    main()
