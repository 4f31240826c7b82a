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

A run directory that cannot be used (a file where it or a parent should be, no write permission, a read-only
file system, no space for the first write) is a `ConfigError` naming the path, before any process group:
`check_writable` creates the directory and writes, fsyncs and deletes a small file in it (every rank, and
`spmd_grpo.launch` once before it starts them); `lock_run_dir` and `name_holder` report their own failures
the same way. `check_not_locked` lets the launcher refuse a directory in use without holding the lock.

A run directory that is not one directory for every node (a node-local path such as /tmp, or a mount
missing on one node) passed every check above on each node, and each rank then wrote its checkpoint shards
where only its own node sees them: every checkpoint was found damaged at the first resume. Once the process
group exists, every rank reads the lock file and `unshared_run_dir` compares what each host saw with what
rank 0 wrote (run/lineage.py: `agree_on_start`, in the collective it makes anyway).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
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
    with unusable_run_dir(run_dir):
        run_dir.mkdir(parents=True, exist_ok=True)
        f = open(run_dir / LOCK, "a+")  # noqa: SIM115 - held open for the process's life
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip()
        f.close()
        raise _in_use(run_dir, holder) from None
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
    with unusable_run_dir(run_dir, run_dir / LOCK):
        f.seek(0)
        f.truncate()
        f.write(
            f"host {socket.gethostname()}, pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n"
        )
        f.flush()
        os.fsync(f.fileno())


def _in_use(run_dir: Path, holder: str) -> ConfigError:
    return ConfigError(
        f"the run directory {run_dir} is in use by another job ({holder or 'a job still starting'}); one job "
        "per run directory: wait for it to end or give this one another trainer.experiment_name / "
        "trainer.output_dir"
    )


def check_not_locked(run_dir: Path) -> None:
    """ConfigError naming the holder when a job holds `run_dir`'s lock (a shared lock taken and dropped at
    once: probes of several launchers of one job, one per node, never refuse each other). Writes nothing."""
    if run_dir.resolve() in _HELD:
        return  # this process's own lock
    try:
        f = open(run_dir / LOCK)  # noqa: SIM115 - closed below
    except OSError:
        return  # no lock file (a new directory) or none readable: `check_writable` / rank 0 say what is wrong
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(run_dir, f.read().strip()) from None
        except OSError:
            return  # no locks on this file system: rank 0 warns
        fcntl.flock(f, fcntl.LOCK_UN)


def check_writable(run_dir: Path) -> None:
    """Create `run_dir` (with its parents) and write, fsync and delete a small file in it: a ConfigError
    naming the path when that fails (a file in the way, no permission, a read-only or full file system)."""
    probe = run_dir / f".write_check.{socket.gethostname()}.{os.getpid()}"
    with unusable_run_dir(run_dir, probe):
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            with open(probe, "w") as f:
                f.write("spmd_grpo write check\n")
                f.flush()
                os.fsync(f.fileno())
        finally:
            probe.unlink(missing_ok=True)


@contextmanager
def unusable_run_dir(run_dir: Path, file: Path | None = None) -> Iterator[None]:
    """An OSError inside becomes a one-line ConfigError naming the path (`file`: the file being written)."""
    try:
        yield
    except OSError as e:
        # os.path's tests answer False where they cannot look (pathlib's raise on EACCES)
        in_the_way = (p for p in (run_dir, *run_dir.parents) if os.path.exists(p) and not os.path.isdir(p))
        blocker = next(in_the_way, None)
        if blocker is not None:
            why = f"{blocker} is a file, not a directory"
        else:
            why = f"{e.filename or file or run_dir}: {e.strerror or e}"
        raise ConfigError(
            f"the run directory {run_dir} cannot be used: {why} (trainer.output_dir / "
            "trainer.experiment_name name it)"
        ) from None


def lock_text(run_dir: Path) -> str | None:
    """The lock file of `run_dir` as this process reads it (None: none readable)."""
    try:
        return (run_dir / LOCK).read_text()
    except OSError:
        return None


def unshared_run_dir(run_dir: Path, views: list[tuple[str, str | None]]) -> str | None:
    """Why `run_dir` is not one directory for every rank, or None. `views`: each rank's (host name,
    `lock_text`), in rank order; rank 0 wrote the lock file, so a host that reads something else (or
    nothing) sees another directory."""
    host_0, text_0 = views[0]
    ranks_by_host: dict[str, list[int]] = {}
    for rank, (host, text) in enumerate(views):
        if text != text_0:
            ranks_by_host.setdefault(host, []).append(rank)
    if not ranks_by_host:
        return None
    elsewhere = ", ".join(f"{host} ({_ranks(ranks)})" for host, ranks in ranks_by_host.items())
    return (
        f"the run directory {run_dir} is not the same directory on every node: {elsewhere} "
        f"{'does' if len(ranks_by_host) == 1 else 'do'} not see the lock file rank 0 ({host_0}) wrote there; "
        "every rank writes its own checkpoint shards into it, so trainer.output_dir must be on a file system "
        "every node mounts at the same path"
    )


def _ranks(ranks: list[int]) -> str:
    """`rank 3`, `ranks 8-15` (consecutive) or `ranks 1, 5`."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"ranks {', '.join(map(str, ranks))}"
