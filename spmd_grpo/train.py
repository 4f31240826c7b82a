"""GRPO for Qwen-VL models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) as plain SPMD: `torchrun [...] -m spmd_grpo.train cfg.yaml [section.key=value ...]`.

This entry point parses the command line, loads and validates the config against the world size from
torchrun's environment BEFORE any process group or model exists (values, paths that must exist, the data
set's size, a model whose family is not supported; a user reward file is imported) and decides what the
start does with the run directory (new run or resume, and the config's changes since the saved one:
run/start.py); a problem in either prints one line on stderr and exits with code 2. Then it prints the
`--dry-run` plan or starts the loop (`trainer.run`; the step: docs/architecture.md).
"""

from __future__ import annotations

import os
import sys

from spmd_grpo.config.checks import ConfigError
from spmd_grpo.config.loader import load_config
from spmd_grpo.config.validate import env_world_size, validate
from spmd_grpo.parallel.signals import exit_with_launcher
from spmd_grpo.run.preflight import preflight
from spmd_grpo.versions import VersionError, check_versions

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


def main(argv: list[str] | None = None) -> None:
    exit_with_launcher()  # a rank whose torchrun agent is killed must not go on alone
    argv = sys.argv[1:] if argv is None else argv
    try:
        path, overrides, dry_run_options = parse_args(argv)
        cfg = load_config(path, overrides)
        if dry_run_options is not None:
            from spmd_grpo.dry_run import dry_run

            nnodes, nproc = dry_run_options.get("nnodes", 1), dry_run_options.get("nproc_per_node", 8)
            print(dry_run(cfg, nnodes, nproc, dry_run_options.get("device_memory_gb", 80)))
            return
        validate(cfg, env_world_size())
        preflight(cfg)
        check_versions()
        from spmd_grpo.run.lock import lock_run_dir, name_holder
        from spmd_grpo.run.start import plan_start

        # One job per run directory: rank 0 locks it before anything is written, names itself once accepted.
        holds_lock = int(os.environ.get("RANK", "0")) == 0
        if holds_lock:
            lock_run_dir(cfg.run_dir)
        start = plan_start(cfg)  # new run or resume, and the config diff
        if holds_lock:
            name_holder(cfg.run_dir)
    except (ConfigError, ValueError, VersionError) as e:
        kind = "version" if isinstance(e, VersionError) else "config"
        print(f"{kind} error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    from spmd_grpo.trainer import run

    run(cfg, start)


if __name__ == "__main__":
    main()
