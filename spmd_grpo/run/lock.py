"""One job per run directory: an exclusive lock on `<run dir>/.lock`, held by rank 0 for the job's life.

Two jobs started on one run directory both ran: their metrics rows interleaved, one's checkpoints overwrote
the other's, one pruned what the other was about to resume from. `lock_run_dir` takes `flock(LOCK_EX |
LOCK_NB)` before the run writes anything (the lock file is the first thing it writes): a second job is
refused at once, with a one-line error naming the holder (host, pid, start time, written into the lock
file). The kernel releases the lock when the holder's process ends, however it ends, so `kill -9` leaves no
stale lock to clean up (the file stays; only the lock matters).

Shared file systems: NFSv4 and NFSv3 with lockd carry `flock` across nodes (the Linux client implements
it as a whole-file POSIX lock); Lustre does only when mounted with `-o flock` (with `-o localflock` the
lock is per node and two nodes can both hold it); a file system without locks makes the call fail with
ENOLCK / EOPNOTSUPP / ENOSYS, and the job then starts with a warning that the directory is not protected.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from pathlib import Path
from typing import IO

from spmd_grpo.config.checks import ConfigError

log = logging.getLogger(__name__)

LOCK = ".lock"
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
_HELD: dict[Path, IO[str]] = {}  # run dir -> its open lock file: locked until this process ends


def lock_run_dir(run_dir: Path) -> IO[str]:
    """Lock `run_dir` for the rest of this process's life, or raise `ConfigError` naming the job that holds
    it. A directory this process holds already is granted again (the same job). Nothing is written into an
    existing run directory here (a start that is then refused leaves it as it was): `name_holder` writes this
    job's name once the start is accepted."""
    key = run_dir.resolve()
    if key in _HELD:
        return _HELD[key]
    run_dir.mkdir(parents=True, exist_ok=True)
    f = open(run_dir / LOCK, "a+")  # noqa: SIM115 - held open for the process's life
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "a job still starting"
        f.close()
        raise ConfigError(
            f"the run directory {run_dir} is in use by another job ({holder}); one job per run directory: "
            "wait for it to end or give this one another trainer.experiment_name / trainer.output_dir"
        ) from None
    except OSError as e:
        if e.errno not in _NO_LOCKS:
            raise
        log.warning("%s: the file system does not support locks (%s): two jobs could share it", run_dir, e)
        _HELD[key] = f
        return f
    _HELD[key] = f
    return f


def name_holder(run_dir: Path) -> None:
    """Write this job's host, pid and start time into the lock file of `run_dir`, which it holds: what a
    second job's error names."""
    f = _HELD[run_dir.resolve()]
    f.seek(0)
    f.truncate()
    f.write(
        f"host {socket.gethostname()}, pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n"
    )
    f.flush()
