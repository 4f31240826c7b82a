"""The trainer passes of a geometry3k-shaped step with and without shared prompts (`worker.actor.shared_prompt`).

    python benchmarks/shared_prompt.py [--dtypes float32,bfloat16] [--prompts 2] [--n 8]
        [--response-length 128] [--image-side 644] [--rounds 2] [--threads 2] [--device cpu] [--out result.json]

Workload: the generated ~29M-parameter Qwen2.5-VL of benchmarks/step_throughput.py (no download), `--prompts`
prompts whose image gives most of a >= 512-token prompt (a 644 x 644 image: 529 image tokens, plus the
question) x `--n` samples of exactly `--response-length` random tokens, as geometry3k's GRPO recipe runs them:
trained vision tower, KL term with a reference model, rollout correction off, one mini-batch, old logprobs
from a separate pass, token-budget micro-batches (`dynamic_batching`, 8192 tokens for the update, 16384
for the forward-only passes: the same budgets with and without sharing). Timed: old logprobs
(`compute_logprobs`), reference logprobs (`compute_ref_logprobs`), the update (`update_policy`), one world-1
gloo process with `--threads` threads per setting and dtype (its own process, so that its peak RSS is its
own); the last of `--rounds` rounds (the first warms the allocator up and compiles). Printed per dtype: each
phase and their sum, shared / unshared, and the peak memory of each process: on the CPU its RSS
(`ru_maxrss`: the model, reference, optimizer and the passes' activations), with `--device cuda` the GPU
memory torch allocated at its peak (the passes as the trainer runs them there: FSDP2 on one GPU, shared
prompts through flex attention, nccl).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.step_throughput import MODEL_SPEC, RUN_CONTROL  # noqa: E402

PHASES = ["old_log_prob", "ref", "update_actor"]


def overrides(args: argparse.Namespace, model_dir: Path, dtype: str, shared: str) -> list[str]:
    return [
        f"worker.actor.model.model_path={model_dir}",
        f"worker.actor.fsdp.param_dtype={dtype}",
        f"worker.rollout.dtype={dtype}",
        f"worker.rollout.n={args.n}",
        f"data.rollout_batch_size={args.prompts}",
        f"data.max_response_length={args.response_length}",
        "data.max_prompt_length=1024",
        f"data.max_pixels={args.image_side**2}",
        f"worker.actor.global_batch_size={args.n * args.prompts}",
        "worker.actor.model.freeze_vision_tower=false",
        "worker.actor.old_logprobs_from_update=false",
        "worker.actor.dynamic_batching=true",
        "worker.actor.max_token_len_per_device_for_update=8192",
        "worker.actor.max_token_len_per_device_for_experience=16384",
        "algorithm.use_kl_loss=true",
        f"worker.actor.shared_prompt={shared}",
        f"trainer.device={args.device}",
        *RUN_CONTROL,
    ]


def samples_for(processor, args: argparse.Namespace) -> list:
    """`--prompts` geometry-like prompts (one image, a question) x `--n` random responses."""
    import torch
    from PIL import Image, ImageDraw

    from spmd_grpo.data.samples import Prompt, Sample

    gen = torch.Generator().manual_seed(0)
    question = "Find the measure of angle ABC in the figure. Give the answer in degrees."
    content = [{"type": "image"}, {"type": "text", "text": question}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    samples = []
    for p in range(args.prompts):
        image = Image.new("RGB", (args.image_side, args.image_side), (255, 255, 255))
        ImageDraw.Draw(image).polygon([(40 + 20 * p, 600), (320, 60), (600, 600)], outline=(0, 0, 0))
        enc = processor(text=[text], images=[image], return_tensors="pt")
        prompt = Prompt(p, [], [image])
        for i in range(args.n):
            response = torch.randint(0, 256, (args.response_length,), generator=gen).tolist()
            s = Sample(prompt, i, enc["input_ids"][0].tolist(), response, [0.0] * args.response_length)
            s.pixel_values, s.image_grid_thw = enc["pixel_values"], enc["image_grid_thw"]
            s.advantage = float(torch.randn((), generator=gen))
            samples.append(s)
    return samples


def child(args: argparse.Namespace, model_dir: Path) -> dict:
    """One setting in this process: the phases' times of the last round, and the peak RSS."""
    import torch
    from transformers import AutoProcessor

    from spmd_grpo.actor.logprob_pass import compute_logprobs, compute_ref_logprobs
    from spmd_grpo.actor.optimizer import build_optimizer
    from spmd_grpo.actor.spec import UpdateSpec
    from spmd_grpo.actor.update import update_policy
    from spmd_grpo.config.loader import load_config
    from spmd_grpo.models.build import build_policy, build_reference
    from spmd_grpo.models.families import family_of
    from spmd_grpo.parallel.collectives import init_distributed
    from spmd_grpo.parallel.devices import max_memory_allocated_gb, synchronize

    dtype, shared = args.child.split(":")
    torch.set_num_threads(args.threads)
    cfg = load_config(REPO / "configs" / "smoke.yaml", overrides(args, model_dir, dtype, shared))
    world = init_distributed(args.device)
    cuda = world.device_type == "cuda"

    def clock() -> float:  # after the device's queued work
        synchronize(world.device_type)
        return time.perf_counter()

    torch.manual_seed(0)
    policy = build_policy(cfg.worker.actor, world)
    reference = build_reference(cfg.worker.actor, cfg.worker.ref, world)
    optim = build_optimizer(policy, cfg.worker.actor.optim, total_steps=100)
    # as the trainer builds it: data.min_pixels / data.max_pixels as the processor's size
    processor = AutoProcessor.from_pretrained(
        model_dir, size={"shortest_edge": cfg.data.min_pixels, "longest_edge": cfg.data.max_pixels}
    )
    spec = UpdateSpec.from_config(
        cfg, world_size=1, pad_token_id=processor.tokenizer.pad_token_id, family=family_of(policy.config)
    )
    samples = samples_for(processor, args)
    built_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    times = {}
    for _ in range(args.rounds):
        start = clock()
        for s, lp in zip(samples, compute_logprobs(policy, samples, spec), strict=True):
            s.old_logprobs = lp
        times["old_log_prob"] = clock() - start
        start = clock()
        for s, lp in zip(samples, compute_ref_logprobs(reference, policy, samples, spec), strict=True):
            s.ref_logprobs = lp
        times["ref"] = clock() - start
        start = clock()
        metrics = update_policy(policy, optim, samples, spec, world)
        times["update_actor"] = clock() - start
    return {
        **times,
        "shared_on": bool(policy.shared_prompt),
        "tokens_saved": metrics["perf/shared_prompt_tokens_saved"],
        "prompt_tokens": len(samples[0].prompt_ids),
        "image_tokens": int(samples[0].image_grid_thw.prod().item() // 4),
        "built_rss_gib": built_rss,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "peak_gpu_gib": max_memory_allocated_gb(world.device_type) if cuda else None,
    }


def run_child(args: argparse.Namespace, model_dir: Path, dtype: str, shared: str, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(29700 + os.getpid() % 200), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}  # fmt: skip
    cmd = [sys.executable, __file__, "--child", f"{dtype}:{shared}", "--out", str(out), "--prompts",
           str(args.prompts), "--n", str(args.n), "--response-length", str(args.response_length),
           "--image-side", str(args.image_side), "--rounds", str(args.rounds), "--threads", str(args.threads),
           "--device", args.device]  # fmt: skip
    print(f"{dtype} shared_prompt={shared} ...", end=" ", flush=True)  # where a slow device run is
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"{dtype} shared={shared} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    print(f"{time.perf_counter() - start:.0f} s", flush=True)
    return json.loads(out.read_text())


def check_configs(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The config of every setting as the children load it (they call no trainer, so not `validate`), before
    anything is built: an argument the config refuses stops here in one line, not in a child's traceback."""
    from spmd_grpo.config.checks import ConfigError
    from spmd_grpo.config.loader import load_config

    for dtype in args.dtypes.split(","):
        for shared in ("false", "true"):
            try:
                load_config(REPO / "configs" / "smoke.yaml", overrides(args, Path("unbuilt"), dtype, shared))
            except (ConfigError, ValueError) as e:
                hint = " (--image-side S sets data.max_pixels to S * S)" if "pixels" in str(e) else ""
                ap.error(f"the config these arguments give: {e}{hint}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--response-length", type=int, default=128)
    ap.add_argument("--image-side", type=int, default=644)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    from spmd_grpo.tools.make_tiny_model import TinyModelSpec, cached_tiny_model

    if not args.child:
        check_configs(ap, args)
    model_dir = cached_tiny_model(REPO / ".cache" / "bench_tput_model", TinyModelSpec(**MODEL_SPEC))
    if args.child:
        args.out.write_text(json.dumps(child(args, model_dir)))
        return
    results, work = {}, Path(os.environ.get("TMPDIR", "/tmp"))
    for dtype in args.dtypes.split(","):
        for shared in ("false", "true"):
            results[f"{dtype}:{shared}"] = run_child(
                args, model_dir, dtype, shared, work / f"sp_{dtype}_{shared}.json"
            )
    print_report(results, args)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


def print_report(results: dict, args: argparse.Namespace) -> None:
    first = next(iter(results.values()))
    print(f"workload: {args.prompts} prompts of {first['prompt_tokens']} tokens ({first['image_tokens']} image "
          f"tokens) x {args.n} samples x {args.response_length} response tokens; trained tower, KL with a reference "
          f"model; 1 process x {args.threads} threads on {args.device}; last of {args.rounds} rounds")  # fmt: skip
    peak = "peak_gpu_gib" if args.device == "cuda" else "peak_rss_gib"
    label = "peak GPU memory" if args.device == "cuda" else "peak RSS"
    print(f"| dtype | shared_prompt | old (s) | ref (s) | update (s) | old + ref + update (s) | {label} (GiB) | tokens saved (update) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for key, r in results.items():
        dtype, shared = key.split(":")
        total = sum(r[p] for p in PHASES)
        print(f"| {dtype} | {shared} | {r['old_log_prob']:.2f} | {r['ref']:.2f} | {r['update_actor']:.2f} | "
              f"{total:.2f} | {r[peak]:.2f} | {r['tokens_saved']:.0f} |")  # fmt: skip
    for dtype in args.dtypes.split(","):
        off, on = results[f"{dtype}:false"], results[f"{dtype}:true"]
        speedup = sum(off[p] for p in PHASES) / sum(on[p] for p in PHASES)
        print(f"{dtype}: old + ref + update {speedup:.2f}x faster with shared prompts; {label} "
              f"{off[peak]:.2f} -> {on[peak]:.2f} GiB")  # fmt: skip
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
