"""One job per run directory, with real processes and the real kernel lock: a second job is refused at once
naming the holder (host, pid, start time); `kill -9` of the holder leaves no stale lock; the CLI refuses with
one line and exit code 2 before anything else is written. A run directory that is not the same directory on
every node (node-local) is named by the hosts that do not see the holder's lock file."""

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
from spmd_grpo.run.lock import LOCK, check_not_locked, lock_run_dir, lock_text, name_holder, unshared_run_dir
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


def test_a_run_directory_some_nodes_see_elsewhere_is_named_by_host(holder, tmp_path):
    """Each rank's (host, view of the lock file), as `agree_on_start` gathers them; rank 0 holds the lock
    (here the holder process). Nodes that mount the run directory read what it wrote; a node-local directory
    of the same name holds no lock file, or an earlier job's."""
    run, _ = holder
    local, stale = tmp_path / "node_local", tmp_path / "stale"
    local.mkdir()
    stale.mkdir()
    (stale / LOCK).write_text("host old, pid 1, started 2026-01-01 00:00:00 UTC\n")
    shared = [("node0", lock_text(run))] * 2 + [("node1", lock_text(run))] * 2
    assert lock_text(run).startswith("host ") and unshared_run_dir(run, shared) is None
    views = [*shared, ("node2", lock_text(local)), ("node2", lock_text(local)), ("node3", lock_text(stale))]
    assert lock_text(local) is None
    assert unshared_run_dir(run, views) == (
        f"the run directory {run} is not the same directory on every node: node2 (ranks 4-5), node3 (rank 6) do "
        "not see the lock file rank 0 (node0) wrote there; every rank writes its own checkpoint shards into it, "
        "so trainer.output_dir must be on a file system every node mounts at the same path"
    )
