"""The GRPO training loop: one `Trainer` per rank, running the same code on every rank (SPMD).

`Trainer.train` is the step as plain calls: rollout (generate + reward; DAPO repeats it until enough groups
have spread) -> advantages -> old and reference logprobs -> update -> validation when due -> the ranks agree
on stopping -> checkpoint when due -> metrics. The step call by call, with the module each call lives in,
and the design decisions behind it: docs/architecture.md. Each phase's semantics and its deviations from the
papers and verl are in the docstring of the module that implements it (rollout/engine.py,
algorithm/reward.py, algorithm/advantage.py, actor/logprob_pass.py, actor/update.py, algorithm/loss.py,
run/checkpoint.py).

What this module decides:
  * `RunState` (step, policy version, stop signal) plus the prompt sampler's position is everything that
    changes from step to step; both are what a checkpoint restores.
  * The old logprobs of the PPO ratio are the trainer's recomputation (as verl), not vLLM's: vLLM's serve
    `rollout/logprob_diff_*` and, with `algorithm.rollout_correction`, its importance weights.
  * DAPO's overlong penalty is added to the reward's `overall` before the advantages (logged as
    `reward/overlong_penalty`), for training rollouts only: validation scores are the reward function's
    (verl's DAPO recipe gives its validation reward manager the same overlong buffer, so its validation
    reward includes the penalty; the accuracy behind `val-core/<source>/acc` is unaffected in both).
    `algorithm.norm_adv_by_std_in_grpo` picks the advantage function.
  * The weight sync is never a phase of its own: it needs vLLM's wake sequence, so the new version is pushed
    inside the next `rollout_mode`, the validation's or the next step's rollout.
  * A checkpoint is saved every `trainer.save_freq` steps and after the last (when save_freq > 0), and at the
    step boundary where the ranks agreed to stop on SIGTERM/SIGINT; the run then exits with 128 + signal.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from spmd_grpo.actor.image_features import encode_images
from spmd_grpo.actor.logprob_pass import compute_logprobs, compute_ref_logprobs
from spmd_grpo.actor.optimizer import build_optimizer
from spmd_grpo.actor.spec import UpdateSpec
from spmd_grpo.actor.update import update_policy
from spmd_grpo.algorithm.advantage import compute_batch_std_advantages, compute_grpo_advantages
from spmd_grpo.algorithm.reward import load_reward_function, overlong_penalty, score_samples
from spmd_grpo.config.schema import Config
from spmd_grpo.config.validate import ignored_settings
from spmd_grpo.data.dataset import DataError, load_dataset
from spmd_grpo.data.prompts import processor_sizes
from spmd_grpo.data.sampler import PromptSampler
from spmd_grpo.data.samples import Prompt, Sample
from spmd_grpo.models.build import build_policy, build_reference
from spmd_grpo.models.families import family_of
from spmd_grpo.models.moe.metrics import moe_metrics
from spmd_grpo.parallel import collectives
from spmd_grpo.parallel.collectives import World
from spmd_grpo.parallel.devices import memory_line, seed_everything
from spmd_grpo.parallel.signals import (
    StopOnSignal,
    exit_promptly,
    say_once_and_exit,
    warn_if_grace_outlasts_shutdown,
)
from spmd_grpo.rollout.dynamic_sampling import collect_groups
from spmd_grpo.rollout.engine import RolloutEngine
from spmd_grpo.rollout.generate import SamplingConfig, attach_pixel_values, attach_video_inputs, generate
from spmd_grpo.rollout.validation import VAL_SEED_OFFSET, validate
from spmd_grpo.run.checkpoint import load_or_fall_back, save_checkpoint
from spmd_grpo.run.lineage import abandon_branch, agree_on_start
from spmd_grpo.run.saved_config import plain_config, write_run_config
from spmd_grpo.run.start import StartPlan, plan_start
from spmd_grpo.run.verify import verify_start
from spmd_grpo.telemetry.loggers import Loggers, build_loggers, setup_logging
from spmd_grpo.telemetry.metrics import Timer, perf_metrics, sample_metrics

log = logging.getLogger("spmd_grpo")


@dataclass
class RunState:
    """What changes from step to step (with the sampler's position, what a checkpoint restores)."""

    step: int = 0
    """The last finished step (0 before training)."""
    version: int = 0
    """Policy version: optimizer updates applied so far; the engine syncs when it holds another one."""
    stop_signal: int | None = None
    """The stop signal the ranks agreed on at the last step boundary (SIGTERM/SIGINT on any rank): save that
    step, exit with 128 + signal."""


class Trainer:
    """Everything one rank holds for a run: data, policy, optimizer, reference, engine, loggers, state."""

    def __init__(self, cfg: Config, world: World, plan: StartPlan, stop: StopOnSignal | None = None) -> None:
        from transformers import AutoProcessor

        self.cfg, self.world, self.state, self.plan = cfg, world, RunState(), plan
        self.stop = stop or StopOnSignal(cfg.trainer.preempt_grace_s)
        d, actor = cfg.data, cfg.worker.actor
        self.processor = AutoProcessor.from_pretrained(
            actor.model.tokenizer_path or actor.model.model_path,
            trust_remote_code=actor.model.trust_remote_code,
        )
        # The one decision of image and video sizes: the data loader, our processor calls and vLLM get it.
        self.sizes = processor_sizes(d, self.processor, cfg.worker.rollout.limit_videos)
        shard = dict(rank=world.rank, world_size=world.world_size, all_gather=collectives.all_gather_objects)
        shard["limit_images"] = cfg.worker.rollout.limit_images  # more images: skipped, vLLM would refuse
        shard["limit_videos"] = cfg.worker.rollout.limit_videos
        shard["sizes"] = self.sizes
        self.dataset = load_dataset(
            d, self.processor, "train", **shard
        )  # rows checked once, split over ranks
        self.val_examples = load_dataset(d, self.processor, "val", **shard) if d.val_files else []
        if d.val_max_samples > 0:
            self.val_examples = self.val_examples[: d.val_max_samples]
        self.sampler = PromptSampler(
            len(self.dataset),
            d.rollout_batch_size,
            world.rank,
            world.world_size,
            seed=d.seed,
            shuffle=d.shuffle,
        )
        self.total_steps = cfg.total_steps(self.sampler.steps_per_epoch)
        self.policy = build_policy(actor, world, seed=cfg.trainer.seed)
        self.optim = build_optimizer(self.policy, actor.optim, self.total_steps)
        self.reference = None  # with LoRA the reference is the policy with its adapters disabled
        if cfg.algorithm.use_kl_loss and not actor.model.lora.enabled:
            self.reference = build_reference(actor, cfg.worker.ref, world)
        self.tp_group = collectives.new_tp_groups(world, cfg.worker.rollout.tensor_parallel_size)
        tied = bool(self.policy.config.tie_word_embeddings)
        self.engine = RolloutEngine.from_config(cfg, world, tie_word_embeddings=tied, sizes=self.sizes)
        self.reward_fn = load_reward_function(
            cfg.worker.reward.reward_function, cfg.worker.reward.format_weight
        )
        self.sampling, self.val_sampling = self._sampling_configs()
        self.spec = UpdateSpec.from_config(
            cfg,
            world_size=world.world_size,
            pad_token_id=self.processor.tokenizer.pad_token_id,
            family=family_of(self.policy.config),
        )
        self.loggers = Loggers([])  # made in `_start`, after resume (they start after the resumed step)

    def _sampling_configs(self) -> tuple[SamplingConfig, SamplingConfig]:
        r, max_tokens, seed = (
            self.cfg.worker.rollout,
            self.cfg.data.max_response_length,
            self.cfg.trainer.seed,
        )
        tokenizer = self.processor.tokenizer
        stop = tuple(tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
        v = r.val_override
        return (
            SamplingConfig(r.n, r.temperature, r.top_p, r.top_k, max_tokens, seed, stop, r.ignore_eos),
            SamplingConfig(v.n, v.temperature, v.top_p, v.top_k, max_tokens, seed + VAL_SEED_OFFSET, stop),
        )

    # ------------------------------------------------------------------------------------------ the loop
    def train(self) -> None:
        self._start()
        last = self.state.step if self._agree_on_stop() else self.total_steps  # signalled while starting
        for step in range(self.state.step + 1, last + 1):
            timer = Timer(self.world.device_type, step)
            with timer("step"):
                samples, m = self.rollout(step, timer)
                with timer("adv"):
                    m.update(self.compute_advantages(samples))
                with timer("old_log_prob"):  # ~0 s when the update takes them from its own forward
                    encode_images(self.policy, samples, self.spec)  # spec.image_features per_step only
                    if not self.spec.old_logprobs_in_update(len(samples)):
                        for s, lp in zip(
                            samples, compute_logprobs(self.policy, samples, self.spec), strict=True
                        ):
                            s.old_logprobs = lp
                if self.cfg.algorithm.use_kl_loss:
                    with timer("ref"):
                        ref = compute_ref_logprobs(self.reference, self.policy, samples, self.spec)
                        for s, lp in zip(samples, ref, strict=True):
                            s.ref_logprobs = lp
                with timer("update_actor"):
                    m.update(update_policy(self.policy, self.optim, samples, self.spec, self.world))
                m.update(moe_metrics([self.policy, self.reference], collectives.all_reduce_sum))  # {}: dense
                self.state.version += 1
                self._log_memory("update")
            if self._validation_due(step):
                m.update(self.validate(step, timer))
            self.state.step = step
            stopping = self._agree_on_stop()
            save_freq = self.cfg.trainer.save_freq
            if stopping or (save_freq > 0 and (step % save_freq == 0 or step == self.total_steps)):
                self.save(step, timer)
            m.update(sample_metrics(samples, self.cfg.data.max_response_length))
            self.write_metrics(step, timer, m)
            if stopping:
                log.warning(
                    "stop requested by signal %d: checkpoint of step %d saved", self.state.stop_signal, step
                )
                break
        self._finish()

    def _start(self) -> None:
        """Resume, write the resolved config, listen for preemption, validate before training if asked."""
        self.resume()
        if self.world.is_main:
            write_run_config(self.cfg, self.state.step)
            log.info(
                "run dir %s; %d prompts, %d steps, world %d",
                self.cfg.run_dir,
                len(self.dataset),
                self.total_steps,
                self.world.world_size,
            )
        notes = [*ignored_settings(self.cfg, self.world.device_type), *self.spec.ignored]
        for note in notes if self.world.is_main else ():
            log.info(note)
        self.loggers = build_loggers(
            self.cfg, self.total_steps, start_step=self.state.step, enabled=self.world.is_main
        )
        self.stop.install()  # again: building vLLM may have set its own SIGTERM/SIGINT handlers
        warn_if_grace_outlasts_shutdown(self.cfg.trainer.preempt_grace_s, is_main=self.world.is_main)
        if self.state.step == 0 and self._validation_due(0):
            timer = Timer(self.world.device_type)
            self.write_metrics(0, timer, self.validate(0, timer))

    def _agree_on_stop(self) -> bool:
        """Collective, at a step boundary: did any rank get SIGTERM/SIGINT? Every rank gets the same answer
        (and the same signal in `state.stop_signal`), so they save and stop together."""
        signum = torch.tensor([self.stop.signum or 0], device=self.world.device)
        self.state.stop_signal = int(collectives.all_reduce_max(signum).item()) or None
        return self.state.stop_signal is not None

    def _finish(self) -> None:
        self.loggers.close()
        collectives.barrier()
        self.engine.shutdown()
        collectives.destroy()
        if self.state.stop_signal is not None:
            code = 128 + self.state.stop_signal
            since = time.monotonic() - (self.stop.received_at or time.monotonic())
            log.warning("rank %d exits with code %d, %.1f s after the signal", self.world.rank, code, since)
            raise SystemExit(code)

    # ------------------------------------------------------------------------------------------ phases
    def rollout(self, step: int, timer: Timer) -> tuple[list[Sample], dict[str, float]]:
        """This rank's scored samples for the step (with DAPO dynamic sampling: the kept, rebalanced ones)."""
        fg = self.cfg.algorithm.filter_groups
        if not fg.enable:
            samples, metrics = self._generate_and_score(step, 0, timer), {}
        else:
            samples, metrics = collect_groups(
                lambda gen_batch: self._generate_and_score(step, gen_batch, timer),
                fg,
                self.cfg.data.rollout_batch_size,
                self.cfg.num_train_groups,
                self.world,
                timer,
            )
        # Pixel values after DAPO's filtering and rebalancing: the raw images travel instead (8x fewer bytes
        # than float32 pixel values) and dropped groups are never processed.
        with timer("pixel_values"):
            attach_pixel_values(samples, self.processor.image_processor, self.sizes)
            attach_video_inputs(samples, self.processor, self.sizes, self.engine.dtype)
        return samples, metrics

    def _generate_and_score(self, step: int, gen_batch: int, timer: Timer) -> list[Sample]:
        """One generation batch: this rank's next prompts -> samples with reward scores (no pixel values yet)."""
        prompts = [
            Prompt(uid, ex.prompt_token_ids, ex.images, ex.answer, {"data_source": ex.data_source}, ex.videos)
            for uid, pos in self.sampler.next_batch()
            for ex in [self.dataset[pos]]
        ]
        with timer("gen"), self._rollout_mode(timer):
            samples = generate(
                self.engine, prompts, self.sampling, step=step, gen_batch=gen_batch, tp_group=self.tp_group
            )
        with timer("reward"):
            self.score(samples, batch_name=f"step {step} rank {self.world.rank}")
        return samples

    def _rollout_mode(self, timer: Timer):
        return self.engine.rollout_mode(
            self.policy,
            self.state.version,
            optimizer=self.optim.optimizer if self.cfg.worker.actor.fsdp.offload_optimizer else None,
            timer=timer,
            log_memory=self.cfg.trainer.log_memory,
        )

    def score(self, samples: list[Sample], *, batch_name: str) -> None:
        """Set every sample's `scores` (reward keys; `overall` includes DAPO's overlong shaping)."""
        rewards = score_samples(self.reward_fn, [s.reward_input() for s in samples], batch_name=batch_name)
        ob = self.cfg.algorithm.overlong_buffer
        if ob.enable:  # DAPO overlong shaping, added to the score (logged as reward/overlong_penalty)
            lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
            penalty = overlong_penalty(
                lengths, self.cfg.data.max_response_length, ob.length, ob.penalty_factor
            )
            rewards["overlong_penalty"] = penalty
            rewards["overall"] = rewards["overall"] + penalty
        for i, s in enumerate(samples):
            s.scores = {k: float(v[i]) for k, v in rewards.items()}

    def compute_advantages(self, samples: list[Sample]) -> dict[str, float]:
        """Set every sample's `advantage` from its group's statistics over all ranks; returns adv/ metrics."""
        alg, num_groups = self.cfg.algorithm, self.cfg.num_train_groups
        scores = torch.tensor([s.scores["overall"] for s in samples])
        group_index = torch.tensor([s.group_index for s in samples], dtype=torch.long)
        kwargs = dict(eps=alg.adv_eps, all_reduce_sum=collectives.all_reduce_sum)
        if alg.norm_adv_by_std_in_grpo == "batch":
            advantages, metrics = compute_batch_std_advantages(scores, group_index, num_groups, **kwargs)
        else:
            advantages, metrics = compute_grpo_advantages(
                scores, group_index, num_groups, norm_by_std=alg.norm_adv_by_std_in_grpo, **kwargs
            )
        for s, a in zip(samples, advantages.tolist(), strict=True):
            s.advantage = a
        return metrics

    def validate(self, step: int, timer: Timer) -> dict[str, float]:
        with timer("testing"), self._rollout_mode(timer):
            return validate(
                self.engine,
                self.val_examples,
                self.reward_fn,
                step=step,
                sampling=self.val_sampling,
                world=self.world,
                tp_group=self.tp_group,
                log_generations=self.loggers.log_table,
                num_logged=self.cfg.trainer.val_generations_to_log,
                batch_size=self.cfg.data.val_batch_size,
            )

    def _validation_due(self, step: int) -> bool:
        t = self.cfg.trainer
        if not self.val_examples:
            return False
        if step == 0:
            return t.val_before_train
        return t.val_freq > 0 and (step % t.val_freq == 0 or step == self.total_steps)

    # ------------------------------------------------------------------------------ checkpoint and logs
    def save(self, step: int, timer: Timer) -> None:
        with timer("save_checkpoint"):
            trainer_state = {
                "step": step,
                "version": self.state.version,
                "sampler": self.sampler.state_dict(),
            }
            save_checkpoint(
                self.cfg.run_dir,
                step,
                policy=self.policy,
                optim=self.optim,
                trainer_state=trainer_state,
                world=self.world,
                save_limit=self.cfg.trainer.save_limit,
                model_path=self.cfg.worker.actor.model.model_path,
                config=plain_config(self.cfg),
            )

    def resume(self) -> None:
        """Policy, optimizer, schedule, data position, policy version and RNG from the checkpoint the start
        plan chose (run/start.py; the config was checked against the saved one before anything was built)."""
        if self.plan.checkpoint is None:
            return
        auto = self.cfg.trainer.resume == "auto"  # an unverified checkpoint that fails: the previous one
        saved = load_or_fall_back(
            self.plan.checkpoint, policy=self.policy, optim=self.optim, world=self.world, auto=auto
        )
        if not self.plan.reset_data_position:
            self.sampler.load_state_dict(saved["sampler"])
        self.state.step, self.state.version = saved["step"], saved["version"]

    def write_metrics(self, step: int, timer: Timer, m: dict[str, float]) -> None:
        """The step's metrics (global over ranks; collective) to the loggers (rank 0 has them)."""
        m = {**timer.metrics(), **m}
        if step > 0:
            m.update(perf_metrics(m, self.world.device_type, self.world.world_size))
        self.loggers.log(step, m)

    def _log_memory(self, phase: str) -> None:
        if self.cfg.trainer.log_memory:
            log.info(memory_line(self.world.device_type, phase))


def run(cfg: Config, plan: StartPlan | None = None) -> None:
    """Train `cfg` on this rank (the process group is created here, after the config was validated and
    `plan` (run.start.plan_start, made here when not given) decided what to do with the run directory).

    SIGTERM/SIGINT are listened for from the first line, so a signal during start-up counts too; an
    exception ends the rank at once with exit code 1 (`exit_promptly`), so torchrun brings the job down; a
    data set that cannot be trained on (`DataError`, found alike on every rank while loading, before any
    model is built) is one line, `data error: ...`, and exit code 2, as a config error."""
    stop = StopOnSignal(cfg.trainer.preempt_grace_s).install()
    exit_promptly(lambda: _run(cfg, plan, stop))


def _run(cfg: Config, plan: StartPlan | None, stop: StopOnSignal) -> None:
    plan = plan or plan_start(cfg)  # before any file is written
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    world = collectives.init_distributed(cfg.trainer.device, cfg.trainer.collective_timeout_s)
    setup_logging(cfg.run_dir, world)
    plan = agree_on_start(plan, world)  # rank 0 decides what every rank resumes
    plan = verify_start(plan, cfg, world)  # the checksums, a share per rank; a damaged one: the previous
    if world.is_main:
        from spmd_grpo.versions import check_versions, version_line

        log.info("%s; device %s, backend %s, world %d", version_line(), world.device_type, world.backend,
                 world.world_size)  # fmt: skip
        for problem in check_versions():  # only with SPMD_GRPO_ALLOW_UNTESTED_VERSIONS=1
            log.warning("untested: %s", problem)
        for line in plan.lines():
            log.info(line)
    abandon_branch(plan, world)  # a resume from an earlier checkpoint leaves the later ones aside
    seed_everything(cfg.trainer.seed)
    try:
        trainer = Trainer(cfg, world, plan, stop)
    except DataError as e:  # the data set, read before any model: one line and exit code 2, no traceback
        say_once_and_exit(f"data error: {e}", world.rank)
    trainer.train()
