"""The checksums of the checkpoint a resume chose, verified by all ranks together once the process group exists.

Before the process group exists every rank checks the checkpoints by size and header only (run/start.py: a
missing or truncated file is a one-line error there, or a fallback to the previous checkpoint). The CRC-32s
read every byte, and no rank can read them all there: the other ranks wait for it in the process group's
creation for at most `trainer.collective_timeout_s`, and one rank reading a fully fine-tuned 235B-A22B
checkpoint (~3 TB) at ~1 GB/s needs ~50 min. So `verify_start` (trainer, right after
`lineage.agree_on_start`, before anything is loaded or moved) splits the files of the chosen checkpoint's
manifest over the ranks, balanced by bytes (manifest.py: `shares`), each rank checksums its own share, and
what they found is gathered to every rank. Every byte is still read once per job; the wait is the slowest
rank's share, about 1/world of the whole.

A corrupted file is then handled as the size checks handle damage: with `trainer.resume=auto` the checkpoint
is named in one warning and rank 0 plans the start again without it (`plan_start(damaged=...)`: the previous
complete checkpoint, with its own config diff and abandoned branch), whose checksums are verified the same
way, until one is undamaged; a checkpoint named by path is one line, `config error: trainer.resume=... is
damaged: <file>: CRC-32 ...`, and exit code 2, said once. A checkpoint without a manifest has no checksums
to verify (its resume says so: checkpoint_dirs.py).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from spmd_grpo.config.checks import ConfigError
from spmd_grpo.config.schema import Config
from spmd_grpo.parallel.collectives import World, all_gather_objects
from spmd_grpo.parallel.signals import say_once_and_exit
from spmd_grpo.run.manifest import VERIFY_THREADS, checksum_problems, listed_files, shares
from spmd_grpo.run.start import StartPlan, plan_start

log = logging.getLogger(__name__)


def verify_start(plan: StartPlan, cfg: Config, world: World) -> StartPlan:
    """`plan` once its checkpoint's checksums match its manifest (collective; every rank gets the same plan);
    damage ends the job as a config error does (one line, exit code 2, said once) when it cannot fall back."""
    try:
        return verified_plan(plan, cfg, world)
    except (ConfigError, ValueError) as e:
        say_once_and_exit(f"config error: {e}", world.rank)
        raise  # not reached: the rank has exited


def verified_plan(plan: StartPlan, cfg: Config, world: World) -> StartPlan:
    """`plan`, or with `trainer.resume=auto` the plan of the newest checkpoint whose checksums match, each
    damaged one named once (rank 0). Raises ValueError for a damaged checkpoint named by path and
    ConfigError when nothing is left to fall back to (alike on every rank: the damage is gathered)."""
    damaged: list[Path] = []
    while plan.checkpoint is not None:
        damage = spread_checksums(plan.checkpoint, world)
        if not damage:
            return plan
        if cfg.trainer.resume != "auto":
            raise ValueError(f"trainer.resume={cfg.trainer.resume!r} is damaged: {'; '.join(damage)}")
        if world.is_main:
            log.warning("rank 0: skipping damaged checkpoint %s: %s", plan.checkpoint, "; ".join(damage))
        damaged.append(plan.checkpoint)
        plan = _replan(cfg, world, tuple(damaged))
    return plan


def spread_checksums(checkpoint: Path, world: World) -> list[str]:
    """Every file of `checkpoint`'s manifest whose CRC-32 differs, in rank order (collective). Rank 0's
    listing decides the shares (every rank splits the same list); each rank reads its own share, with the
    node's `VERIFY_THREADS` split among the ranks on it."""
    listed = all_gather_objects(listed_files(checkpoint) if world.is_main else None)[0]
    if listed is None or isinstance(listed, str):  # no manifest; an unreadable one was damage by size
        return [listed] if listed else []
    mine = shares(listed, world.world_size)[world.rank]
    ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    found = checksum_problems(checkpoint, mine, threads=max(1, VERIFY_THREADS // ranks_here))
    return [problem for problems in all_gather_objects(found) for problem in problems]


def _replan(cfg: Config, world: World, damaged: tuple[Path, ...]) -> StartPlan:
    """Rank 0's plan with `damaged` passed over, on every rank (a ConfigError on every rank when it has
    none: every checkpoint damaged, or the previous one's config refused)."""
    plan, error = None, None
    if world.is_main:
        try:
            plan = plan_start(cfg, rank=0, damaged=damaged)
        except (ConfigError, ValueError) as e:
            error = str(e)
    plan, error = all_gather_objects((plan, error))[0]
    if error is not None:
        raise ConfigError(error)
    return plan
