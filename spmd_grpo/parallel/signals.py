"""Stopping cleanly, and dying promptly.

`StopOnSignal` turns SIGTERM/SIGINT (Slurm preemption, Ctrl-C) into a flag that the loop all-reduces at the
next step boundary, so every rank saves the same checkpoint and exits with 128 + signal. `exit_promptly`
runs the entry point so that a failing rank exits at once (no hang in a collective waiting for it), and a
rank whose launcher is gone exits instead of training on.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

# torchrun's LOCAL_WORLD_SIZE as the agent set it, read when this module is first imported (by the entry
# point, before any engine exists): vLLM's CPU platform overwrites the variable with its tensor-parallel
# size while building the engine, after which `_local_rank_gone` compared the live workers with 1 and never
# saw a sibling missing (the survivors of a dead rank then waited out the whole grace period).
_LAUNCHER_LOCAL_WORLD_SIZE = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


# ------------------------------------------------------------------------------------- stop and exit
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopOnSignal:
    """SIGTERM / SIGINT (Slurm preemption or `scancel`, Ctrl-C, torchrun forwarding either) ask the run to
    stop; the loop reads `signum` at each step boundary and the ranks agree with `any_rank`, so they save
    the last finished step together and exit with `exit_code` (128 + signal, as a shell reports a process
    killed by that signal).

    The signal is seen by a watcher thread through `signal.set_wakeup_fd`, not by the main thread: Python
    runs handlers only between bytecodes, and a main thread stuck in a C call (a collective with a dead
    peer) would never start the grace period. `grace_s` seconds after the first signal, if the process is
    still alive (the step, the save or the teardown took too long), the watcher ends it at once with the
    same exit code: the previous checkpoint stays the newest complete one, and a save cut short leaves only
    a `global_step_N.tmp` directory that resume ignores. Further signals change nothing.
    """

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.signum: int | None = None
        self.received_at: float | None = None
        self._write_fd: int | None = None

    def install(self) -> StopOnSignal:
        """Listen from now on (main thread only). Call it before anything slow, so no signal is missed, and
        again after building libraries that may set their own handlers (it re-arms the same watcher)."""
        if self._write_fd is None:
            read_fd, self._write_fd = os.pipe()
            os.set_blocking(self._write_fd, False)  # the C-level handler must never block
            threading.Thread(target=self._watch, args=(read_fd,), name="stop-on-signal", daemon=True).start()
        for sig in STOP_SIGNALS:
            signal.signal(sig, _ignore_in_main_thread)  # the byte on the pipe does the work
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        return self

    @property
    def exit_code(self) -> int:
        assert self.signum is not None
        return 128 + self.signum

    def _watch(self, read_fd: int) -> None:
        while self.signum is None:
            for signum in os.read(read_fd, 16):
                if signum in STOP_SIGNALS and self.signum is None:
                    self.received_at, self.signum = time.monotonic(), signum
        if _local_rank_gone():
            log.error(
                "signal %d after a rank on this node exited: exiting %d now", self.signum, self.exit_code
            )
            _hard_exit(self.exit_code)
        log.warning(
            "signal %d received: stopping at the next step boundary (grace %.0f s)", self.signum, self.grace_s
        )
        time.sleep(self.grace_s)
        log.error(
            "signal %d: not done %.0f s later (trainer.preempt_grace_s); exiting %d now, without a new "
            "checkpoint",
            self.signum,
            self.grace_s,
            self.exit_code,
        )
        _hard_exit(self.exit_code)


def _local_rank_gone() -> bool:
    """Under torchrun: fewer live workers under this rank's agent than LOCAL_WORLD_SIZE. The agent reaps a
    worker that died before it signals the others, so a signal with a sibling missing is the agent taking
    the job down, not a preemption: waiting for a step boundary (a rank busy generating may not reach one
    for minutes, a rank in an NCCL collective never) would only delay the end. Linux `/proc`."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    agent, alive = os.getppid(), 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, IndexError, ValueError):
            continue  # a process that ended while we looked
        alive += int(ppid) == agent and state != "Z"
    return alive < _LAUNCHER_LOCAL_WORLD_SIZE


def _ignore_in_main_thread(signum: int, frame: object) -> None:
    """A Python-level handler must exist for the wakeup fd to be written; the watcher thread acts."""


def exit_promptly(main: Callable[[], None]) -> None:
    """Run `main`; if it raises, log the traceback and end the process with exit code 1 at once.

    A plain exception would go through interpreter shutdown, which can hang on non-daemon threads (vLLM's)
    or block in a collective with a peer that is gone; torchrun would then wait 30 s before SIGKILLing this
    rank. `SystemExit` (an intended exit code) passes through unchanged. With a process group, the log also
    names each rank's last phase (`last_phases`): after a collective timed out, the rank that never arrived.
    """
    try:
        main()
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 (also KeyboardInterrupt and DCP's CheckpointException)
        log.error("rank %s failed:\n%s", os.environ.get("RANK", "0"), traceback.format_exc())
        phases = last_phases(failed=type(e).__name__)
        if phases:
            log.error("last phase of each rank, those still in one first (a rank stuck or dead): %s", phases)
        _hard_exit(1)


QUIET_RANK_S = 5.0
"""How long a rank other than 0 waits before saying an input error that rank 0 says too (torchrun ends the
job after rank 0's exit, so the error is said once)."""


def say_once_and_exit(line: str, rank: int, quiet_s: float = QUIET_RANK_S) -> None:
    """End this rank with exit code 2 (a config error's) after a problem with the user's input that every
    rank found alike (a data set gathered from every rank): rank 0 prints `line` at once; the others print
    it only if rank 0's exit has not ended them (torchrun does) within `quiet_s`, so the job says it once,
    and `spmd_grpo.launch` adds no failure report after a rank's exit code 2."""
    if rank != 0:
        for sig in STOP_SIGNALS:  # torchrun ending this rank after rank 0's exit is expected: no more lines
            signal.signal(sig, signal.SIG_DFL)
        time.sleep(quiet_s)
    print(line, file=sys.stderr)
    _hard_exit(2)


# ------------------------------------------------------------------------------- naming a stuck rank
_PHASE_KEY = "spmd_grpo/phase/{}"


def _store():
    """The default process group's key-value store (torchrun's, in its agent): reachable when a collective
    is not, since a stuck rank blocks the collective, not the store."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def note_phase(what: str) -> None:
    """Record in the process group's store that this rank starts `what` now (`step 3: gen`); a no-op
    without a process group. One small store write per phase of a step."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        _store().set(_PHASE_KEY.format(dist.get_rank()), f"{time.time():.3f} {what}")
    except Exception as e:  # noqa: BLE001 - a diagnostic must not end the run; the collectives will tell
        log.warning("could not note the phase %r in the process group's store: %s", what, e)


_FAILED = "failed: "
SETTLE_S = 1.0
"""How long a failing rank waits between noting its failure and reading the others' phases: the ranks
that wait in the same timed-out collective fail within about this of each other."""


def last_phases(failed: str, timeout_s: float = 2.0) -> str:
    """Note this rank as `failed`, then every rank's last noted phase: first the ranks still in a phase
    (when a collective timed out, the rank that never reached it, stuck or dead), the longest first, then
    those that failed. '' without a process group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return ""
    rows = []
    try:
        store = _store()
        store.set_timeout(datetime.timedelta(seconds=timeout_s))  # the agent holding it may be gone
        note_phase(_FAILED + failed)
        time.sleep(SETTLE_S)
        now = time.time()
        for rank in range(dist.get_world_size()):
            key = _PHASE_KEY.format(rank)
            started, _, what = store.get(key).decode().partition(" ") if store.check([key]) else ("", "", "")
            rows.append((float(started or now), rank, what or "no phase noted"))
    except Exception as e:  # noqa: BLE001 - this only adds to an error already being reported
        return f"(not readable from the store: {type(e).__name__}: {e})"
    rows.sort(key=lambda row: (row[2].startswith(_FAILED), row[0]))
    return "; ".join(
        f"rank {rank} {what}" if what.startswith(_FAILED) else f"rank {rank} in '{what}' for {now - t:.1f} s"
        for t, rank, what in rows
    )


def _hard_exit(code: int) -> None:
    """`os._exit` after flushing what was logged and printed (it skips every other shutdown step)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def warn_if_grace_outlasts_shutdown(grace_s: float, *, is_main: bool) -> None:
    """torchrun SIGKILLs its workers `--shutdown_timeout` seconds after forwarding a signal: a longer grace
    period would be cut short there. The flag itself is invisible to the workers; `spmd_grpo.launch` exports
    the value torchrun uses as TORCH_ELASTIC_SHUTDOWN_TIMEOUT (derived from the grace when nothing set it),
    so under it this warns only about a timeout the user chose too short."""
    shutdown_s = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
    if "TORCHELASTIC_RUN_ID" in os.environ and grace_s >= shutdown_s and is_main:
        log.warning(
            "trainer.preempt_grace_s=%g is not below torchrun's shutdown timeout (%g s unless "
            "--shutdown_timeout says otherwise): torchrun may SIGKILL the ranks before they save",
            grace_s,
            shutdown_s,
        )


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def exit_with_launcher() -> None:
    """Under torchrun (Linux): the kernel kills this rank (SIGKILL) the moment its launcher dies, by any signal.

    torchrun's agent forwards SIGTERM/SIGINT to its ranks, but an agent that is SIGKILLed (the OOM killer, a
    lost Slurm step, `kill -9`) forwards nothing: its ranks were re-parented and kept training, saving and
    pruning checkpoints for minutes, and a restarted job then found its checkpoint pruned under it.
    `prctl(PR_SET_PDEATHSIG, SIGKILL)` ties the rank's life to its parent, the agent; a save interrupted that
    way leaves a `.tmp` directory, never a checkpoint that looks complete. An agent already gone before the
    call (the rank was re-parented to init) ends the rank at once. Idempotent; a no-op without torchrun."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning(
            "prctl(PR_SET_PDEATHSIG) failed (errno %d): this rank outlives a killed launcher",
            ctypes.get_errno(),
        )
    elif os.getppid() == 1:
        log.error("the launcher of this rank is gone: exiting")
        _hard_exit(1)
