"""Where rank 0 sends the run's metrics: the console, JSONL files, and the experiment trackers users watch.

`trainer.logger` lists the loggers (`console`, `jsonl`, `tensorboard`, `wandb`, `swanlab`, `mlflow`);
`build_loggers` makes them on rank 0 and nothing on the other ranks (every metric is already a global
reduction, see metrics.py). Each logger takes the step's metrics under verl's names (`critic/score/mean`,
`actor/kl_loss`, `val-core/<source>/acc/mean@N`, ...) and the validation generations as a table (rows of
`data_source`, `problem`, `response`, `ground_truth`, `score`):

    console      one line per `trainer.log_every` steps; a progress bar only on a terminal
    jsonl        `<run_dir>/metrics.jsonl` (one row per step) and `<run_dir>/val_generations.jsonl`
    tensorboard  event files in `<run_dir>/tensorboard`; generations as a markdown table (Text tab)
    wandb        project/name from `trainer.project_name`/`experiment_name`, files in `<run_dir>/wandb`
                 (`WANDB_MODE=offline` keeps it on disk); generations as a `wandb.Table`
    swanlab      the same names, files in `<run_dir>/swanlog`; generations as `swanlab.Text` entries
    mlflow       experiment = project_name, run = experiment_name, tracking URI from `MLFLOW_TRACKING_URI`;
                 generations as a JSON artifact per validation

The tracker packages are imported inside their classes only (the config check has already made sure they
are installed). On resume from step k every logger starts after k, so each step is logged once: the rows
of metrics.jsonl and val_generations.jsonl of steps after k (written after the checkpoint, before the crash,
and about to be redone) move to `metrics.rolledback.jsonl` / `val_generations.rolledback.jsonl`, and
tensorboard purges the events of those steps; wandb, swanlab and mlflow start a new run. A run that restarts
at step 0 (no checkpoint to resume, see run/start.py) moves every earlier row aside, step 0's included.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Protocol

from spmd_grpo.config.loader import to_dict
from spmd_grpo.config.schema import Config
from spmd_grpo.parallel.collectives import World
from spmd_grpo.telemetry.metrics import MetricsWriter, console_line, json_line

log = logging.getLogger(__name__)


class Logger(Protocol):
    """One destination for the run's metrics (rank 0 only)."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """The step's metrics, verl-named, global over ranks."""

    def log_table(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Validation generations of `step`, one dict per generation (a no-op where tables make no sense)."""

    def close(self) -> None:
        """Flush and end the run (the end of training)."""


class Loggers:
    """All the configured loggers behind one `Logger` (empty on ranks other than 0)."""

    def __init__(self, loggers: list[Logger]) -> None:
        self.loggers = loggers

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for logger in self.loggers:
            logger.log(step, metrics)

    def log_table(self, step: int, rows: list[dict[str, Any]]) -> None:
        for logger in self.loggers:
            logger.log_table(step, rows)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def build_loggers(cfg: Config, total_steps: int, *, start_step: int, enabled: bool) -> Loggers:
    """The loggers of `cfg.trainer.logger` (`enabled`: on this rank), starting after `start_step`."""
    if not enabled:
        return Loggers([])
    t, run_dir = cfg.trainer, cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    makers = {
        "console": lambda: ConsoleLogger(total_steps, t.log_every, start_step),
        "jsonl": lambda: JsonlLogger(run_dir, start_step),
        "tensorboard": lambda: TensorboardLogger(run_dir / "tensorboard", start_step),
        "wandb": lambda: WandbLogger(t.project_name, t.experiment_name, run_dir, to_dict(cfg)),
        "swanlab": lambda: SwanlabLogger(t.project_name, t.experiment_name, run_dir, to_dict(cfg)),
        "mlflow": lambda: MlflowLogger(t.project_name, t.experiment_name, to_dict(cfg)),
    }
    return Loggers([makers[name]() for name in t.logger])


# ------------------------------------------------------------------------------------ built in
class ConsoleLogger:
    """`console_line` every `log_every` steps (and the first and last); on a terminal also a progress bar,
    which tqdm clears before each line, so a line and the bar never share a row. Off a terminal (a log
    file, CI) the bar is off and the lines (they carry `step i/N` and `s/step`) are the progress."""

    def __init__(self, total_steps: int, log_every: int, start_step: int) -> None:
        from tqdm import tqdm

        self.total, self.every, self.write = total_steps, log_every, tqdm.write
        self.bar = tqdm(total=total_steps, initial=start_step, desc="grpo", dynamic_ncols=True, disable=None)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if step > 0:
            self.bar.update(1)
        if step % self.every == 0 or step in (1, self.total):
            self.write(console_line(step, self.total, metrics))

    def log_table(self, step: int, rows: list[dict[str, Any]]) -> None:
        pass

    def close(self) -> None:
        self.bar.close()


def first_logged_step(start_step: int) -> int:
    """The first step a run starting after `start_step` logs: step 0 (validation before training) only when
    it starts from the beginning."""
    return start_step + 1 if start_step > 0 else 0


def roll_back_jsonl(path: Path, first_step: int) -> int:
    """Move the rows of `path` with `step >= first_step` to `<name>.rolledback.jsonl` (appended: nothing is
    lost), so the redone steps appear once. A torn last line (a crash in the middle of a write) is moved too.
    The kept rows replace the file atomically (fsynced temp file + rename). Returns how many rows moved."""
    if not path.is_file():
        return 0
    keep, moved = [], []
    for line in path.read_text().splitlines():
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            step = first_step  # unreadable: the torn end of a write that the resume redoes
        (keep if step < first_step else moved).append(line)
    if not moved:
        return 0
    with path.with_name(path.stem + ".rolledback.jsonl").open("a") as f:
        f.write("".join(line + "\n" for line in moved))
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write("".join(line + "\n" for line in keep))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(moved)


class JsonlLogger:
    """`metrics.jsonl` (one row per step, flushed; see `MetricsWriter`) and `val_generations.jsonl`."""

    def __init__(self, run_dir: Path, start_step: int) -> None:
        self.writer = MetricsWriter(run_dir, enabled=True)
        self.generations = run_dir / "val_generations.jsonl"
        first = first_logged_step(start_step)
        for path in (self.writer.path, self.generations):
            moved = roll_back_jsonl(path, first)
            if moved:
                log.warning(
                    "%d rows of steps >= %d moved from %s to %s: those steps are redone",
                    moved,
                    first,
                    path,
                    path.stem + ".rolledback.jsonl",
                )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.writer.write(step, metrics)

    def log_table(self, step: int, rows: list[dict[str, Any]]) -> None:
        with self.generations.open("a") as f:
            f.writelines(json_line({"step": step, **row}) + "\n" for row in rows)

    def close(self) -> None:
        pass


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Rows of dicts as a markdown table (columns of the first row; `|` and newlines escaped)."""
    if not rows:
        return ""
    columns = list(rows[0])

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ trackers
class TensorboardLogger:
    """PyTorch's `SummaryWriter`: one scalar per metric and step, flushed every step (a live run shows)."""

    def __init__(self, log_dir: Path, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events of the redone steps (written before the crash) are dropped (steps >= it).
        purge = first_logged_step(start_step) if log_dir.is_dir() else None
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def log_table(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.writer.add_text("val/generations", markdown_table(rows), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """Weights & Biases: `wandb.init(project, name, config, dir=run_dir)`; the mode (online, offline) is
    wandb's own setting (`WANDB_MODE`, `wandb login`)."""

    def __init__(self, project: str, name: str, run_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=project, name=name, config=config, dir=str(run_dir))
        self.rows: list[list[Any]] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, step: int, rows: list[dict[str, Any]]) -> None:
        # A logged wandb.Table is immutable: log a new one holding every validation so far (as verl does).
        if not rows:
            return
        columns = ["step", *rows[0]]
        self.rows += [[step, *(row.get(c) for c in columns[1:])] for row in rows]
        self.run.log({"val/generations": self.wandb.Table(columns=columns, data=self.rows)}, step=step)

    def close(self) -> None:
        self.run.finish()
        # finish() can return before wandb's service process has written the run's files (seen on a busy
        # machine: an offline run's log still empty); teardown waits for it.
        self.wandb.teardown()


class SwanlabLogger:
    """SwanLab: `swanlab.init(project, experiment_name, config, logdir=<run_dir>/swanlog)`; the mode is
    SwanLab's own setting (`SWANLAB_MODE`, `swanlab login`)."""

    def __init__(self, project: str, name: str, run_dir: Path, config: dict[str, Any]) -> None:
        import swanlab

        self.swanlab = swanlab
        swanlab.init(project=project, experiment_name=name, config=config, logdir=str(run_dir / "swanlog"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.swanlab.log(metrics, step=step)

    def log_table(self, step: int, rows: list[dict[str, Any]]) -> None:
        texts = [
            self.swanlab.Text("\n\n".join(f"{k}: {v}" for k, v in row.items()), caption=f"sample {i}")
            for i, row in enumerate(rows)
        ]
        if texts:
            self.swanlab.log({"val/generations": texts}, step=step)

    def close(self) -> None:
        self.swanlab.finish()


def mlflow_name(name: str) -> str:
    """MLflow accepts letters, digits, `_ - . / ` and spaces in metric names: `@` becomes `_at_` (verl's
    `mean@4` -> `mean_at_4`), anything else `_`."""
    return re.sub(r"[^\w\-./ ]", "_", name.replace("@", "_at_"))


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow parameters: dotted keys, string values."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


class MlflowLogger:
    """MLflow: experiment `project_name`, run `experiment_name`, the config as parameters; the tracking
    server is MLflow's own setting (`MLFLOW_TRACKING_URI`)."""

    def __init__(self, project: str, name: str, config: dict[str, Any]) -> None:
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(project)
        mlflow.start_run(run_name=name)
        mlflow.log_params(flat_params(config))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.mlflow.log_metrics({mlflow_name(k): v for k, v in metrics.items()}, step=step)

    def log_table(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.mlflow.log_text(json.dumps(rows, indent=1), f"val_generations/step_{step:06d}.json")

    def close(self) -> None:
        self.mlflow.end_run()


def setup_logging(run_dir: Path, world: World) -> None:
    """Console: INFO on rank 0, warnings elsewhere; every rank's INFO also goes to
    `<run_dir>/logs/rank<r>.log` (vLLM logs through its own handler, to the console only)."""
    fmt = logging.Formatter(f"[rank{world.rank}] %(asctime)s %(levelname)s %(name)s: %(message)s")
    console = logging.StreamHandler()
    console.setLevel(logging.INFO if world.is_main else logging.WARNING)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(run_dir / "logs" / f"rank{world.rank}.log")
    for handler in (console, to_file):
        handler.setFormatter(fmt)
    logging.basicConfig(level=logging.INFO, handlers=[console, to_file])
