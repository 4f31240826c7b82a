"""What a start does with its run directory, decided before anything is written or loaded.

`plan_start(cfg)` runs in `spmd_grpo.train` on every rank, after the config is validated and before the
process group exists. It only reads files, and nothing is written until every rank has joined the process
group (which needs every rank past this point), so all ranks decide from the same files. A problem is a
`ConfigError`: one line, exit code 2, before any model or vLLM engine is built. `spmd_grpo.launch` runs it
once more before it starts the ranks (`launcher=True`: no warnings; rank 0 gives those).

Checkpoints are checked here by size and header only: a missing or truncated file is found before the
process group. Their CRC-32s (every byte) are verified once it exists, by all ranks, a share each
(run/verify.py); a corrupted checkpoint is handled alike (`auto`: planned again without it, `damaged`).

The checkpoint to resume must be of the kind the config trains: a LoRA checkpoint holds adapters only, and
neither full fine-tuning nor adapters of another rank can load them, nor adapters whole weights; such a
resume is refused with the way out (resume with the saved rank, or export the checkpoint, merged for LoRA,
and start a new run from it), even where `trainer.allow_config_change` lets the rank change pass the diff.

The run directory (`<trainer.output_dir>/<trainer.experiment_name>`) HOLDS A RUN when it has a
`config.yaml`, `metrics.jsonl`, `val_generations.jsonl`, `tensorboard/` or a non-empty `checkpoints/`
(rank log files alone do not count: they are only ever appended to). `trainer.resume`:

    auto  (default) continue the run the directory holds, from its newest complete, undamaged checkpoint.
          Without one (the run died before its first save, or never saves) the run restarts at step 0 and
          the loggers move its earlier rows aside. Checkpoints that look complete but are ALL damaged are an
          error: restarting would silently drop the run's progress. An empty directory: a new run.
    none  a new run: an error, naming the directory and the options, if the directory holds a run. A new
          run never appends to or overwrites another run's metrics, config or checkpoints.
    PATH  that checkpoint: one of this run's (under `<run dir>/checkpoints/`: the run goes back to it, and
          its later checkpoints, an abandoned branch, are moved to `<run dir>/abandoned/` before training:
          run/lineage.py), or another run's when this directory holds no run yet (a new run that starts from
          its state).

The config a resume is compared with, and how: run/saved_config.py.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from spmd_grpo.config.checks import ConfigError
from spmd_grpo.config.schema import Config
from spmd_grpo.run.checkpoint_dirs import (
    CHECKPOINTS,
    CONFIG,
    complete_checkpoints,
    damaged_parts,
    find_checkpoint,
    saved_lora_rank,
)
from spmd_grpo.run.lineage import later_checkpoints
from spmd_grpo.run.saved_config import (
    DATA_POSITION_KEYS,
    MEANING_CHANGING,
    ConfigChange,
    diff_configs,
    flatten,
    meaning_changes,
    plain_config,
)

log = logging.getLogger(__name__)

RUN_RECORDS = ("config.yaml", "metrics.jsonl", "val_generations.jsonl", "tensorboard", CHECKPOINTS)


@dataclass(frozen=True)
class StartPlan:
    """What this start does: resume `checkpoint` (None: start at step 0) with `changes` since `saved_config`."""

    run_dir: Path
    checkpoint: Path | None
    changes: tuple[ConfigChange, ...] = ()
    saved_config: Path | None = None
    """The saved config file the diff read (None: a new run, or nothing saved to compare with)."""
    restart: bool = False
    """The directory holds a run without a checkpoint to resume: it starts over at step 0."""
    abandoned: tuple[Path, ...] = ()
    """This run's checkpoints after the resumed one: a branch left behind, moved aside before training
    (run/lineage.py)."""

    @property
    def reset_data_position(self) -> bool:
        """An allowed change made the saved data position meaningless: sampling starts over."""
        return any(c.key in DATA_POSITION_KEYS for c in self.changes)

    def lines(self) -> list[str]:
        """What rank 0 logs at start-up: the decision, then one line per config change."""
        if self.checkpoint is not None:
            head = f"start: resuming {self.checkpoint}"
        elif self.restart:
            head = f"start: {self.run_dir} holds no complete checkpoint: the run restarts at step 0"
        else:
            head = f"start: new run in {self.run_dir}"
        if self.saved_config is not None:
            head += f" (config compared with {self.saved_config}: {len(self.changes)} changes)"
        elif self.checkpoint is not None:
            head += " (no saved config to compare with: changes are not checked)"
        lines = [head, *(f"resume: {c}" for c in self.changes)]
        if self.abandoned:
            lines.append(
                f"resume: {', '.join(p.name for p in self.abandoned)} of the old branch are set aside "
                f"(to {self.run_dir / 'abandoned'}): trainer.resume=auto continues from {self.checkpoint.name}"
            )
        if self.reset_data_position:
            lines.append(
                "resume: the saved data position is dropped (the data changed): sampling starts over"
            )
        return lines


# ------------------------------------------------------------------------------------------------ plan
def run_records(run_dir: Path) -> list[str]:
    """The files of `RUN_RECORDS` that `run_dir` holds (a `checkpoints/` directory only when not empty)."""
    found = []
    for name in RUN_RECORDS:
        path = run_dir / name
        if path.is_file() or (path.is_dir() and any(path.iterdir())):
            found.append(name)
    return found


def plan_start(
    cfg: Config, *, rank: int | None = None, launcher: bool = False, damaged: tuple[Path, ...] = ()
) -> StartPlan:
    """Decide new run / resume / restart for `cfg` and check the config against the saved one; raises
    ConfigError (ValueError for a `trainer.resume` path that is not a usable checkpoint), naming files.
    Checkpoints are checked by size and header (their checksums: run/verify.py).

    `rank` (default: torchrun's RANK, 0 without torchrun): rank 0 warns about the damaged, incomplete or
    unverifiable checkpoints it passes over; the other ranks say nothing (rank 0 says it once). `launcher`:
    `spmd_grpo.launch`'s check before the ranks exist (silent: rank 0 says it when it starts). `damaged`
    (`trainer.resume=auto`): checkpoints the checksums found damaged after the start, already named: passed
    over, so the plan is the previous checkpoint's (its config diff, its abandoned branch)."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    speaker = None if launcher else rank
    run_dir, mode = cfg.run_dir, cfg.trainer.resume
    new = plain_config(cfg)
    _check_allow_list(cfg.trainer.allow_config_change, flatten(new))
    records = run_records(run_dir)
    if mode == "none":
        if records:
            raise ConfigError(
                f"{run_dir} already holds a run ({', '.join(records)}) and trainer.resume=none starts a new "
                "one: trainer.resume=auto continues that run; for a new run pick another "
                "trainer.experiment_name or trainer.output_dir (or remove the directory)"
            )
        return StartPlan(run_dir, None)
    checkpoint = _checkpoint_to_resume(run_dir, mode, records, speaker, damaged)
    if checkpoint is not None:
        _check_adapters(checkpoint, cfg)
    abandoned = later_checkpoints(run_dir, checkpoint) if checkpoint is not None else ()
    saved_file = _saved_config_file(run_dir, checkpoint)
    if saved_file is None:
        restart = checkpoint is None and bool(records)
        return StartPlan(run_dir, checkpoint, restart=restart, abandoned=abandoned)
    changes = diff_configs(_read_config(saved_file), new)
    refused = meaning_changes(changes, cfg.trainer.allow_config_change)
    if refused:
        raise ConfigError(_refusal(run_dir, checkpoint, saved_file, refused))
    return StartPlan(
        run_dir, checkpoint, tuple(changes), saved_file, restart=checkpoint is None, abandoned=abandoned
    )


def _check_allow_list(allowed: tuple[str, ...], known: dict[str, Any]) -> None:
    for key in allowed:
        if key not in known:
            raise ConfigError(f"trainer.allow_config_change: unknown config key {key}")


def _checkpoint_to_resume(
    run_dir: Path, mode: str, records: list[str], rank: int | None, damaged: tuple[Path, ...]
) -> Path | None:
    """The checkpoint `mode` names, by sizes and headers (every rank alike; the checksums are verified
    after the start, by all ranks: run/verify.py). Rank 0 names what it passes over; the other ranks (and
    the launcher, `rank` None) follow rank 0's choice (lineage.agree_on_start)."""
    root = run_dir / CHECKPOINTS
    speaker = 0 if rank == 0 else None
    if mode == "auto":
        checkpoint = find_checkpoint(run_dir, "auto", checksums=False, rank=speaker, damaged=damaged)
        complete = complete_checkpoints(root)
        if checkpoint is None and complete:
            named = "each named in the warnings above"
            if rank is None:  # nothing was said: the first damage of each, by sizes
                first = {p.name: damaged_parts(p, checksums=False)[:1] for _, p in sorted(complete.items())}
                named = "; ".join(f"{name}: {d[0] if d else '?'}" for name, d in first.items())
            raise ConfigError(
                f"every checkpoint in {root} is damaged ({named}) and restarting "
                "at step 0 would drop the run's progress: resume one with trainer.resume=PATH after repairing "
                "it, move them aside to restart the run, or pick another trainer.experiment_name for a new run"
            )
        return checkpoint
    checkpoint = find_checkpoint(run_dir, mode, checksums=False, rank=speaker)  # ValueError: the damage
    ours = checkpoint.resolve().parent == root.resolve()
    if records and not ours:
        raise ConfigError(
            f"{run_dir} already holds a run ({', '.join(records)}); starting from another run's checkpoint "
            f"{checkpoint} in it would mix the two: pick another trainer.experiment_name or trainer.output_dir"
        )
    return checkpoint


def _check_adapters(checkpoint: Path, cfg: Config) -> None:
    """A LoRA checkpoint resumed without LoRA (or with another rank), or a full one resumed with LoRA,
    cannot be loaded into the policy this config builds: one line saying why and what to do, before
    anything is built (the diff alone lets such a change through once `allow_config_change` names it)."""
    model = cfg.worker.actor.model
    saved, wanted = saved_lora_rank(checkpoint), model.lora.rank
    if saved is None or saved == wanted:
        return
    key = "worker.actor.model.lora.rank"
    if saved == 0:
        raise ConfigError(
            f"{checkpoint} holds fully fine-tuned weights, and {key}={wanted} trains adapters on the frozen "
            f"base {model.model_path}: the checkpoint's weights would not be loaded. Export it "
            f"(python -m spmd_grpo.export {checkpoint} OUT) and start a new run from OUT with "
            f"worker.actor.model.model_path=OUT, or resume it with {key}=0"
        )
    merged = (
        f"export it merged (python -m spmd_grpo.export {checkpoint} ADAPTER_OUT --merged MERGED_OUT) and "
        "start a new run from the merged model (worker.actor.model.model_path=MERGED_OUT)"
    )
    if wanted == 0:
        raise ConfigError(
            f"{checkpoint} holds LoRA adapters of rank {saved} and no trained base weights, and {key}=0 "
            f"(full fine-tuning) needs whole weights to resume: {merged}, or resume it with {key}={saved}"
        )
    raise ConfigError(
        f"{checkpoint} holds LoRA adapters of rank {saved} and {key}={wanted} builds adapters of another "
        f"shape, which cannot load them: resume it with {key}={saved}, or {merged}"
    )


def _saved_config_file(run_dir: Path, checkpoint: Path | None) -> Path | None:
    if checkpoint is None:
        candidates = [run_dir / CONFIG]
    else:  # checkpoints saved before configs were saved with them: their run's config.yaml
        candidates = [checkpoint / CONFIG, checkpoint.parent.parent / CONFIG]
    return next((p for p in candidates if p.is_file()), None)


def _read_config(path: Path) -> dict[str, Any]:
    try:
        saved = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: the saved config is not readable: {str(e).splitlines()[0]}") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"{path}: the saved config is not a mapping")
    return saved


def _refusal(run_dir: Path, checkpoint: Path | None, saved_file: Path, refused: list[ConfigChange]) -> str:
    what = f"resuming {checkpoint}" if checkpoint else f"restarting the run in {run_dir}"
    listed = "; ".join(f"{c} ({MEANING_CHANGING[c.key]})" for c in refused)
    keys = ",".join(c.key for c in refused)
    return (
        f"{what} with a config that changes what its saved state means (compared with {saved_file}): "
        f"{listed}. To continue with the new values add trainer.allow_config_change=[{keys}]; "
        "for a new run pick another trainer.experiment_name or trainer.output_dir"
    )
