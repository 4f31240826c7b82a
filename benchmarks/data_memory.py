"""Peak RSS of the data pipeline: load a geometry3k-schema parquet, draw one step's prompts, decode their images.

    python benchmarks/data_memory.py [--rows 2000,20000] [--batch 16] [--before REF] [--workdir DIR] [--out F]
        [--video]

For each size N, `data_N.parquet` (geometry3k schema, 256-row groups) is written once into --workdir
(default .cache/bench_data): 500 rows from `tools.synthetic_data.synthetic_geo3k_rows` (224x168 PNG diagrams,
~1.4 kB each), repeated to N rows (drawing 20k diagrams would take ~1 min here; repetition changes no per-row
cost). Then each measurement runs in a fresh Python process, so nothing is shared between sizes:

  base      VmRSS after the imports, the processor (tiny Qwen2.5-VL) and a warm-up run of the pipeline on a 64-row
            file (it pays the first-use imports, caches and code pages), gc + malloc_trim; VmHWM reset to it
  peak      VmHWM after the pipeline: `load_dataset(cfg, processor, "train")`, one `PromptSampler` batch of
            --batch prompts and `ex.images` of each of them: the process's peak RSS through the data pipeline
  time_s    the pipeline's wall time (nearly all of it the load's row checks)
  extra     peak - base: what the data pipeline itself added at its peak
  kept      VmRSS after the batch (gc + malloc_trim) - base: what stays resident

With `--before REF` the same measurement also runs against the package as it was at git commit REF (copied
with `git archive` to a scratch directory first on PYTHONPATH), e.g. the eager loader that kept every decoded
image. The script only uses `load_dataset(cfg, processor, "train")`, `Example.prompt_token_ids` and
`Example.images`, which both versions have. Prints one table and the 20k/2k-style ratios (largest size over
smallest) of `peak` and `extra`; --out writes the rows as JSON. Uses memtools.py (beside this script).

`--video`: the rows are `builtin:video_color` rows (a 4-frame 56x56 MPEG-4 video each, ~1.2 kB, in the
`videos` column), loaded with videos allowed, and the step decodes each prompt's `ex.videos` (frames).

From another benchmark: `sys.path.insert(0, "benchmarks"); import data_memory`, then
`print(data_memory.report(data_memory.run_benchmark([2000, 20000]), [2000, 20000], 16))`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # memtools.py sits beside this script
if "--child" not in sys.argv:
    sys.path.insert(1, str(REPO))  # the parent writes the files with this checkout's spmd_grpo
from memtools import MiB, proc_mem, release_free_memory, reset_peak_rss  # noqa: E402

DISTINCT_ROWS = 500
WARM_UP_ROWS = 64


def make_parquet(rows: int, workdir: Path, video: bool = False) -> Path:
    """`workdir/data_<rows>.parquet`, written once: DISTINCT_ROWS synthetic geometry3k rows (with `video`:
    video colour rows, `data_video_<rows>.parquet`), repeated."""
    from spmd_grpo.data.synthetic import synthetic_geo3k_rows, write_parquet

    path = workdir / f"data_{'video_' if video else ''}{rows}.parquet"
    if not path.exists():
        if video:
            from spmd_grpo.data.synthetic import video_color_task_examples as make
        else:
            make = synthetic_geo3k_rows
        distinct = make(DISTINCT_ROWS, seed=0)
        write_parquet([distinct[i % DISTINCT_ROWS] for i in range(rows)], path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)
    return path


def pipeline_names() -> tuple[type, Callable, type]:
    """`DataConfig`, `load_dataset` and `PromptSampler` from the modules that define them. `--before` may
    name a commit from before the package was split into subpackages (c36be89): there they were
    `spmd_grpo.config`, `spmd_grpo.data` and `spmd_grpo.sampler`, three flat modules."""
    try:
        from spmd_grpo.config.schema import DataConfig
        from spmd_grpo.data.dataset import load_dataset
        from spmd_grpo.data.sampler import PromptSampler
    except ModuleNotFoundError as error:  # in the flat layout `spmd_grpo.config` is a module
        if error.name != "spmd_grpo.config.schema":
            raise
        flat = {name: importlib.import_module(f"spmd_grpo.{name}") for name in ("config", "data", "sampler")}
        return flat["config"].DataConfig, flat["data"].load_dataset, flat["sampler"].PromptSampler
    return DataConfig, load_dataset, PromptSampler


def pipeline(parquet: Path, processor, batch: int, video: bool = False) -> tuple[list, list]:
    """The data pipeline of one rank at world size 1: load the rows, draw one step's prompts, decode their
    images (and videos). Returns (examples, [(prompt token ids, images + video frames)] of the step)."""
    from dataclasses import replace

    DataConfig, load_dataset, PromptSampler = pipeline_names()
    cfg = replace(DataConfig(), train_files=str(parquet), rollout_batch_size=batch)
    if not video:
        examples = load_dataset(cfg, processor, "train")
    else:
        cfg = replace(cfg, video_min_pixels=3136, video_max_pixels=3136)
        examples = load_dataset(cfg, processor, "train", limit_videos=1)
    sampler = PromptSampler(len(examples), batch, 0, 1, seed=cfg.seed, shuffle=True)
    media = (
        (lambda ex: ex.images + [f for v in ex.videos for f in v.frames]) if video else (lambda ex: ex.images)
    )
    return examples, [
        (examples[pos].prompt_token_ids, media(examples[pos])) for _, pos in sampler.next_batch()
    ]


def measure(parquet: Path, model_dir: Path, batch: int, video: bool = False) -> dict:
    """In this (fresh) process: base RSS, then the data pipeline's peak and what it keeps (bytes)."""
    import transformers

    _, load_dataset, _ = pipeline_names()
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    # A warm-up run on a small file pays the first-use imports, caches and code pages (not per-row costs).
    warm_up = f"data_{'video_' if video else ''}{WARM_UP_ROWS}.parquet"
    pipeline(parquet.with_name(warm_up), processor, batch, video)
    release_free_memory()
    base = proc_mem()["VmRSS"]
    reset_peak_rss()
    start = time.perf_counter()
    examples, prompts = pipeline(parquet, processor, batch, video)
    seconds = time.perf_counter() - start
    peak = proc_mem()["VmHWM"]
    # a PIL image (width x height) or a video frame (an [H, W, 3] array)
    pixels = sum(
        im.width * im.height if hasattr(im, "width") else im.shape[0] * im.shape[1]
        for _, media in prompts
        for im in media
    )
    del prompts
    release_free_memory()
    kept = proc_mem()["VmRSS"] - base
    return {
        "module": sys.modules[load_dataset.__module__].__file__,
        "rows": len(examples),
        "seconds": seconds,
        "base": base,
        "peak": peak,
        "extra": peak - base,
        "kept": kept,
        "batch_pixels": pixels,
    }


def run_child(code_root: Path, parquet: Path, model_dir: Path, batch: int, video: bool = False) -> dict:
    """`measure` in a fresh interpreter that imports `spmd_grpo` from `code_root`."""
    env = {**os.environ, "PYTHONPATH": str(code_root), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        __file__,
        "--child",
        str(parquet),
        str(model_dir),
        str(batch),
        *(["--video"] * video),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=code_root)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def checkout(ref: str, into: Path) -> Path:
    """The `spmd_grpo` package as of git commit `ref`, extracted into `into`."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", ref, "spmd_grpo"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def report(results: list[dict], sizes: list[int], batch: int) -> str:
    lines = [
        f"data_memory | 1 fresh process per measurement | batch {batch} prompts | geometry3k-schema parquet, 256-row groups",
        "[MiB]",
        f"{'code':>14} {'rows':>6} {'kept_rows':>9} {'time_s':>7} {'base':>7} {'peak':>7} {'extra':>7} {'kept':>7}",
    ]
    for r in results:
        lines.append(
            f"{r['code']:>14} {r['size']:>6} {r['rows']:>9} {r['seconds']:>7.1f} {r['base'] / MiB:>7.1f} "
            f"{r['peak'] / MiB:>7.1f} {r['extra'] / MiB:>7.1f} {r['kept'] / MiB:>7.1f}"
        )
    for code in dict.fromkeys(r["code"] for r in results):
        small, large = (
            next(r for r in results if r["code"] == code and r["size"] == s) for s in (sizes[0], sizes[-1])
        )
        lines.append(
            f"{code}: {sizes[-1]}/{sizes[0]} rows: peak {large['peak'] / small['peak']:.3f} x, "
            f"extra {large['extra'] / small['extra']:.2f} x"
        )
    return "\n".join(lines)


def run_benchmark(
    sizes: list[int],
    *,
    batch: int = 16,
    before: str | None = None,
    workdir: Path = REPO / ".cache" / "bench_data",
    model_dir: Path | None = None,
    video: bool = False,
) -> list[dict]:
    """One fresh process per (code, size): the current package, then (with `before`) the one at that git
    commit. Returns one dict per measurement (bytes); `report` prints them. Other benchmarks call this."""
    from spmd_grpo.tools.make_tiny_model import TinyModelSpec, cached_tiny_model

    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = model_dir or cached_tiny_model(REPO / ".cache", TinyModelSpec())
    parquets = {n: make_parquet(n, workdir, video) for n in [WARM_UP_ROWS, *sizes]}
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        codes = {"current": REPO}
        if before:
            codes[f"before {before[:7]}"] = checkout(before, Path(scratch))
        for code, root in codes.items():
            for n in sizes:
                result = run_child(root, parquets[n], model_dir, batch, video)
                results.append({"code": code, "size": n, **result})
                print(f"{code} {n} rows: {json.dumps(result)}", file=sys.stderr, flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="2000,20000", help="comma-separated data set sizes")
    parser.add_argument(
        "--batch", type=int, default=16, help="prompts drawn and decoded (one step of one rank)"
    )
    parser.add_argument("--before", metavar="REF", help="also measure the package at this git commit")
    parser.add_argument("--workdir", type=Path, default=REPO / ".cache" / "bench_data")
    parser.add_argument("--model-dir", type=Path, help="processor to tokenize with (default: the tiny model)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--video", action="store_true", help="video colour rows instead of geometry3k rows")
    args = parser.parse_args()
    sizes = sorted(int(n) for n in args.rows.split(","))
    results = run_benchmark(
        sizes,
        batch=args.batch,
        before=args.before,
        workdir=args.workdir,
        model_dir=args.model_dir,
        video=args.video,
    )
    print(report(results, sizes, args.batch))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        video = sys.argv[5:6] == ["--video"]
        print(json.dumps(measure(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), video)))
    else:
        main()
