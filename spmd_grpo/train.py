"""GRPO for Qwen-VL models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) as plain SPMD: `torchrun [...] -m spmd_grpo.train cfg.yaml [section.key=value ...]`.

This entry point parses the command line, loads and validates the config against the world size from
torchrun's environment BEFORE any process group or model exists (values, paths that must exist, the data
set's size, a model whose family is not supported; a user reward file is imported) and decides what the
start does with the run directory (new run or resume, and the config's changes since the saved one:
run/start.py); a problem in either prints one line on stderr and exits with code 2. Then it prints the
`--dry-run` plan or starts the loop (`trainer.run`; the step is described in trainer.py).
"""

from __future__ import annotations

import os
import sys

from spmd_grpo.config.checks import BUILTIN_REWARDS, ConfigError, check_hub_reachable
from spmd_grpo.config.loader import load_config
from spmd_grpo.config.schema import Config
from spmd_grpo.config.validate import env_world_size, validate
from spmd_grpo.config.versions import VersionError, check_versions
from spmd_grpo.models.families import family_of_model_path
from spmd_grpo.parallel.signals import exit_with_launcher

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


def check_reward_imports(cfg: Config) -> None:
    """Import a `path/file.py:fn` reward now (running the user's module), so that a failing import or a
    name that is not callable stops the job here rather than after the model and vLLM have loaded."""
    spec = cfg.worker.reward.reward_function
    if spec in BUILTIN_REWARDS:
        return
    from spmd_grpo.algorithm.reward import load_reward_function

    try:
        load_reward_function(spec)
    except ValueError as e:
        raise ConfigError(f"worker.reward.reward_function: {e}") from None


def check_hub(cfg: Config) -> None:
    """The model and tokenizer hub ids that must be downloaded: the hub must answer (seconds, not minutes)."""
    model = cfg.worker.actor.model
    check_hub_reachable("worker.actor.model.model_path", model.model_path)
    if model.tokenizer_path is not None:
        check_hub_reachable("worker.actor.model.tokenizer_path", model.tokenizer_path)


def check_family(model_path: str, shared_prompt: bool | str = "auto") -> None:
    """A model whose family is not supported stops here, naming the key and the supported families; so does
    `worker.actor.shared_prompt=true` for a family with linear-attention layers."""
    try:
        family = family_of_model_path(model_path)
    except ValueError as e:
        raise ConfigError(f"worker.actor.model.model_path={model_path!r}: {e}") from None
    if shared_prompt is True and family is not None and family.linear_attention:
        raise ConfigError(
            f"worker.actor.shared_prompt=true: {family.name} has linear-attention layers, whose recurrent "
            "state after the prompt would have to seed each response (not done); use auto or false"
        )


def check_lora_targets(cfg: Config) -> None:
    """LoRA target and exclude modules that leave no layer, or name one the model lacks, stop here."""
    model = cfg.worker.actor.model
    if model.lora.enabled:
        from spmd_grpo.models import build

        try:
            build.check_lora_targets(model.model_path, model.lora, trust_remote_code=model.trust_remote_code)
        except ValueError as e:
            raise ConfigError(f"{e} (model {model.model_path})") from None


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
        check_reward_imports(cfg)
        check_hub(cfg)
        check_family(cfg.worker.actor.model.model_path, cfg.worker.actor.shared_prompt)
        check_lora_targets(cfg)
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
