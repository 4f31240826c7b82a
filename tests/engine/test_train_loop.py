"""The real training entry point for a few steps: 2 ranks, torchrun, FSDP2, vLLM, reference model, validation.

Checks the run directory a user gets (resolved config, metrics.jsonl with every verl-named metric, validation
generations, the same metrics in tensorboard event files) and the console (one line per step, none of the
warnings vLLM used to repeat per request or per weight push), not learning (that is `make smoke-test`).
"""

import json
import math

import pytest
import yaml

from tests.conftest import torchrun

REQUIRED = (
    [
        f"timing_s/{k}"
        for k in [
            "gen",
            "reward",
            "old_log_prob",
            "ref",
            "adv",
            "update_actor",
            "update_weights",
            "step",
        ]
    ]
    + [
        f"actor/{k}"
        for k in [
            "pg_loss",
            "pg_clipfrac",
            "pg_clipfrac_lower",
            "ppo_kl",
            "kl_loss",
            "kl_coef",
            "entropy",
            "grad_norm",
            "lr",
        ]
    ]
    + [f"critic/{a}/{b}" for a in ("score", "rewards", "advantages") for b in ("mean", "max", "min")]
    + [f"response_length/{k}" for k in ["mean", "max", "min", "clip_ratio"]]
    + [f"prompt_length/{k}" for k in ["mean", "max", "min"]]
    + [
        f"perf/{k}"
        for k in [
            "total_num_tokens",
            "time_per_step",
            "throughput",
            "max_memory_allocated_gb",
            "cpu_memory_used_gb",
            "shared_prompt_tokens_saved",
        ]
    ]
    + ["rollout/logprob_diff_mean", "rollout/logprob_diff_max", "reward/accuracy", "reward/format"]
)


def test_three_steps_write_every_metric(tiny_untied, tmp_path):
    proc = torchrun(
        [
            "-m",
            "spmd_grpo.train",
            "configs/smoke.yaml",
            f"worker.actor.model.model_path={tiny_untied}",
            f"trainer.output_dir={tmp_path}",
            "trainer.experiment_name=loop",
            "trainer.max_steps=3",
            "trainer.val_freq=2",
            "data.val_max_samples=8",
            "data.rollout_batch_size=4",
            "worker.rollout.n=4",
            "worker.actor.global_batch_size=8",
            # Frozen vision tower (skipped by the weight push) and activation checkpointing (wrapper names must
            # map back to HF names): the fp32 logprob check below fails if either breaks the sync.
            "worker.actor.model.freeze_vision_tower=true",
            "worker.actor.model.enable_gradient_checkpointing=true",
            "worker.actor.micro_batch_size_per_device_for_update=4",
            "trainer.logger=[console,jsonl,tensorboard]",
            # Every step must have a gradient: 16 samples of a random model seldom hold a right answer, so a
            # format term (the smoke config's reward is accuracy only) gives the groups their spread.
            "worker.reward.format_weight=0.1",
        ]
    )
    run = tmp_path / "loop"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # step 0: validation before training
    for r in rows[1:]:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, missing
        assert all(math.isfinite(r[k]) for k in REQUIRED), r
        assert r["actor/lr"] > 0 and r["actor/grad_norm"] > 0 and r["actor/kl_coef"] == 1e-3
        assert r["rollout/logprob_diff_max"] < 1e-3  # fp32 engine and trainer agree during training
        assert r["perf/total_num_tokens"] > 0 and r["perf/throughput"] > 0
        # shared_prompt auto (packed, CPU): each group of 4 in a micro-batch of 4 holds its prompt once
        assert r["perf/shared_prompt_tokens_saved"] > 0
    val_steps = [r["step"] for r in rows if "val-core/color/acc/mean@1" in r]
    assert val_steps == [0, 2, 3]
    assert all("timing_s/testing" in r and "val/reward/overall" in r for r in rows if r["step"] in val_steps)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["trainer"]["max_steps"] == 3 and cfg["worker"]["rollout"]["n"] == 4
    generations = [json.loads(line) for line in (run / "val_generations.jsonl").read_text().splitlines()]
    assert generations and {"step", "response", "ground_truth", "score"} <= set(generations[0])
    _check_tensorboard(run, rows)
    _check_console(proc.stdout + proc.stderr)


def _check_tensorboard(run, rows):
    """The event files hold every verl-named metric of metrics.jsonl, at the same steps and values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert set(REQUIRED) <= tags, set(REQUIRED) - tags
    assert {"val-core/color/acc/mean@1", "val/reward/overall", "timing_s/testing"} <= tags
    for name in ("critic/score/mean", "actor/kl_loss", "timing_s/step"):
        logged = [(e.step, e.value) for e in events.Scalars(name)]
        assert logged == [(r["step"], pytest.approx(r[name], rel=1e-6)) for r in rows if name in r]
    assert events.Tags()["tensors"]  # the validation generations as a text table


def _check_console(output):
    """One line per step on the console, and none of the lines that used to repeat by the thousand."""
    for noise in (
        "`torch.set_num_threads` after the thread binding",  # vLLM CPU worker, per request
        "RotaryEmbedding: Failed to load weights",  # vLLM layerwise reload, per weight push
        "Passing `min_pixels` and `max_pixels` to a processor call is deprecated",  # transformers
        "`torch.distributed.reduce_op` is deprecated",  # vLLM kernel registration
    ):
        assert noise not in output, noise
    for step in range(4):
        assert sum(line.startswith(f"step {step}/3 |") for line in output.splitlines()) == 1, step
