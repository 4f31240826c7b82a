"""Slurm-style preemption with the real entry point (2 ranks, torchrun, vLLM, FSDP2), at two moments:

1. SIGTERM reaches every rank in the middle of saving step 2, and that save cannot finish within
   `trainer.preempt_grace_s`: each rank exits with 143 when the grace period ends, leaving only
   `global_step_2.tmp`; the newest complete checkpoint is still step 1.
2. `trainer.resume=auto` continues from step 1 (the half-written step is ignored); SIGTERM to the torchrun
   agent mid-run makes every rank finish its step, save it (no periodic saves are configured: this
   checkpoint comes from the signal) and exit with 143, before torchrun's shutdown timeout; the checkpoint
   is complete and undamaged, so it is what the next `resume=auto` picks.

The measured times are printed (`pytest -s`)."""

import datetime
import json
import signal
import subprocess
import time

from spmd_grpo.run.checkpoint_dirs import find_checkpoint
from tests.conftest import REPO, torchrun, torchrun_command

SAVE_GRACE_S = 3.0  # run 1: shorter than the stalled save
STEP_GRACE_S = 120.0  # run 2: a step and its save fit, even on 2 busy cores
SHUTDOWN_TIMEOUT_S = "300"  # torchrun must not SIGKILL the ranks before STEP_GRACE_S ends


def _args(model, out, max_steps, *extra, entry=("-m", "spmd_grpo.train")):
    return [
        *entry, "configs/smoke.yaml", f"worker.actor.model.model_path={model}",
        f"trainer.output_dir={out}", "trainer.experiment_name=preempt", f"trainer.max_steps={max_steps}",
        "trainer.val_before_train=false", "trainer.val_freq=-1",
        "data.rollout_batch_size=4", "worker.rollout.n=4", "worker.actor.global_batch_size=8",
        "worker.actor.micro_batch_size_per_device_for_update=2", *extra,
    ]  # fmt: skip


def _logged_at(run, rank, text):
    """time.time() of the first line of `<run>/logs/rank<rank>.log` containing `text` (its asctime)."""
    line = next(line for line in (run / "logs" / f"rank{rank}.log").read_text().splitlines() if text in line)
    _, day, clock, _ = line.split(" ", 3)  # "[rank0] 2026-11-23 14:51:45,123 LEVEL name: message"
    return datetime.datetime.strptime(f"{day} {clock}", "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _steps(metrics):
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.exists() else []


def test_sigterm_in_a_long_save_then_sigterm_mid_run(tiny_untied, tmp_path):
    run, stamp = tmp_path / "preempt", tmp_path / "signalled_at"
    ckpts, metrics = run / "checkpoints", run / "metrics.jsonl"

    # 1. SIGTERM while saving step 2, and the save stalls: the grace period ends each rank with 143.
    entry = ("tests/jobs/train_signalled_in_save.py", "2", str(stamp))
    grace = f"trainer.preempt_grace_s={SAVE_GRACE_S}"
    proc = torchrun(_args(tiny_untied, tmp_path, 4, "trainer.save_freq=1", grace, entry=entry), check=False)
    exited_at, output = time.time(), proc.stdout + proc.stderr
    signalled = [float((tmp_path / f"signalled_at.rank{r}").read_text()) for r in (0, 1)]
    gave_up = [_logged_at(run, r, "exiting 143 now, without a new checkpoint") - signalled[r] for r in (0, 1)]
    print(f"\nSIGTERM in a stalled save (grace {SAVE_GRACE_S:.0f} s): the ranks exited {gave_up[0]:.1f} s and "
          f"{gave_up[1]:.1f} s later, torchrun {exited_at - min(signalled):.1f} s later")  # fmt: skip
    assert proc.returncode != 0, output[-3000:]
    assert min(gave_up) >= SAVE_GRACE_S - 0.01 and max(gave_up) < SAVE_GRACE_S + 5, gave_up
    assert exited_at - min(signalled) < SAVE_GRACE_S + 60, output[-3000:]  # torchrun: no hang after the exit
    assert (ckpts / "global_step_2.tmp").exists() and not (ckpts / "global_step_2").exists()
    assert (ckpts / "latest").read_text().strip() == "global_step_1"
    assert _steps(metrics) == [1]

    # 2. Resume from step 1; SIGTERM to the torchrun agent mid-run (what Slurm sends on preemption).
    args = _args(tiny_untied, tmp_path, 200, "trainer.save_freq=-1", "trainer.resume=auto",
                 f"trainer.preempt_grace_s={STEP_GRACE_S}")  # fmt: skip
    cmd, env = torchrun_command(args, env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": SHUTDOWN_TIMEOUT_S})
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 600
    while len(_steps(metrics)) < 3:  # step 1 from run 1, then steps 2 and 3
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.monotonic() < deadline, "training did not resume"
        time.sleep(0.5)
    signalled_at = time.time()
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=600)
    steps = _steps(metrics)
    waited = time.time() - signalled_at
    print(f"SIGTERM to torchrun mid-run: step {steps[-1]} saved, torchrun exited {waited:.1f} s later")
    assert "global_step_1 (step 1)" in output, output[-3000:]  # resumed from the complete checkpoint
    assert f"stop requested by signal 15: checkpoint of step {steps[-1]} saved" in output, output[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} exits with code 143" in output, output[-3000:]
    assert "Unable to shutdown process" not in output, output[-3000:]  # torchrun did not need SIGKILL
    assert "preempt_grace_s=120 is not below torchrun's shutdown timeout" not in output
    assert proc.returncode == 1, output[-3000:]  # torchrun's own exit code when it is signalled
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] < 200
    assert (ckpts / "latest").read_text().strip() == f"global_step_{steps[-1]}"
    assert find_checkpoint(run, "auto") == ckpts / f"global_step_{steps[-1]}"  # complete and undamaged
