"""Tokens/s/GPU of a Qwen3-VL-30B-A3B GRPO step: the shipped config, the real entry point under torchrun.

    # 8 GPUs, the published checkpoint (from the hub or the local HF cache) and the config's data:
    python benchmarks/moe_step_throughput.py [--nproc 8] [--steps 3] [--set KEY=VALUE ...] [--out result.json]
    # on the CPU: 2 ranks, a tiny random Qwen3-VL-MoE (built once into .cache/), the built-in colour task:
    python benchmarks/moe_step_throughput.py --tiny [--steps 3]

Runs `torchrun --nproc_per_node N -m spmd_grpo.train configs/qwen3_vl_30b_a3b_geo3k_grpo.yaml` for `--steps`
steps as the file says, with run control only (`RUN_CONTROL`: no validation, no checkpoints, jsonl metrics, a
fresh start), and prints the means over the steps after the first (which builds vLLM's CUDA graphs and warms
the allocator): tokens/s/GPU (`perf/throughput`, verl's definition: the step's prompt + response tokens over
step time x devices), the step time and its phases (generation, weight sync, old and reference logprobs,
update), and the mean response length. `--set` adds overrides (e.g. `worker.actor.fsdp.expert_parallel_size=8`
to compare expert parallelism against plain FSDP on the same machine). Without `--tiny` it stops before
torchrun unless it sees a GPU or NPU per rank.

`--tiny` keeps the config too, and swaps only what cannot exist on a CPU machine or would take hours
(`TINY`): the model (a tiny random Qwen3-VL-MoE of `spmd_grpo/tools/make_tiny_model.py`), the data (the
built-in colour task: the same schema and prompt template; the random model earns no math reward, which
leaves the amount of work unchanged), the sizes (4 prompts of 5 samples, responses of at most 64 tokens,
small images), vLLM's TP (1) and CUDA graphs (off: vLLM CPU would compile for minutes), and the device.
Its figure measures nothing about the 30B model: it keeps the script and the config working (the command
lines are checked by the unit tests, `summarise` reads the metrics of the shipped-config engine test).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CONFIG = REPO / "configs" / "qwen3_vl_30b_a3b_geo3k_grpo.yaml"

RUN_CONTROL = [
    "trainer.val_before_train=false",
    "trainer.val_freq=-1",
    "trainer.save_freq=-1",
    "trainer.logger=[jsonl]",
    "trainer.resume=none",
    "trainer.experiment_name=moe_step_throughput",
]
TINY = [
    "data.train_files=builtin:color",
    "data.val_files=builtin:color",
    "data.num_builtin_examples=64",
    "data.rollout_batch_size=4",
    "data.max_prompt_length=256",
    "data.max_response_length=64",
    "data.min_pixels=3136",
    "data.max_pixels=12544",
    "worker.actor.global_batch_size=4",
    "worker.actor.micro_batch_size_per_device_for_update=2",
    "worker.actor.micro_batch_size_per_device_for_experience=4",
    "worker.rollout.tensor_parallel_size=1",
    "worker.rollout.enforce_eager=true",
    "trainer.device=cpu",
]
# `gen` includes `update_weights` (the trainer times the push inside its generation phase)
PHASES = ["gen", "update_weights", "reward", "old_log_prob", "ref", "update_actor"]


def tiny_moe_model() -> Path:
    """The tiny random Qwen3-VL-MoE, built on first use into .cache/ (no download)."""
    from spmd_grpo.tools.make_tiny_model import TinyModelSpec, cached_tiny_model

    return cached_tiny_model(REPO / ".cache" / "bench_moe_model", TinyModelSpec(family="qwen3_vl_moe"))


def overrides(
    *, tiny: bool, steps: int, output_dir: Path, model_path: str | None = None, extra=()
) -> list[str]:
    """The config overrides of one benchmark run (later ones win)."""
    from spmd_grpo.config.loader import last_wins

    swapped = [*TINY, f"worker.actor.model.model_path={model_path}"] if tiny else []
    return last_wins(
        [*RUN_CONTROL, *swapped, f"trainer.max_steps={steps}", f"trainer.output_dir={output_dir}", *extra]
    )


def command(nproc: int, run_overrides: list[str]) -> list[str]:
    """torchrun on one node (`spmd_grpo.launch`: torchrun that checks the config once before any rank starts,
    so a config error is its one line, not the tail of torchrun's failure report): `nproc` ranks of
    `spmd_grpo.train` on the shipped config."""
    return [sys.executable, "-m", "spmd_grpo.launch", "--standalone", "--nproc_per_node", str(nproc),
            "-m", "spmd_grpo.train", str(CONFIG), *run_overrides]  # fmt: skip


def check_devices(nproc: int) -> None:
    """The 30B run needs an accelerator per rank: stop before torchrun where there are too few (on a CPU
    machine the shipped config would start `nproc` ranks of the 30B model on the host)."""
    from spmd_grpo.parallel.devices import device_module, resolve_device_type

    device_type = resolve_device_type("auto")
    found = device_module(device_type).device_count() if device_type != "cpu" else 0
    if found < nproc:
        raise SystemExit(
            f"moe_step_throughput: {nproc} ranks need {nproc} GPUs or NPUs, found {found} (device type "
            f"{device_type}); on a CPU machine run --tiny"
        )


def summarise(rows: list[dict]) -> dict[str, float]:
    """Means over the training steps after the first (all of them when there is one): tokens/s/GPU, the step
    time and its phases in seconds, the mean response length."""
    steps = [r for r in rows if r.get("step", 0) > 0]
    later = steps[1:] or steps
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in later)  # noqa: E731
    return {
        "tokens_per_s_per_gpu": mean("perf/throughput"),
        "step_s": mean("timing_s/step"),
        **{f"{p}_s": mean(f"timing_s/{p}") for p in PHASES},
        "tokens_per_step": mean("perf/total_num_tokens"),
        "response_length_mean": mean("response_length/mean"),
        "steps_averaged": len(later),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU, 2 ranks, the tiny random Qwen3-VL-MoE")
    p.add_argument("--nproc", type=int, default=None, help="ranks (default 8; 2 with --tiny)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    nproc = args.nproc or (2 if args.tiny else 8)
    if not args.tiny:
        check_devices(nproc)
    with tempfile.TemporaryDirectory(prefix="moe_tput_") as work:
        model = str(tiny_moe_model()) if args.tiny else None
        run = overrides(
            tiny=args.tiny, steps=args.steps, output_dir=Path(work), model_path=model, extra=args.set
        )
        cmd = command(nproc, run)
        threads = (
            str(max(1, (os.cpu_count() or 2) // nproc))
            if args.tiny
            else os.environ.get("OMP_NUM_THREADS", "8")
        )
        env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONPATH": str(REPO)}
        print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"the run failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
        metrics = Path(work) / "moe_step_throughput" / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    s = summarise(rows)
    phases = ", ".join(f"{p} {s[f'{p}_s']:.2f}" for p in PHASES if p not in ("gen", "update_weights"))
    print(
        f"{'tiny Qwen3-VL-MoE (CPU)' if args.tiny else 'Qwen3-VL-30B-A3B'}, {nproc} ranks, {args.steps} steps "
        f"(mean of the last {s['steps_averaged']}): {s['tokens_per_s_per_gpu']:.1f} tokens/s/GPU, step "
        f"{s['step_s']:.2f} s (gen {s['gen_s']:.2f} including update_weights {s['update_weights_s']:.2f}, "
        f"{phases}), "
        f"{s['tokens_per_step']:.0f} tokens per step, mean response {s['response_length_mean']:.1f} tokens"
    )
    if args.out:
        args.out.write_text(json.dumps({"nproc": nproc, "tiny": args.tiny, "overrides": run, **s}, indent=1))


if __name__ == "__main__":
    main()
