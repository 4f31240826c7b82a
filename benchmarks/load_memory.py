"""Peak host memory of building the policy and the reference model (`build_policy` + `build_reference`).

    OMP_NUM_THREADS=1 torchrun --nproc_per_node W benchmarks/load_memory.py \
        [--model-dir D] [--param-dtype bfloat16] [--baseline] [--engine] [--data] [--out result.json]

Without --model-dir a random Qwen2.5-VL of 211M parameters (hidden 1024, intermediate 4096, 12 layers, 16
heads, 4 KV heads, vision width 512 and depth 8, vocabulary 512; 806.7 MiB in fp32) is built from config (no
download) into .cache/bench_load_model by rank 0, or reused from there.

What runs, per rank: the policy (fp32 master weights) and the reference (worker.ref.dtype=auto: the resolved
`--param-dtype`), as the trainer builds them: on the meta device, `fully_shard`, then every rank reads its
own rows of the safetensors. `--baseline` builds them the way this project did before: every rank
`from_pretrained(fp32).to(device)` for each model, then `fully_shard` (the reference stays fp32 on CPU).
`--stock-reader` builds them the new way but reads with torch's `HuggingFaceStorageReader`, which
memory-maps each file (the evidence for `spmd_grpo.models.weights.SliceReader`).

Measured, OS level: gc + `malloc_trim(0)`, read VmRSS, reset VmHWM (`/proc/self/clear_refs`), build; the
peak is VmHWM minus that VmRSS (it counts the pages of memory-mapped checkpoint files a rank touched, which
are resident while mapped). `policy` is the peak while the policy was built, `total` the peak over both
builds, `kept` the VmRSS after both minus before. `live_heap` is glibc's in-use heap sampled every ~1 ms
(memtools.HeapSampler): allocations only, no file mappings. Every figure is printed in MiB and as a multiple
of the model's fp32 size; `ideal` is what the shards alone weigh on a rank (fp32 policy shard + reference
shard). `--engine` then builds the rollout engine (vLLM, dummy weights) and pushes the policy into it: its
peak adds vLLM's own weights and its KV cache (1 GiB here) to the models'. `--data` then runs
benchmarks/data_memory.py (the data pipeline at 2k and 20k rows, fresh processes). Rank 0 prints one table
and, with --out, writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # memtools.py sits beside this script
from memtools import HeapSampler, MiB, ensure_model, proc_mem, release_free_memory, reset_peak_rss  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = REPO / ".cache" / "bench_load_model"
ENGINES: list = []
# head_dim 64 (vLLM CPU attention needs 32 or 64, so the same model serves engine benchmarks).
BENCH_SPEC = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=4,
    vision_hidden_size=512,
    vision_depth=8,
    vision_num_heads=8,
)


def baseline_builders(actor, world):
    """The previous way: a full fp32 `from_pretrained` per model on every rank, moved, then sharded (the
    reference was cast to its compute dtype before sharding only on NPU, so it is fp32 here)."""
    from transformers import AutoModelForImageTextToText

    from spmd_grpo.models.build import shard_model
    from spmd_grpo.models.policy import PolicyModule, unsamplable_token_ids

    def load() -> PolicyModule:
        hf = AutoModelForImageTextToText.from_pretrained(
            actor.model.model_path, dtype=torch.float32, attn_implementation="sdpa", device_map=None
        ).to(world.device)
        return PolicyModule(hf, unsamplable_token_ids(hf.config), actor.logprob_chunk_size)

    def policy():
        return shard_model(load(), actor.fsdp, world)

    def reference():
        return shard_model(load().requires_grad_(False), actor.fsdp, world)

    return policy, reference


def builders(actor, world):
    """What the trainer calls: meta device, `fully_shard`, each rank reading its rows."""
    from spmd_grpo.config.workers import RefConfig
    from spmd_grpo.models.build import build_policy, build_reference

    return (lambda: build_policy(actor, world)), (lambda: build_reference(actor, RefConfig(), world))


def build_engine(actor, world, policy):
    """The rollout engine as the trainer builds it (vLLM with dummy weights, fp32 on CPU, 1 GiB KV cache),
    then its first weight push (every weight, from the sharded policy)."""
    from transformers import AutoProcessor

    from spmd_grpo.config.loader import load_config
    from spmd_grpo.data.prompts import processor_sizes
    from spmd_grpo.rollout.engine import RolloutEngine

    cfg = load_config(None, [
        f"worker.actor.model.model_path={actor.model.model_path}", "worker.rollout.dtype=float32",
        "worker.rollout.kv_cache_memory_gb=1.0", "worker.rollout.weight_sync_bucket_mb=64", "trainer.seed=0",
    ])  # fmt: skip
    processor = AutoProcessor.from_pretrained(actor.model.model_path)
    sizes = processor_sizes(cfg.data, processor, cfg.worker.rollout.limit_videos)
    tied = bool(policy.config.tie_word_embeddings)
    engine = RolloutEngine.from_config(cfg, world, tie_word_embeddings=tied, sizes=sizes)
    with engine.rollout_mode(policy, 0):
        pass
    return engine


def measure(actor, world, baseline: bool, with_engine: bool = False) -> dict:
    """Build policy then reference (then the engine) under the OS and heap probes; bytes and seconds."""
    import transformers.models.qwen2_5_vl.modeling_qwen2_5_vl  # noqa: F401  code, not model: not measured

    build_policy, build_reference = (baseline_builders if baseline else builders)(actor, world)
    release_free_memory()
    before = proc_mem()["VmRSS"]
    reset_peak_rss()
    t0 = time.perf_counter()
    with HeapSampler(where="policy") as heap:
        policy = build_policy()
        policy_peak = proc_mem()["VmHWM"] - before
        heap.where = "reference"
        reference = build_reference()
        models_peak = proc_mem()["VmHWM"] - before
    seconds = time.perf_counter() - t0
    kept = proc_mem()["VmRSS"] - before  # the models' columns stop here: the engine has its own line
    if with_engine:
        ENGINES.append(build_engine(actor, world, policy))  # shut down last: it ends the process group
    held = sum(p.to_local().numel() * p.element_size() for m in (policy, reference) for p in m.parameters())
    return {
        "rank": world.rank,
        "rss_before": before,
        "policy": policy_peak,
        "total": models_peak,
        "with_engine": proc_mem()["VmHWM"] - before if with_engine else None,
        "kept": kept,
        "live_heap": heap.peak_extra,
        "live_heap_at": heap.peak_at,
        "shards": held,
        "ref_dtype": str(next(reference.parameters()).dtype).removeprefix("torch."),
        "seconds": seconds,
    }


def table(rows: list[dict], fp32_bytes: int, args, world_size: int) -> str:
    def cell(v):
        return f"{v / MiB:9.1f} {v / fp32_bytes:5.2f}x"

    mode = "meta + DCP, " + (
        "HuggingFaceStorageReader (mmap)" if args.stock_reader else "SliceReader (pread)"
    )
    if args.baseline:
        mode = "baseline: from_pretrained(fp32).to(device) + fully_shard"
    lines = [
        f"load_memory | {mode} | world {world_size} | fsdp.param_dtype {args.param_dtype} | "
        f"reference {rows[0]['ref_dtype']}",
        f"model: {args.num_params:,} params = {fp32_bytes / MiB:.1f} MiB in fp32 ({args.model_dir})",
        "[MiB and multiple of the fp32 model; peaks are over the RSS before building]",
        f"{'rank':>4} {'rss_before':>10} {'policy':>16} {'total':>16} {'kept':>16} {'live_heap':>16} "
        f"{'shards':>16} {'time_s':>7}",
    ]
    for r in rows:
        lines.append(
            f"{r['rank']:>4} {r['rss_before'] / MiB:10.1f} {cell(r['policy'])} {cell(r['total'])} "
            f"{cell(r['kept'])} {cell(r['live_heap'])} {cell(r['shards'])} {r['seconds']:7.1f}"
        )
    if rows[0]["with_engine"] is not None:
        lines.append(
            "with the engine (vLLM, dummy weights, 1 GiB KV cache, first push of every weight): peak "
            + ", ".join(f"rank {r['rank']} {cell(r['with_engine'])}" for r in rows)
        )
    worst = max(rows, key=lambda r: r["total"])
    lines.append(
        f"max: total {worst['total'] / MiB:.1f} MiB = {worst['total'] / fp32_bytes:.2f} x the fp32 model "
        f"(rank {worst['rank']}); live heap peak while building the {worst['live_heap_at']}"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=None, help=f"default: build/reuse {DEFAULT_MODEL_DIR}")
    ap.add_argument("--param-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--baseline", action="store_true", help="build the previous way (full model per rank)")
    ap.add_argument(
        "--stock-reader",
        action="store_true",
        help="read with torch's HuggingFaceStorageReader (memory-maps the files) instead of SliceReader",
    )
    ap.add_argument("--engine", action="store_true", help="also build the vLLM engine and push the weights")
    ap.add_argument(
        "--data", action="store_true", help="then run benchmarks/data_memory.py for 2k and 20k rows (rank 0)"
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from safetensors import safe_open

    from spmd_grpo.config.workers import ActorConfig, FSDPConfig, ModelConfig
    from spmd_grpo.models.weights import weight_files
    from spmd_grpo.parallel.collectives import all_gather_objects, init_distributed

    world = init_distributed("cpu")
    if args.stock_reader:
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        import spmd_grpo.models.weights

        spmd_grpo.models.weights.SliceReader = HuggingFaceStorageReader
    args.model_dir = (args.model_dir or DEFAULT_MODEL_DIR).resolve()
    if args.model_dir == DEFAULT_MODEL_DIR.resolve():
        ensure_model(args.model_dir, BENCH_SPEC, world.rank)
    args.num_params = 0
    for path in weight_files(args.model_dir):
        with safe_open(path, framework="pt") as f:
            names = f.keys()
            args.num_params += sum(math.prod(f.get_slice(k).get_shape()) for k in names)
    fsdp = FSDPConfig(param_dtype=args.param_dtype)
    actor = ActorConfig(model=ModelConfig(model_path=str(args.model_dir)), fsdp=fsdp)
    rows = all_gather_objects(measure(actor, world, args.baseline, args.engine))
    if world.rank == 0:
        print(table(rows, 4 * args.num_params, args, world.world_size), flush=True)
        if args.out is not None:
            settings = {k: v if isinstance(v, int | bool) else str(v) for k, v in vars(args).items()}
            args.out.write_text(json.dumps({"args": settings, "rows": rows}, indent=1) + "\n")
        if args.data:
            import data_memory

            sizes = [2000, 20000]
            print(data_memory.report(data_memory.run_benchmark(sizes), sizes, 16), flush=True)
    dist.barrier()
    for engine in ENGINES:
        engine.shutdown()  # vLLM's teardown destroys the default process group too
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
