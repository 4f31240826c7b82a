"""Stopping on a signal and dying on a failure, under real torchrun (2 ranks, gloo) started through
`python -m spmd_grpo.launch`, with the trainer's own handling (`StopOnSignal`, `exit_promptly`) around a loop
of collectives (tests/jobs/stop_and_die.py): a rank killed (while the other is busy without collectives) or
failing brings the job down within 10 s with exit code 1; SIGTERM to the agent stops every rank at the next
boundary and the job exits 128 + 15; a step that outlives the grace period is cut short with the same code.
A data set that every rank finds unusable while loading (rows are checked after the process group forms,
before any model) ends the job with one line and exit code 2, as a config error does.

Each test prints its measured time (`pytest -s` shows it)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

from tests.conftest import REPO, tiny_model, torchrun_command

JOB = "tests/jobs/stop_and_die.py"
MAX_TEARDOWN_S = 10.0  # from a rank's death to the last other rank's exit
MAX_TORCHRUN_S = 30.0  # ...to torchrun's own exit, which on 2 shared cores adds seconds of its own


def _launch(out: Path, mode: str, grace_s: float = 25.0) -> subprocess.Popen:
    cmd, env = torchrun_command([JOB, str(out), mode, str(grace_s)], launcher="spmd_grpo.launch")
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _wait_ready(proc: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + 300
    while not all((out / f"rank{r}.ready").exists() for r in (0, 1)):
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.1)


def _last_words(output: str, rank: int) -> float:
    """time.time() of rank `rank`'s last log line: it exits right after (`os._exit` or SystemExit)."""
    lines = [line for line in output.splitlines() if line.startswith(f"[rank{rank}] ")]
    return float(lines[-1].split()[1])


def _wait_exit(proc: subprocess.Popen) -> tuple[str, float]:
    """The job's output and the wall time (time.time()) at which torchrun had exited."""
    output, _ = proc.communicate(timeout=600)
    return output, time.time()


def test_sigkilled_rank_brings_the_job_down_within_10s_even_with_the_other_busy(tmp_path):
    proc = _launch(tmp_path, "busy")  # rank 0 is in 60 s of work without a collective when rank 1 dies
    _wait_ready(proc, tmp_path)
    killed_at = time.time()
    os.kill(int((tmp_path / "rank1.pid").read_text()), signal.SIGKILL)  # a node failure, as the OOM killer
    output, exited_at = _wait_exit(proc)
    survivor = _last_words(output, 0) - killed_at
    print(f"\nrank 1 SIGKILLed: rank 0 gone {survivor:.2f} s later, torchrun exited {proc.returncode} after "
          f"{exited_at - killed_at:.2f} s")  # fmt: skip
    assert proc.returncode == 1, output[-3000:]
    assert "(exitcode: -9) local_rank: 1" in output, output[-3000:]
    assert "after a rank on this node exited: exiting 143 now" in output, output[-3000:]  # not the 25 s grace
    assert survivor < MAX_TEARDOWN_S, output[-3000:]
    assert exited_at - killed_at < MAX_TORCHRUN_S, output[-3000:]


def test_rank_that_raises_exits_1_and_brings_the_job_down_within_10s(tmp_path):
    proc = _launch(tmp_path, "raise")
    output, exited_at = _wait_exit(proc)
    raised_at = float((tmp_path / "raised_at").read_text())
    gone = [_last_words(output, r) - raised_at for r in (0, 1)]
    print(f"\nrank 1 raised: ranks gone {gone[1]:.2f} s (rank 1) and {gone[0]:.2f} s (rank 0) later, torchrun "
          f"exited {proc.returncode} after {exited_at - raised_at:.2f} s")  # fmt: skip
    assert proc.returncode == 1, output[-3000:]
    assert "rank 1 failed:" in output and "rank 1 fails on purpose" in output, output[-3000:]
    # exit_promptly's code, not a signal, in torchrun's summary (rank 1 is the root cause, or listed under
    # "Failures" when rank 0 came down within the same poll of torchrun's monitor and was named first)
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s*exitcode\s*: 1 \(pid", output), output[-3000:]
    assert max(gone) < MAX_TEARDOWN_S, output[-3000:]
    assert exited_at - raised_at < MAX_TORCHRUN_S, output[-3000:]


def test_a_rank_stuck_past_the_collective_timeout_is_named(tmp_path):
    """Rank 1 stops in a phase without reaching the next collective; rank 0's collective times out (3 s)
    and its error names rank 1 and the phase it is stuck in, first among the ranks' last phases."""
    proc = _launch(tmp_path, "stuck")
    output, exited_at = _wait_exit(proc)
    stuck_at = float((tmp_path / "stuck_at").read_text())
    print(f"\nrank 1 stuck: the job exited {proc.returncode} {exited_at - stuck_at:.2f} s later")
    assert proc.returncode == 1, output[-3000:]
    named = re.search(
        r"last phase of each rank, those still in one first .*?: rank (\d) in '([^']*)'", output
    )
    assert named and named.groups() == ("1", "step 10: stuck"), output[-3000:]
    assert "rank 0 failed: RuntimeError" in output, output[-3000:]  # the one that timed out
    assert exited_at - stuck_at < 3 + MAX_TORCHRUN_S, output[-3000:]


def test_sigterm_to_torchrun_stops_every_rank_with_143(tmp_path):
    proc = _launch(tmp_path, "loop")
    _wait_ready(proc, tmp_path)
    signalled_at = time.time()
    proc.send_signal(signal.SIGTERM)  # what Slurm sends on preemption / scancel
    output, exited_at = _wait_exit(proc)
    gone = [_last_words(output, r) - signalled_at for r in (0, 1)]
    print(f"\nSIGTERM to torchrun: ranks stopped {gone[0]:.2f} s and {gone[1]:.2f} s later, torchrun exited "
          f"{proc.returncode} after {exited_at - signalled_at:.2f} s")  # fmt: skip
    for rank in (0, 1):
        assert f"rank {rank} exits with code 143 after iteration" in output, output[-3000:]
    assert "Unable to shutdown process" not in output, output[-3000:]  # nobody needed SIGKILL
    assert proc.returncode == 143, output[-3000:]  # plain torchrun would exit 1 (its SignalException)


def test_step_longer_than_the_grace_period_is_cut_short_with_143(tmp_path):
    grace_s = 2.0
    proc = _launch(tmp_path, "slow", grace_s)  # the iteration that sees the signal sleeps 10 x grace
    _wait_ready(proc, tmp_path)
    signalled_at = time.time()
    proc.send_signal(signal.SIGTERM)
    output, exited_at = _wait_exit(proc)
    gone = [_last_words(output, r) - signalled_at for r in (0, 1)]
    print(f"\nSIGTERM with a {grace_s:.0f} s grace and a 20 s step: ranks gone {gone[0]:.2f} s and {gone[1]:.2f} s "
          f"later, torchrun exited {proc.returncode} after {exited_at - signalled_at:.2f} s")  # fmt: skip
    assert output.count("exiting 143 now, without a new checkpoint") == 2, output[-3000:]
    assert "exits with code" not in output, output[-3000:]  # no rank reached the boundary
    assert grace_s <= min(gone) and max(gone) < grace_s + MAX_TEARDOWN_S, output[-3000:]
    assert exited_at - signalled_at < grace_s + MAX_TORCHRUN_S, output[-3000:]
    assert proc.returncode == 143, output[-3000:]


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigkilled_launcher_takes_its_ranks_along_within_seconds(tmp_path):
    """kill -9 of the launcher (the OOM killer, a lost Slurm step) forwards nothing to the ranks: before
    `exit_with_launcher` they went on for minutes, training, saving and pruning checkpoints."""
    proc = _launch(tmp_path, "loop")
    _wait_ready(proc, tmp_path)
    pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in (0, 1)]
    killed_at = time.monotonic()
    proc.kill()  # SIGKILL to the torchrun agent: no signal reaches the ranks from it
    proc.wait()
    while any(_alive(p) for p in pids) and time.monotonic() - killed_at < 30:
        time.sleep(0.05)
    gone_after, orphans = time.monotonic() - killed_at, [p for p in pids if _alive(p)]
    for pid in orphans:  # a failing run must not leave them looping for hours
        os.kill(pid, signal.SIGKILL)
    print(f"\nlauncher SIGKILLed: both ranks gone {gone_after:.2f} s later")
    assert not orphans, f"ranks {orphans} still alive {gone_after:.0f} s after the launcher died"
    assert gone_after < MAX_TEARDOWN_S


def test_a_data_set_that_cannot_be_trained_on_is_one_line_and_exit_2(tmp_path):
    """`spmd_grpo.launch` of the real trainer on 2 ranks, a file whose every row is bad: the skipped rows are
    named in the log, then one line, `data error: ...`, once, and exit code 2, with no traceback and no
    failure report from torchrun (each rank printed a traceback and exited 1 before)."""
    from spmd_grpo.data.synthetic import write_parquet

    rows = [{"problem": "<image><image>two markers, one image", "answer": "1", "images": [b"x"]}] * 4
    data = write_parquet(rows, tmp_path / "markers.parquet")
    train = ["-m", "spmd_grpo.train", "configs/smoke.yaml", f"worker.actor.model.model_path={tiny_model()}",
             f"data.train_files={data}", "data.val_files=null", "data.rollout_batch_size=4",
             "worker.actor.global_batch_size=32", "worker.actor.micro_batch_size_per_device_for_update=16",
             "worker.actor.micro_batch_size_per_device_for_experience=16",
             f"trainer.output_dir={tmp_path}", "trainer.val_before_train=false", "trainer.val_freq=-1"]  # fmt: skip
    cmd, env = torchrun_command(train, launcher="spmd_grpo.launch")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert f"skipped {data} row 0: <image> markers do not match images (2 markers, 1 images)" in output
    said = [line for line in output.splitlines() if "data error" in line]
    assert len(said) == 1, said
    assert said[0].startswith(f"data error: {data}: 4 of 4 rows are bad, more than data.max_bad_fraction"), (
        said
    )
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-3000:]


def test_a_lock_file_seen_late_is_waited_for_and_one_never_seen_ends_the_job_with_exit_2(tmp_path):
    """A run directory is compared across nodes by rank 0's lock file (tests/jobs/run_dir_views.py): a node
    that sees it 2 s late (NFS caches lookups up to a minute) is waited for; one that never sees it (a
    node-local directory) ends the job with one line naming its host, exit code 2, after the re-reading."""
    cmd, env = torchrun_command(["tests/jobs/run_dir_views.py", str(tmp_path)], launcher="spmd_grpo.launch")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert all((tmp_path / f"rank{r}.agreed").exists() for r in (0, 1)), output[-3000:]
    said = [line for line in output.splitlines() if "config error" in line]
    assert len(said) == 1 and "is not the same directory on every node" in said[0], said
    assert "(rank 1) does not see the lock file rank 0" in said[0], said
