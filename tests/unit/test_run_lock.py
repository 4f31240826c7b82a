"""One job per run directory, with real processes and the real kernel lock: a second job is refused at once
naming the holder (host, pid, start time); `kill -9` of the holder leaves no stale lock; the CLI refuses with
one line and exit code 2 before anything else is written."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import types

import pytest

from spmd_grpo.config.checks import ConfigError
from spmd_grpo.run.lock import LOCK, check_not_locked, lock_run_dir, name_holder
from spmd_grpo.train import main
from tests.conftest import REPO, checkpoint_stand_in

HOLD = """
import sys, time
from pathlib import Path
from spmd_grpo.run.lock import lock_run_dir, name_holder
lock_run_dir(Path(sys.argv[1]))
name_holder(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """Another process holding `tmp_path / "run"`; killed (SIGKILL) at the end if still alive."""
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "locked"
    yield run, proc
    proc.kill()
    proc.wait()


def test_a_second_job_is_refused_naming_the_holder_and_kill_9_frees_the_lock(holder):
    run, proc = holder
    with pytest.raises(ConfigError) as e:
        lock_run_dir(run)
    message = str(e.value)
    assert (
        f"the run directory {run} is in use by another job (host {socket.gethostname()}, pid {proc.pid}, started "
        in message
    )
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (run / LOCK).exists()  # the file stays; the lock went with the process
    lock_run_dir(run)  # granted at once
    name_holder(run)
    assert f"pid {os.getpid()}," in (run / LOCK).read_text()


def test_the_launchers_probe_refuses_a_held_directory_and_holds_nothing(holder, tmp_path):
    """`check_not_locked` (spmd_grpo.launch, before any rank exists) names the holder; on a free directory it
    takes nothing (a rank then locks it at once) and writes nothing."""
    run, proc = holder
    with pytest.raises(ConfigError, match=f"in use by another job \\(host .*, pid {proc.pid},"):
        check_not_locked(run)
    free = tmp_path / "free"
    free.mkdir()
    (free / LOCK).write_text("")
    check_not_locked(free)
    check_not_locked(tmp_path / "absent")  # no lock file: nothing to probe, nothing created
    assert not (tmp_path / "absent").exists() and (free / LOCK).read_text() == ""
    lock_run_dir(free)  # not held by the probe


def test_the_cli_refuses_with_one_line_and_exit_2(holder, tmp_path, monkeypatch, capsys, caplog):
    """`spmd_grpo.train.main` as rank 0 of a one-rank job, in this process (a subprocess would pay torch's
    import again for seconds; `python -m spmd_grpo.train`'s own one-line exit 2 is tests/unit/test_config.py's,
    and one past the lock check on a real run directory is tests/engine/test_resume.py's)."""
    run, proc = holder
    checkpoint_stand_in(tmp_path / "model")  # enough to validate
    before = sorted(p.name for p in run.iterdir())
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    trainer = types.ModuleType("spmd_grpo.trainer")  # were the lock not checked, the job would stop here
    trainer.run = lambda *_: pytest.fail("the CLI started the job in a locked run directory")
    monkeypatch.setitem(sys.modules, "spmd_grpo.trainer", trainer)
    start = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        main(["configs/smoke.yaml", f"trainer.output_dir={run.parent}", f"trainer.experiment_name={run.name}",
              "worker.actor.model.model_path=" + str(tmp_path / "model")])  # fmt: skip
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"config error: the run directory {run} is in use by another job (host ")
    assert f"pid {proc.pid}," in line
    # A warning logged on the way would be a second line on a real run's stderr (logging's last resort).
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert sorted(p.name for p in run.iterdir()) == before  # nothing written
    assert time.monotonic() - start < 60
