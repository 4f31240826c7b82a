"""`python -m spmd_grpo.report RUN_DIR [--out PNG]`: a run's curves as one PNG, and a short text summary.

Reads `RUN_DIR/metrics.jsonl` (the `jsonl` logger's file, one row per step, verl's metric names), also while
the run is still writing it: a last line that is not complete yet is left out. Plots, over steps:

    reward               critic/score/mean (and train/gen_score/mean with DAPO dynamic sampling)
    validation accuracy  every val-core/ metric: <source>/acc/mean@N (<source>/reward/mean@N: no accuracy)
    response length      response_length/mean, max, min
    KL                   actor/kl_loss (the KL term against the reference) and actor/ppo_kl
    entropy              actor/entropy
    clip fraction        actor/pg_clipfrac, actor/pg_clipfrac_lower
    logprob gap          rollout/logprob_diff_mean, _max: trainer vs vLLM logprobs of the same tokens (log scale)
    step time            timing_s/step, timing_s/gen, timing_s/update_actor

and writes `RUN_DIR/report.png` (or `--out`). A panel whose metrics the run does not log says so. matplotlib
is imported here only (the Agg backend: no display needed), never by training.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

PANELS: list[tuple[str, list[str], bool]] = [
    ("reward", ["critic/score/mean", "train/gen_score/mean"], False),
    ("validation accuracy", ["val-core/"], False),
    (
        "response length (tokens)",
        ["response_length/mean", "response_length/max", "response_length/min"],
        False,
    ),
    ("KL", ["actor/kl_loss", "actor/ppo_kl"], False),
    ("entropy", ["actor/entropy"], False),
    ("clip fraction", ["actor/pg_clipfrac", "actor/pg_clipfrac_lower"], False),
    ("logprob gap, trainer vs vLLM", ["rollout/logprob_diff_mean", "rollout/logprob_diff_max"], True),
    ("step time (s)", ["timing_s/step", "timing_s/gen", "timing_s/update_actor"], False),
]
"""(title, metric names or a `prefix/` for every metric under it, log scale)."""


def read_metrics(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl, one per step (a repeated step keeps its last row), in step order. A last
    line that does not parse is a row being written and is left out; a bad line before it, or a row without
    a `step`, is an error. A `null` value (a non-finite figure, see metrics.py) is left out of its row."""
    lines = path.read_text().splitlines()
    rows: dict[int, dict] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a JSON line") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ValueError(f"{path}:{number}: no integer `step` in the row")
        rows[row["step"]] = {k: v for k, v in row.items() if v is not None}
    return [rows[step] for step in sorted(rows)]


def series(rows: list[dict], name: str) -> dict[str, tuple[list[int], list[float]]]:
    """{metric: (steps, values)} for `name`, or for every metric under `name` when it ends with `/`."""
    names = sorted({k for r in rows for k in r if k.startswith(name)}) if name.endswith("/") else [name]
    out = {}
    for metric in names:
        points = [(r["step"], float(r[metric])) for r in rows if metric in r]
        if points:
            out[metric] = ([s for s, _ in points], [v for _, v in points])
    return out


def plot(rows: list[dict], out: Path, title: str) -> Path:
    """One panel per entry of `PANELS`, written to `out` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 2, figsize=(13, 14), constrained_layout=True)
    for ax, (panel, names, log_scale) in zip(axes.flat, PANELS, strict=True):
        curves = {m: xy for name in names for m, xy in series(rows, name).items()}
        for metric, (steps, values) in curves.items():
            ax.plot(steps, values, label=metric, marker="." if len(steps) < 30 else None)
        if curves:
            ax.legend(fontsize=7)
            if log_scale and any(v > 0 for _, vs in curves.values() for v in vs):
                ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "not logged by this run", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(panel)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def summary(rows: list[dict]) -> list[str]:
    """A few lines: steps, reward first -> last, validation, response length, KL, logprob gap, step time,
    and the time validation and checkpoints took beside the steps."""
    train = [r for r in rows if r["step"] > 0]
    lines = [f"{len(train)} training steps logged (last step {rows[-1]['step']})"]
    reward = (
        "train/gen_score/mean" if any("train/gen_score/mean" in r for r in train) else "critic/score/mean"
    )
    scores = [r[reward] for r in train if reward in r]
    if scores:
        lines.append(
            f"reward ({reward}): first 5 steps {_mean(scores[:5]):.3f} -> last 5 steps {_mean(scores[-5:]):.3f}"
        )
    for metric, (steps, values) in series(rows, "val-core/").items():
        lines.append(f"{metric}: step {steps[0]} {values[0]:.3f} -> step {steps[-1]} {values[-1]:.3f}")
    last = train[-1] if train else {}
    for key, label, fmt in [
        ("response_length/mean", "response length (last step)", ".1f"),
        ("actor/kl_loss", "KL (last step)", ".2e"),
        ("actor/entropy", "entropy (last step)", ".3f"),
    ]:
        if key in last:
            lines.append(f"{label}: {last[key]:{fmt}}")
    gaps = [r["rollout/logprob_diff_max"] for r in train if "rollout/logprob_diff_max" in r]
    if gaps:
        lines.append(f"logprob gap trainer vs vLLM: max over steps {max(gaps):.1e}")
    times = [r["timing_s/step"] for r in train if "timing_s/step" in r]
    if times:
        lines.append(f"step time: median {statistics.median(times):.2f} s, sum {sum(times):.0f} s")
    # timing_s/step does not hold them (as verl's): the sum above is not the run's time without this.
    outside = sum(r.get("timing_s/testing", 0.0) + r.get("timing_s/save_checkpoint", 0.0) for r in rows)
    if outside:
        lines.append(f"validation and checkpoints (outside the step time): {outside:.0f} s")
    return lines


def write_report(run_dir: Path, out: Path | None = None) -> tuple[Path, list[str]]:
    """Plot `run_dir/metrics.jsonl` to `out` (default `run_dir/report.png`); returns the path and the summary.
    Raises FileNotFoundError without metrics.jsonl, ValueError when it holds no complete row yet."""
    path = run_dir / "metrics.jsonl"
    rows = read_metrics(path)
    if not rows:
        raise ValueError(f"{path}: no complete step yet")
    png = plot(rows, out or run_dir / "report.png", title=str(run_dir))
    return png, summary(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="a run directory (trainer.output_dir/trainer.experiment_name)")
    ap.add_argument("--out", type=Path, default=None, help="PNG to write (default RUN_DIR/report.png)")
    args = ap.parse_args(argv)
    try:
        png, lines = write_report(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"report: {e}")
        return 1
    print("\n".join([f"run {args.run_dir}:", *(f"  {line}" for line in lines), f"plot: {png}"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
