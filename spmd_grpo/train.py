"""GRPO and DAPO for the Qwen vision-language models (README: supported models) as plain SPMD:

    torchrun [...] -m spmd_grpo.train cfg.yaml [section.key=value ...]
    python -m spmd_grpo.train cfg.yaml [section.key=value ...] --dry-run [--nnodes N] [--nproc-per-node M]
        [--device-memory-gb G]      # plan a job of N nodes x M devices of G GB (defaults 1, 8, 80)

This entry point parses the command line, loads and validates the config against the world size from
torchrun's environment BEFORE any process group or model exists (values, paths that must exist, the data
set's size, a model whose family is not supported; a user reward file is imported) and decides what the
start does with the run directory (new run or resume, and the config's changes since the saved one:
run/start.py), after checking that the run directory can be written; a problem in any of these prints one
line on stderr and exits with code 2 (under torchrun rank 0 says it; the other ranks only if rank 0 has not
stopped them within `QUIET_RANK_S`). Then it prints the `--dry-run` plan or starts the loop (`trainer.run`;
the step: docs/architecture.md). `spmd_grpo.launch` runs the same checks (`prepare`) once before it starts
the ranks.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING

from spmd_grpo.config.checks import ConfigError
from spmd_grpo.config.loader import load_config
from spmd_grpo.config.validate import validate
from spmd_grpo.parallel.signals import QUIET_RANK_S, exit_with_launcher
from spmd_grpo.run.preflight import preflight
from spmd_grpo.versions import VersionError, check_versions

if TYPE_CHECKING:
    from spmd_grpo.config.schema import Config
    from spmd_grpo.run.start import StartPlan

DRY_RUN_OPTIONS = ("--nnodes", "--nproc-per-node", "--device-memory-gb")


def parse_args(argv: list[str]) -> tuple[str | None, list[str], dict[str, int] | None]:
    """`cfg.yaml [key=value ...] [--dry-run [--nnodes N] [--nproc-per-node M] [--device-memory-gb G]]`."""
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0)
    dry_run = None
    rest = []
    it = iter(argv)
    for arg in it:
        if arg == "--dry-run":
            dry_run = dry_run or {}
        elif arg in DRY_RUN_OPTIONS:
            value = next(it, None)
            if value is None or not value.isdigit() or int(value) < 1:
                raise ConfigError(f"{arg} needs a positive integer, got {value!r}")
            dry_run = dry_run or {}
            dry_run[arg.lstrip("-").replace("-", "_")] = int(value)
        elif arg.startswith("--"):
            raise ConfigError(
                f"unknown option {arg} (options: --dry-run, --nnodes N, --nproc-per-node M, --device-memory-gb G)"
            )
        else:
            rest.append(arg)
    path = rest[0] if rest and "=" not in rest[0] else None
    return path, rest[1:] if path is not None else rest, dry_run


def prepare(argv: list[str], world_size: int, *, rank: int | None) -> tuple[Config, StartPlan] | None:
    """Everything decided before any process group exists: the command line, the config and its checks, the
    run directory and the start plan (ConfigError / ValueError / VersionError: one line for the user).
    None after a `--dry-run` printed its plan.

    `rank`: this rank under torchrun; rank 0 locks the run directory (one job per run directory). Every
    rank checks the checkpoints' sizes and headers; their checksums are verified after the process group
    forms, by all ranks together (run/verify.py). None: `spmd_grpo.launch` checking once before it starts
    the ranks (nothing is locked, the lock is only probed; a `--dry-run` is left to the ranks)."""
    path, overrides, dry_run_options = parse_args(argv)
    cfg = load_config(path, overrides)
    if dry_run_options is not None:
        if rank is not None:
            from spmd_grpo.dry_run.plan import dry_run

            nnodes, nproc = dry_run_options.get("nnodes", 1), dry_run_options.get("nproc_per_node", 8)
            print(dry_run(cfg, nnodes, nproc, dry_run_options.get("device_memory_gb", 80)))
        return None
    validate(cfg, world_size)
    check_versions()
    preflight(cfg)
    from spmd_grpo.run.lock import check_not_locked, check_writable, lock_run_dir, name_holder
    from spmd_grpo.run.start import plan_start

    check_writable(cfg.run_dir)  # every rank: one line now, not a traceback after the process group forms
    # One job per run directory: rank 0 locks it before anything is written, names itself once accepted.
    if rank == 0:
        lock_run_dir(cfg.run_dir)
    elif rank is None:
        check_not_locked(cfg.run_dir)  # a running job's directory is refused before its contents are judged
    start = plan_start(cfg, rank=rank, launcher=rank is None)  # new run or resume, and the config diff
    if rank == 0:
        name_holder(cfg.run_dir)
    return cfg, start


def one_line_error(e: Exception) -> str:
    """What `main` (and `spmd_grpo.launch`) print for an error of `prepare`."""
    return f"{'version' if isinstance(e, VersionError) else 'config'} error: {e}"


def main(argv: list[str] | None = None) -> None:
    exit_with_launcher()  # a rank whose torchrun agent is killed must not go on alone
    argv = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", "0"))
    try:
        prepared = prepare(argv, int(os.environ.get("WORLD_SIZE", "1")), rank=rank)  # torchrun's
    except (ConfigError, ValueError, VersionError) as e:
        if rank != 0 and "TORCHELASTIC_RUN_ID" in os.environ:
            # Rank 0 decides what the job says: it checked the same config (and locked the run directory),
            # so it has most likely stopped too and said why, and torchrun ends this rank while it waits. A
            # rank that alone found a problem (a file its node lacks) still says it, a moment later.
            time.sleep(QUIET_RANK_S)
        print(one_line_error(e), file=sys.stderr)
        raise SystemExit(2) from None
    if prepared is None:
        return
    from spmd_grpo.trainer import run

    run(*prepared)


if __name__ == "__main__":
    main()
