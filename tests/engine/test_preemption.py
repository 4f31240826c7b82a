"""Slurm-style preemption: SIGTERM to the torchrun agent mid-run -> every rank finishes its step, the job saves
a complete checkpoint of that step and exits non-zero; `resume=auto` then continues from it."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, free_port, torchrun

pytestmark = pytest.mark.engine


def _args(model, out, max_steps, *extra):
    return [
        "-m", "spmd_grpo.train", "configs/smoke.yaml", f"worker.actor.model.model_path={model}",
        f"trainer.output_dir={out}", "trainer.experiment_name=preempt", f"trainer.max_steps={max_steps}",
        "trainer.save_freq=-1", "trainer.val_before_train=false", "trainer.val_freq=-1",
        "data.rollout_batch_size=4", "worker.rollout.n=4", "worker.actor.global_batch_size=8",
        "worker.actor.micro_batch_size_per_device_for_update=2", *extra,
    ]  # fmt: skip


def test_sigterm_saves_and_exits_nonzero_then_resumes(tiny_untied, tmp_path):
    metrics = tmp_path / "preempt" / "metrics.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), *_args(tiny_untied, tmp_path, 200)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.monotonic() + 400
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)  # what Slurm sends on preemption / scancel
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, output[-3000:]
    assert "stop requested by signal" in output, output[-3000:]
    ckpts = tmp_path / "preempt" / "checkpoints"
    latest = (ckpts / "latest").read_text().strip()
    step = int(latest.removeprefix("global_step_"))
    assert (ckpts / latest / "trainer_state.json").exists()
    assert step == max(json.loads(line)["step"] for line in metrics.read_text().splitlines()) < 200

    # resume=auto continues after the saved step (no periodic saves were configured: this one came from SIGTERM).
    torchrun(_args(tiny_untied, tmp_path, step + 1, "trainer.resume=auto"))
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, step + 2))
