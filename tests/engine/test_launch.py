"""The real training entry point for a few steps, launched by the Slurm GPU template's launch line as 2 "nodes"
on this machine (CPU, gloo, 4 ranks): FSDP2, one vLLM engine per rank, reference model, validation.

`launch/slurm/train_gpu.sbatch` is executed with bash exactly as sbatch would start it on the first node,
with two shims first on PATH standing in for Slurm:
  * `scontrol show hostnames LIST` prints one host per comma-separated entry (here 0.0.0.0 twice: this
    machine under a name torchrun does not recognise as its own, so node 0 hosts the rendezvous store only
    because the template says so);
  * `srun --ntasks-per-node=1 --nodes=N CMD...` really starts CMD N times in the background, with
    SLURM_NODEID / SLURM_PROCID / SLURM_LOCALID set per copy, waits for all of them and exits with the
    largest exit code (with --kill-on-bad-exit it stops the other copies when one fails, as srun does); the
    job's SLURM_EXPORT_ENV=NONE (`sbatch --export=NONE`) gives the copies only the SLURM_* variables unless
    the template asks srun for --export=ALL.
So two torchrun agents meet through the c10d rendezvous on 0.0.0.0:PORT, each starts NPROC_PER_NODE=2
ranks, and the trainer (real FSDP2 + real vLLM CPU engine per rank) sees a world of 4.
The template's device comes from the config (`trainer.device=cpu` here); the NCCL variables it sets are
ignored by gloo.

The run's checks: the run directory a user gets (resolved config, metrics.jsonl with every verl-named metric,
validation generations, the same metrics in tensorboard event files) and the console (one line per step,
none of the warnings vLLM used to repeat per request or per weight push), not learning (that is
`make smoke-test`).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time

import pytest
import yaml

from tests.conftest import REPO, free_port

NUM_NODES, NPROC_PER_NODE = 2, 2
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


def test_gpu_sbatch_template_two_nodes_write_every_metric(tiny_untied, slurm_shims, tmp_path):
    out_dir = tmp_path / "runs"

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(
        PATH=f"{slurm_shims}{os.pathsep}{env['PATH']}",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST=",".join(["0.0.0.0"] * NUM_NODES),
        SLURM_NNODES=str(NUM_NODES),
        SLURM_EXPORT_ENV="NONE",
        NPROC_PER_NODE=str(NPROC_PER_NODE),
        VENV=str(REPO / ".venv"),
        PORT=str(free_port()),
        RDZV_JOIN_TIMEOUT="300",
        # Both "nodes" are this machine: keep gloo (and, harmlessly, NCCL) on the loopback interface.
        GLOO_SOCKET_IFNAME="lo",
        NCCL_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    cmd = [
        "bash",
        "launch/slurm/train_gpu.sbatch",
        "configs/smoke.yaml",
        f"worker.actor.model.model_path={tiny_untied}",
        f"trainer.output_dir={out_dir}",
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
        "worker.actor.micro_batch_size_per_device_for_update=2",
        "trainer.logger=[console,jsonl,tensorboard]",
        # Every step must have a gradient: 16 samples of a random model seldom hold a right answer, so a
        # format term (the smoke config's reward is accuracy only) gives the groups their spread.
        "worker.reward.format_weight=0.1",
        "trainer.device=cpu",
    ]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    elapsed = time.monotonic() - start
    log = proc.stdout + proc.stderr
    (tmp_path / "launch.log").write_text(log)
    print(f"2-node launch through the sbatch template: {elapsed:.0f} s")
    if proc.returncode != 0:
        pytest.fail(f"sbatch template exited {proc.returncode} after {elapsed:.0f} s:\n{log[-8000:]}")

    # srun really started one torchrun agent per node, and they formed one world of 4 ranks.
    assert log.count("srun shim: starting node") == NUM_NODES, log[-4000:]
    assert "srun shim: all 2 copies exited, max exit code 0" in log
    assert "world 4" in log, log[-4000:]

    run = out_dir / "loop"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # step 0: validation before training
    for r in rows[1:]:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, missing
        assert all(math.isfinite(r[k]) for k in REQUIRED), r
        assert r["actor/lr"] > 0 and r["actor/grad_norm"] > 0 and r["actor/kl_coef"] == 1e-3
        assert r["rollout/logprob_diff_max"] < 1e-3  # fp32 engine and trainer agree during training
        assert r["perf/total_num_tokens"] > 0 and r["perf/throughput"] > 0
        assert r["perf/shared_prompt_tokens_saved"] > 0  # shared_prompt auto (packed, CPU): prompts held once
    val_steps = [r["step"] for r in rows if "val-core/color/acc/mean@1" in r]
    assert val_steps == [0, 2, 3]
    assert all("timing_s/testing" in r and "val/reward/overall" in r for r in rows if r["step"] in val_steps)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["trainer"]["max_steps"] == 3 and cfg["worker"]["rollout"]["n"] == 4
    generations = [json.loads(line) for line in (run / "val_generations.jsonl").read_text().splitlines()]
    assert generations and {"step", "response", "ground_truth", "score"} <= set(generations[0])
    _check_tensorboard(run, rows)
    _check_console(log)


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
