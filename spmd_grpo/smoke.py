"""`make smoke-test`: the main job on the built-in tiny default, on this machine, until it has learned the task.

Builds (once, cached under .cache/) a tiny random Qwen2.5-VL (`SMOKE_MODEL`), starts a new run in the run
directory (the previous smoke's directory is removed first)
    python -m spmd_grpo.launch --nproc_per_node 2 -m spmd_grpo.train configs/smoke.yaml \
        worker.actor.model.model_path=<tiny> trainer.resume=none ...
and follows its metrics.jsonl. The pass criterion (`learned_at`): the mean reward of WINDOW consecutive
steps reaches TARGET within the config's `trainer.max_steps`. When it does, the run is stopped with SIGTERM
(the ranks finish the step they are in, save it as a checkpoint and exit with 143), and that checkpoint
must be complete and be the last logged step. A run that reaches max_steps without meeting the criterion
fails: if weight sync, the advantage sign or the loss were wrong (or the learning rate 0), the reward would
not rise. Then it prints the reward per step and the validation rows, and writes the curves
(`spmd_grpo.telemetry.report`) to <run dir>/report.png, printing its path.

    python -m spmd_grpo.smoke [--nproc 2] [--family qwen2_5_vl] [--config configs/smoke.yaml] [key=value ...]

`--family` trains another family's tiny model (`SMOKE_MODELS`) on the same task with the same criterion, from
its own config (`configs/smoke_<family>.yaml` unless `--config` names one): `make smoke-test-moe`
(Qwen3-VL-MoE) and `make smoke-test-qwen3_5` (the hybrid Qwen3.5, bf16 rollout).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from spmd_grpo.config.checks import ConfigError
from spmd_grpo.config.loader import last_wins, load_config
from spmd_grpo.parallel.collectives import free_port
from spmd_grpo.run.checkpoint_dirs import find_checkpoint
from spmd_grpo.telemetry.report import write_report
from spmd_grpo.tools.make_tiny_model import TinyModelSpec, cached_tiny_model

REPO = Path(__file__).resolve().parents[1]
TARGET = 0.8
WINDOW = 5
SMOKE_MODEL = TinyModelSpec(hidden_size=256, intermediate_size=512, num_attention_heads=4, head_logit_std=0.6)
"""The smoke task's model: wider than the tests' (64) with its head drawn so logits can move ~10 nats
(`make_tiny_model._draw_head`), so that LoRA, which leaves the head frozen, can learn the task as full
fine-tuning does; at width 64 no hidden state can make an answer digit more than ~2 % likely."""
SMOKE_MODELS: dict[str, TinyModelSpec] = {
    "qwen2_5_vl": SMOKE_MODEL,
    # Every layer sparse: 8 experts of width 96, top 2; head_dim 64.
    "qwen3_vl_moe": replace(SMOKE_MODEL, family="qwen3_vl_moe"),
    # One Gated DeltaNet layer (2 heads of 128, the only width vLLM's CPU kernel takes) and one full-attention
    # layer (head_dim 64, 16 of it rotating).
    "qwen3_5": replace(SMOKE_MODEL, family="qwen3_5"),
}
"""The tiny model each `--family` trains; all as wide as the smoke model, with its head draw."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--family", default="qwen2_5_vl", choices=sorted(SMOKE_MODELS))
    ap.add_argument("--config", default=None, help="default: configs/smoke.yaml, or smoke_<family>.yaml")
    ap.add_argument("--cache", default=str(REPO / ".cache"))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    args.config = args.config or str(smoke_config(args.family))
    start = time.monotonic()
    model_dir = cached_tiny_model(args.cache, SMOKE_MODELS[args.family])
    overrides = last_wins(
        [f"worker.actor.model.model_path={model_dir}", "trainer.resume=none", *args.overrides]
    )  # the user's win
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:  # one line naming the key, as the job itself would print it
        print(f"config error: {e}", file=sys.stderr)
        return 2
    shutil.rmtree(cfg.run_dir, ignore_errors=True)  # a new run: its own curve, no checkpoint to resume
    cmd = launch_command(args.nproc, args.config, overrides)
    print("+", " ".join(cmd), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen(cmd, env=env)
    metrics_path = cfg.run_dir / "metrics.jsonl"
    stopped = False
    while proc.poll() is None:
        time.sleep(1.0)
        learned = learned_at(read_rows(metrics_path))
        if learned is not None and not stopped:
            print(
                f"smoke: the mean reward of steps {learned - WINDOW + 1}-{learned} reached {TARGET}: stopping the "
                "run (SIGTERM; the ranks save the step they are in and exit)",
                flush=True,
            )
            proc.send_signal(signal.SIGTERM)
            stopped = True
    code = proc.wait()
    elapsed = time.monotonic() - start
    rows = read_rows(metrics_path)
    learned = learned_at(rows)
    if code != 0 and not stopped:
        print(f"smoke run failed with exit code {code} after {elapsed:.0f} s", file=sys.stderr)
        return code
    if code != 0 and not stopped_with_checkpoint(cfg.run_dir, rows, code):  # 0: it ended before the signal
        return 1
    code = report(rows, learned, cfg.trainer.max_steps, elapsed)
    png, _ = write_report(cfg.run_dir)
    print(f"curves: {png.resolve()}")
    return code


def launch_command(nproc: int, config: str, overrides: list[str]) -> list[str]:
    """The job on `nproc` local ranks (`spmd_grpo.launch`, a free port for the rendezvous)."""
    launch = [f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={free_port()}"]
    return [sys.executable, "-m", "spmd_grpo.launch", *launch, "-m", "spmd_grpo.train", config, *overrides]


def smoke_config(family: str) -> Path:
    """The smoke config of `family`: configs/smoke.yaml for the default family, smoke_<family>.yaml else."""
    return REPO / "configs" / ("smoke.yaml" if family == "qwen2_5_vl" else f"smoke_{family}.yaml")


def read_rows(metrics_path: Path) -> list[dict]:
    """The complete rows of metrics.jsonl so far (a row being written is left for the next read)."""
    if not metrics_path.exists():
        return []
    lines = metrics_path.read_text().split("\n")[:-1]  # after the last newline: a row not yet complete
    return [json.loads(line) for line in lines if line]


def score_key(train_rows: list[dict]) -> str:
    # With DAPO dynamic sampling the trained batch is filtered (only groups with spread): judge learning by
    # the score of everything generated instead.
    return "train/gen_score/mean" if "train/gen_score/mean" in train_rows[0] else "critic/score/mean"


def learned_at(rows: list[dict], window: int = WINDOW, target: float = TARGET) -> int | None:
    """The pass criterion: the first training step at which the mean reward of the `window` consecutive steps
    ending there is >= `target` (None while it is not met). Validation-only rows (step 0) do not count."""
    train = [r for r in rows if r["step"] > 0]
    if not train:
        return None
    scores = [r[score_key(train)] for r in train]
    for end in range(window, len(train) + 1):
        if sum(scores[end - window : end]) / window >= target:
            return train[end - 1]["step"]
    return None


def stopped_with_checkpoint(run_dir: Path, rows: list[dict], code: int) -> bool:
    """After the stop: the job exited with 128 + SIGTERM and the newest complete checkpoint is the last
    logged step (the ranks saved it on the signal). Prints what is wrong otherwise."""
    last = rows[-1]["step"]
    saved = find_checkpoint(run_dir, "auto")
    if code == 128 + signal.SIGTERM and saved is not None and saved.name == f"global_step_{last}":
        print(f"smoke: stopped after step {last}, checkpoint {saved}")
        return True
    print(
        f"smoke: FAIL: after SIGTERM the job exited {code} (expected {128 + signal.SIGTERM}) and the newest "
        f"complete checkpoint is {saved} (expected global_step_{last}, the last logged step)",
        file=sys.stderr,
    )
    return False


def report(rows: list[dict], learned: int | None, max_steps: int | None, elapsed: float) -> int:
    """Print the reward per step, the validation rows and the verdict; 0 when the task was learned."""
    train = [r for r in rows if r["step"] > 0]
    if not train:
        print("smoke: FAIL: no training step was logged", file=sys.stderr)
        return 1
    key = score_key(train)
    print(f"\n{'step':>5} {'score':>7} {'accuracy':>9} {'resp_len':>9} {'lp_diff_max':>12} {'s/step':>7}")
    every = max(1, len(train) // 20)
    for r in train:
        if r["step"] == 1 or r["step"] % every == 0 or r is train[-1]:
            print(
                f"{r['step']:>5} {r[key]:>7.3f} {r.get('reward/accuracy', float('nan')):>9.3f} "
                f"{r['response_length/mean']:>9.2f} {r['rollout/logprob_diff_max']:>12.1e} {r['timing_s/step']:>7.2f}"
            )
    val_rows = [r for r in rows if any(k.startswith("val-core/") for k in r)]
    if val_rows:
        print("\nvalidation (greedy-ish sampling, held-out colours):")
        for r in val_rows:
            print(
                f"{r['step']:>5} "
                + "  ".join(f"{k} {v:.3f}" for k, v in sorted(r.items()) if k.startswith("val-core/"))
            )
    first = sum(r[key] for r in train[:WINDOW]) / min(WINDOW, len(train))
    if learned is None:
        best = max(
            sum(r[key] for r in train[i : i + WINDOW]) / WINDOW
            for i in range(max(1, len(train) - WINDOW + 1))
        )
        verdict = f"not reached in {len(train)} steps (best {best:.3f}): FAIL"
    else:
        window = [r[key] for r in train if learned - WINDOW < r["step"] <= learned]
        verdict = f"reached at step {learned} ({sum(window) / WINDOW:.3f}): PASS"
    print(
        f"\nmean reward ({key}) of {WINDOW} consecutive steps >= {TARGET} within {max_steps} steps: "
        f"first {WINDOW} steps {first:.3f}, {verdict}; {len(train)} steps, wall time {elapsed:.0f} s"
    )
    return 0 if learned is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
