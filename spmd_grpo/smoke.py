"""`make smoke-test`: the main job on the built-in tiny default, on this machine, then the learning curve.

Builds (once, cached under .cache/) a tiny random Qwen2.5-VL (`SMOKE_MODEL`), runs
    torchrun --nproc_per_node 2 -m spmd_grpo.train configs/smoke.yaml worker.actor.model.model_path=<tiny> ...
prints the mean reward over the steps from the run's metrics.jsonl and writes the curves (`spmd_grpo.telemetry.report`)
to <run dir>/report.png, printing its path. Exits non-zero if the run fails or
the final mean reward (mean over the last 5 steps) is below 0.8: if weight sync, the advantage sign or the
loss were wrong, the reward would not rise.

    python -m spmd_grpo.smoke [--nproc 2] [--config configs/smoke.yaml] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from spmd_grpo.config.loader import last_wins, load_config
from spmd_grpo.telemetry.report import write_report
from spmd_grpo.tools.make_tiny_model import TinyModelSpec, cached_tiny_model

REPO = Path(__file__).resolve().parents[1]
TARGET = 0.8
SMOKE_MODEL = TinyModelSpec(hidden_size=256, intermediate_size=512, num_attention_heads=4, head_logit_std=0.6)
"""The smoke task's model: wider than the tests' (64) with its head drawn so logits can move ~10 nats
(`make_tiny_model._draw_head`), so that LoRA, which leaves the head frozen, can learn the task as full
fine-tuning does; at width 64 no hidden state can make an answer digit more than ~2 % likely."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--config", default=str(REPO / "configs" / "smoke.yaml"))
    ap.add_argument("--cache", default=str(REPO / ".cache"))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    start = time.monotonic()
    model_dir = cached_tiny_model(args.cache, SMOKE_MODEL)
    overrides = last_wins([f"worker.actor.model.model_path={model_dir}", *args.overrides])  # the user's win
    cfg = load_config(args.config, overrides)
    metrics_path = cfg.run_dir / "metrics.jsonl"
    if metrics_path.exists():
        metrics_path.unlink()  # a fresh curve for this run
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={args.nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        "-m",
        "spmd_grpo.train",
        args.config,
        *overrides,
    ]
    print("+", " ".join(cmd), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    code = subprocess.call(cmd, env=env)
    elapsed = time.monotonic() - start
    if code != 0:
        print(f"smoke run failed with exit code {code} after {elapsed:.0f} s", file=sys.stderr)
        return code
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    code = report(
        [r for r in rows if r["step"] > 0],
        [r for r in rows if any(k.startswith("val-core/") for k in r)],
        elapsed,
    )
    png, _ = write_report(cfg.run_dir)
    print(f"curves: {png.resolve()}")
    return code


def report(rows: list[dict], val_rows: list[dict], elapsed: float) -> int:
    # With DAPO dynamic sampling the trained batch is filtered (only groups with spread): judge learning by
    # the score of everything generated instead.
    key = "train/gen_score/mean" if "train/gen_score/mean" in rows[0] else "critic/score/mean"
    print(f"\n{'step':>5} {'score':>7} {'accuracy':>9} {'resp_len':>9} {'lp_diff_max':>12} {'s/step':>7}")
    every = max(1, len(rows) // 20)
    for r in rows:
        if r["step"] == 1 or r["step"] % every == 0 or r["step"] == len(rows):
            print(
                f"{r['step']:>5} {r[key]:>7.3f} {r.get('reward/accuracy', float('nan')):>9.3f} "
                f"{r['response_length/mean']:>9.2f} {r['rollout/logprob_diff_max']:>12.1e} {r['timing_s/step']:>7.2f}"
            )
    if val_rows:
        print("\nvalidation (greedy-ish sampling, held-out colours):")
        for r in val_rows:
            print(
                f"{r['step']:>5} "
                + "  ".join(f"{k} {v:.3f}" for k, v in sorted(r.items()) if k.startswith("val-core/"))
            )
    first = sum(r[key] for r in rows[:5]) / min(5, len(rows))
    final = sum(r[key] for r in rows[-5:]) / min(5, len(rows))
    ok = final >= TARGET
    print(
        f"\nmean reward ({key}): first 5 steps {first:.3f} -> last 5 steps {final:.3f} (target >= {TARGET}); "
        f"{len(rows)} steps, wall time {elapsed:.0f} s: {'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
