"""Slurm-style preemption with the real entry point (2 ranks, torchrun, vLLM, FSDP2) in the middle of a save:
SIGTERM reaches every rank while it saves step 2, and that save cannot finish within `trainer.preempt_grace_s`:
each rank exits with 143 when the grace period ends, leaving only `global_step_2.tmp`; the newest complete
checkpoint is still step 1.

SIGTERM to the torchrun agent mid-run (every rank finishes its step, saves it and exits with 143), and the
resume from a half-written step, are tests/engine/test_resume.py (its run 2). The measured times are printed
(`pytest -s`)."""

import datetime
import json
import time

from tests.conftest import torchrun

SAVE_GRACE_S = 3.0  # shorter than the stalled save


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


def test_sigterm_in_a_long_save_exits_143_after_the_grace_period(tiny_untied, tmp_path):
    run, stamp = tmp_path / "preempt", tmp_path / "signalled_at"
    ckpts, metrics = run / "checkpoints", run / "metrics.jsonl"

    # SIGTERM while saving step 2, and the save stalls: the grace period ends each rank with 143.
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
