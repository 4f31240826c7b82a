"""Resume lineage: a resume from an earlier checkpoint leaves the run's later checkpoints as an abandoned branch.

A run saved steps 2 and 4; the user resumes from `global_step_2` by path and trains steps 3, 4', ... Before,
`global_step_4` of the old branch stayed beside the new one: a later `trainer.resume=auto` took it (the newest
complete directory; `latest` disagreed, the log said so and went on), the metrics ended with a gap, and
`save_limit` pruned the new branch's checkpoints before the old branch's. Now:

  * `later_checkpoints` (called by `run.start.plan_start`, which only reads) lists this run's `global_step_N`
    directories with N after the resumed step: complete, damaged or half-pruned alike (a `.tmp` directory is
    an unfinished save, which a save of that step removes anyway, and stays).
  * `agree_on_start` (after the process group exists): rank 0's plan is what every rank does. Each rank
    planned from the files it saw (sizes and headers); one that chose otherwise (a shared file system
    serving a stale view, or files that changed while the ranks read them) says so in a warning and follows
    rank 0, so every rank loads the same checkpoint (whose checksums the ranks then verify together:
    run/verify.py). The same collective carries each rank's view of the run directory's lock file: a node
    that does not see the one rank 0 wrote has another directory (node-local), and the job stops there, one
    line and exit code 2 (run/lock.py: `unshared_run_dir`).
  * `abandon_branch` (rank 0, before anything is loaded or written): moves those directories, not deletes
    them, to `<run dir>/abandoned/after_step_<k>/` (`.1`, `.2`, ... when that exists) and points `latest`
    at the resumed checkpoint. The metrics rows of the abandoned steps (> k) are moved to
    `metrics.rolledback.jsonl` by the loggers, as for any resume (telemetry/loggers.py), so `metrics.jsonl`
    holds each step of the chosen branch once, with no gap.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import TypeVar

from spmd_grpo.parallel.collectives import World, all_gather_objects, barrier
from spmd_grpo.parallel.signals import say_once_and_exit
from spmd_grpo.run.checkpoint import write_atomic
from spmd_grpo.run.checkpoint_dirs import CHECKPOINTS, LATEST, step_of
from spmd_grpo.run.lock import lock_text, unshared_run_dir

log = logging.getLogger(__name__)

ABANDONED = "abandoned"
Plan = TypeVar("Plan")  # run.start.StartPlan (which imports this module)


def later_checkpoints(run_dir: Path, checkpoint: Path) -> tuple[Path, ...]:
    """This run's `global_step_N` directories with N greater than `checkpoint`'s step, oldest first (empty
    when `checkpoint` is not one of this run's: a new run starting from another run's state)."""
    root = run_dir / CHECKPOINTS
    resumed = step_of(checkpoint)
    if resumed is None or not root.is_dir() or checkpoint.resolve().parent != root.resolve():
        return ()
    later = [(step_of(p), p) for p in root.iterdir() if p.is_dir() and (step_of(p) or -1) > resumed]
    return tuple(path for _, path in sorted(later))


LOCK_VIEW_WAIT_S = 60
"""How long a rank that does not see rank 0's lock file yet reads it again before the run directory counts
as another directory: NFS clients cache a directory's lookups for up to `acdirmax` (60 s by default), so a
file another node created a moment ago may be missing there for that long."""


def agree_on_start(plan: Plan, world: World) -> Plan:
    """Rank 0's plan, on every rank (collective). A rank whose own plan differs warns, naming both; a run
    directory some node sees elsewhere ends the job (exit code 2), said once, after the ranks that did not see
    rank 0's lock file read it again for up to `LOCK_VIEW_WAIT_S` (at most half `world.timeout_s`, the
    collective timeout the other ranks wait under)."""
    host = socket.gethostname()
    views = all_gather_objects((plan, host, lock_text(plan.run_dir)))
    if unshared_run_dir(plan.run_dir, [(h, text) for _, h, text in views]):  # every rank takes this branch
        expected, deadline = views[0][2], time.monotonic() + min(LOCK_VIEW_WAIT_S, world.timeout_s / 2)
        while (text := lock_text(plan.run_dir)) != expected and time.monotonic() < deadline:
            time.sleep(1)
        views = all_gather_objects((plan, host, text))
        unshared = unshared_run_dir(plan.run_dir, [(h, text) for _, h, text in views])
        if unshared:
            say_once_and_exit(f"config error: {unshared}", world.rank)
    chosen = views[0][0]
    if (plan.checkpoint, plan.abandoned) != (chosen.checkpoint, chosen.abandoned):
        log.warning(
            "rank %d read the run directory differently (resume %s, abandoned %s) from rank 0 (resume %s, "
            "abandoned %s): following rank 0; %s is on a file system that shows the ranks different files, "
            "or its files changed while the ranks read them",
            world.rank,
            plan.checkpoint,
            [p.name for p in plan.abandoned],
            chosen.checkpoint,
            [p.name for p in chosen.abandoned],
            plan.run_dir,
        )
    return chosen


def abandon_branch(plan: Plan, world: World) -> Path | None:
    """Move `plan.abandoned` aside and point `latest` at `plan.checkpoint` (rank 0; collective: the other
    ranks wait). Returns the directory they went to (None: nothing to move)."""
    target = None
    if world.is_main and plan.abandoned:
        assert plan.checkpoint is not None
        target = _free_name(plan.run_dir / ABANDONED / f"after_step_{step_of(plan.checkpoint)}")
        target.mkdir(parents=True)
        for path in plan.abandoned:
            os.replace(path, target / path.name)
        write_atomic(plan.checkpoint.parent / LATEST, plan.checkpoint.name)
        log.warning(
            "resuming %s: the later checkpoints %s are an abandoned branch, moved to %s (their metrics rows "
            "go to metrics.rolledback.jsonl)",
            plan.checkpoint,
            ", ".join(p.name for p in plan.abandoned),
            target,
        )
    barrier()
    return target


def _free_name(path: Path) -> Path:
    """`path`, or `path.1`, `path.2`, ...: the first that does not exist (a branch abandoned twice at one step)."""
    candidate, i = path, 0
    while candidate.exists():
        i += 1
        candidate = path.with_name(f"{path.name}.{i}")
    return candidate
