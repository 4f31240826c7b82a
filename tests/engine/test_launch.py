"""The Slurm GPU template's launch line, run for real as 2 "nodes" on this machine (CPU, gloo, 4 ranks).

`launch/slurm/train_gpu.sbatch` is executed with bash exactly as sbatch would start it on the first node,
with two shims first on PATH standing in for Slurm:
  * `scontrol show hostnames LIST` prints one host per comma-separated entry (here 127.0.0.1 twice);
  * `srun --ntasks-per-node=1 --nodes=N CMD...` really starts CMD N times in the background, with
    SLURM_NODEID / SLURM_PROCID / SLURM_LOCALID set per copy, waits for all of them and exits with the
    largest exit code (with --kill-on-bad-exit it stops the other copies when one fails, as srun does).
So two torchrun agents meet through the c10d rendezvous on 127.0.0.1:PORT, each starts NPROC_PER_NODE=2
ranks, and the trainer (real FSDP2 + real vLLM CPU engine per rank) sees a world of 4.
The template's device comes from the config (`trainer.device=cpu` here); the NCCL variables it sets are
ignored by gloo.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from tests.conftest import REPO, free_port

NUM_NODES, NPROC_PER_NODE = 2, 2


def test_gpu_sbatch_template_two_nodes_on_loopback(tiny_untied, slurm_shims, tmp_path):
    out_dir = tmp_path / "runs"

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(
        PATH=f"{slurm_shims}{os.pathsep}{env['PATH']}",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST=",".join(["127.0.0.1"] * NUM_NODES),
        SLURM_NNODES=str(NUM_NODES),
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
        "trainer.max_steps=2",
        f"trainer.output_dir={out_dir}",
        "data.rollout_batch_size=4",
        "worker.rollout.n=2",
        "worker.actor.global_batch_size=8",
        "worker.actor.micro_batch_size_per_device_for_update=2",
        "trainer.device=cpu",
        # Validation is not what this test is about; it would only add minutes on 2 cores.
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
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
    metrics = [json.loads(line) for line in (out_dir / "smoke" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["perf/throughput"] > 0 for m in metrics)
