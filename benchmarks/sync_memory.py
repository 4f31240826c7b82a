"""Peak extra memory of one trainer -> vLLM weight push (FSDP2 shards -> `RolloutEngine.load_weights`).

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 benchmarks/sync_memory.py \
        [--model-dir D] [--bucket-mb 64] [--dtype bfloat16] [--pushes 3] [--out result.json]

Without --model-dir a random Qwen2.5-VL of ~136M parameters is built from config (no download) into
.cache/bench_model_100m, or reused from there. Each rank holds the FSDP2 policy (fp32 masters) and its own
in-process vLLM engine (tensor_parallel_size 1). Every push perturbs the masters (a new policy version), then
streams them with `iter_sharded_weights` (cast to the rollout dtype before the all-gather) into the engine.

Per push and rank, three measurements:
  peak_extra_os     OS level: `5` -> /proc/self/clear_refs resets VmHWM to VmRSS right before the push
                    (after gc + malloc_trim, so freed heap pages do not hide allocations);
                    peak extra = VmHWM after - VmRSS before.
  largest_bucket    `on_bucket` of `iter_sharded_weights`: the largest gathered (receive) buffer.
  live_yielded_peak diagnostic: the most bytes of yielded tensors still alive at a yield (i.e. held by
                    the consumer, vLLM's layerwise reload buffers), tracked with storage weak references.
A greedy generation of two short text prompts runs before the first and after the last push (token counts).
Rank 0 prints one table and writes it as JSON to --out.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = REPO / ".cache" / "bench_model_100m"
# head_dim 64 (vLLM CPU attention needs 32 or 64); the vocabulary is tiny, so the width/depth carry the size.
BENCH_SPEC = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=4,
    vision_hidden_size=256,
    vision_depth=4,
    vision_num_heads=4,
    vocab_merges=200,
)
PROMPTS = [
    "Which color is the image? Answer with a digit.",
    "Find the area of the triangle. Round to the nearest tenth.",
]
MiB = 1 << 20

_LIBC = ctypes.CDLL("libc.so.6")


# ------------------------------------------------------------------------------------------ helpers
def proc_mem() -> dict[str, int]:
    """VmRSS / VmHWM of this process in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(line.split()[1]) * 1024
    return out


def reset_peak_rss() -> None:
    """Reset VmHWM to the current VmRSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def release_free_memory() -> None:
    """Drop garbage and give free heap pages back to the OS, so VmRSS is the live memory."""
    gc.collect()
    _LIBC.malloc_trim(0)


class LiveYielded:
    """Bytes of yielded tensors (by storage) that are still referenced somewhere, sampled at each yield."""

    def __init__(self) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref = StorageWeakRef
        self.alive: dict[int, tuple[object, int]] = {}  # storage ptr -> (weak ref, bytes)
        self.peak = 0
        self.peak_at = ""

    def wrap(self, it: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in it:
            self.alive = {k: v for k, v in self.alive.items() if not v[0].expired()}
            storage = t.untyped_storage()
            self.alive.setdefault(storage.data_ptr(), (self._ref(storage), storage.nbytes()))
            del storage
            live = sum(b for _, b in self.alive.values())
            if live > self.peak:
                self.peak, self.peak_at = live, name
            yield name, t
            del t


def ensure_model(model_dir: Path, rank: int) -> None:
    """Rank 0 builds the random model once (atomic rename); the other ranks wait."""
    if rank == 0 and not (model_dir / "model.safetensors").exists():
        from spmd_grpo.tools.make_tiny_model import TinyModelSpec, make_tiny_model

        tmp = model_dir.with_name(model_dir.name + f".tmp{os.getpid()}")
        t0 = time.perf_counter()
        make_tiny_model(tmp, TinyModelSpec(**BENCH_SPEC))
        if model_dir.exists():
            shutil.rmtree(model_dir)
        tmp.replace(model_dir)
        print(f"[sync_memory] built {model_dir} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    dist.barrier()


def vllm_model(engine) -> torch.nn.Module | None:
    try:
        return engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    except AttributeError:
        return None


def greedy_tokens(engine, max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=0)
    outs = engine.generate(PROMPTS, [sp] * len(PROMPTS))
    return [list(o.outputs[0].token_ids) for o in outs]


@torch.no_grad()
def perturb_masters(policy: torch.nn.Module, version: int, rank: int) -> None:
    """A new policy version: small deterministic noise on every local fp32 shard."""
    gen = torch.Generator().manual_seed(1000 * version + rank)
    for p in policy.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        local.add_(torch.randn(local.shape, generator=gen, dtype=local.dtype), alpha=1e-3)


# --------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=None, help=f"default: build/reuse {DEFAULT_MODEL_DIR}")
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--pushes", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from spmd_grpo.config import ActorConfig, FSDPConfig, ModelConfig, RolloutConfig
    from spmd_grpo.distributed import init_distributed
    from spmd_grpo.engine import RolloutEngine, iter_sharded_weights
    from spmd_grpo.model import DTYPES, build_policy

    world = init_distributed("cpu")
    model_dir = (args.model_dir or DEFAULT_MODEL_DIR).resolve()
    if args.model_dir is None:
        ensure_model(model_dir, world.rank)
    dtype = DTYPES[args.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    bucket_bytes = args.bucket_mb * MiB

    actor = ActorConfig(model=ModelConfig(model_path=str(model_dir)), fsdp=FSDPConfig(param_dtype="float32"))
    policy = build_policy(actor, world)
    tie = bool(policy.config.tie_word_embeddings)
    engine = RolloutEngine(
        str(model_dir),
        RolloutConfig(dtype=args.dtype, weight_sync_bucket_mb=args.bucket_mb),
        world,
        max_model_len=1024,
        dtype=dtype,
        min_pixels=3136,
        max_pixels=262144,
        seed=0,
        tie_word_embeddings=tie,
    )

    # Sizes, from the global (unsharded) shapes; what a push streams (lm_head twice-counted only if tied).
    shapes = {n: tuple(p.shape) for n, p in policy.named_parameters()}
    num_params = sum(torch.Size(s).numel() for s in shapes.values())
    model_bytes = num_params * itemsize
    largest_name, largest_shape = max(shapes.items(), key=lambda kv: torch.Size(kv[1]).numel())
    largest_tensor_bytes = torch.Size(largest_shape).numel() * itemsize
    vm = vllm_model(engine)
    vllm_largest = ("?", 0)
    if vm is not None:
        # vLLM fuses q/k/v and gate/up; on CPU linear weights live in oneDNN handles (weight -> empty).
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        metas = []
        for mod_name, mod in vm.named_modules():
            restore_params = get_layerwise_info(mod).restore_metadata[0]
            metas += [(f"{mod_name}.{n}", t.numel() * t.element_size()) for n, t in restore_params.items()]
        if metas:
            vllm_largest = max(metas, key=lambda kv: kv[1])

    # Generation before any push.
    before = greedy_tokens(engine, args.max_tokens)

    pushes = []
    for i in range(args.pushes):
        version = i + 1
        perturb_masters(policy, version, world.rank)
        buckets: list[int] = []
        live = LiveYielded()
        release_free_memory()
        dist.barrier()
        rss_before = proc_mem()["VmRSS"]
        reset_peak_rss()
        t0 = time.perf_counter()
        engine.load_weights(
            live.wrap(
                iter_sharded_weights(
                    policy, dtype, bucket_bytes, tie_word_embeddings=tie, on_bucket=buckets.append
                )
            ),
            version=version,
        )
        push_s = time.perf_counter() - t0
        mem = proc_mem()
        pushes.append(
            {
                "version": version,
                "push_s": push_s,
                "rss_before": rss_before,
                "hwm_after": mem["VmHWM"],
                "rss_after": mem["VmRSS"],
                "peak_extra_os": mem["VmHWM"] - rss_before,
                "num_buckets": len(buckets),
                "largest_bucket": max(buckets, default=0),
                "live_yielded_peak": live.peak,
                "live_yielded_peak_at": live.peak_at,
                "pushed_bytes": engine.stats.last_sync_bytes,
            }
        )
        dist.barrier()

    after = greedy_tokens(engine, args.max_tokens)

    # Integrity: vLLM's embedding (kept as a plain weight on CPU) equals the policy's, cast to the rollout dtype.
    embed_match = None
    hf_embed = next(p for n, p in policy.named_parameters() if n.endswith("embed_tokens.weight"))
    full = hf_embed.full_tensor() if hasattr(hf_embed, "full_tensor") else hf_embed
    if vm is not None:
        v_embed = next((p for n, p in vm.named_parameters() if n.endswith("embed_tokens.weight")), None)
        if v_embed is not None and tuple(v_embed.shape) == tuple(full.shape):
            embed_match = bool(torch.equal(v_embed.detach(), full.detach().to(dtype)))

    rank_result = {
        "rank": world.rank,
        "pushes": pushes,
        "gen_tokens_before": sum(map(len, before)),
        "gen_tokens_after": sum(map(len, after)),
        "gen_changed_after_push": before != after,
        "embed_equal_after_push": embed_match,
        "rss_end": proc_mem()["VmRSS"],
    }
    gathered: list[dict] = [None] * world.world_size  # type: ignore[list-item]
    dist.all_gather_object(gathered, rank_result)

    if world.is_main:
        all_pushes = [p for r in gathered for p in r["pushes"]]
        peak_os = max(p["peak_extra_os"] for p in all_pushes)
        peak_bucket = max(p["largest_bucket"] for p in all_pushes)
        peak_live = max(p["live_yielded_peak"] for p in all_pushes)
        summary = {
            "machine": f"{os.cpu_count()}-core CPU, {world.backend}, {world.world_size} ranks, vLLM TP 1",
            "model_dir": str(model_dir),
            "rollout_dtype": args.dtype,
            "bucket_mb": args.bucket_mb,
            "num_params": num_params,
            "model_bytes": model_bytes,
            "largest_tensor": largest_name,
            "largest_tensor_bytes": largest_tensor_bytes,
            "vllm_largest_param": vllm_largest[0],
            "vllm_largest_param_bytes": vllm_largest[1],
            "target_bytes": peak_bucket + largest_tensor_bytes,
            "max_peak_extra_os": peak_os,
            "max_largest_bucket": peak_bucket,
            "max_live_yielded": peak_live,
            "ratio_peak_extra_os_to_model": peak_os / model_bytes,
            "ratio_peak_extra_os_to_target": peak_os / (peak_bucket + largest_tensor_bytes),
            "max_push_s": max(p["push_s"] for p in all_pushes),
            "ranks": gathered,
        }
        print_table(summary)
        if args.out is not None:
            args.out.write_text(json.dumps(summary, indent=1))
    dist.barrier()  # no destroy_process_group: vLLM's shutdown hook tears its groups down at exit


def print_table(s: dict) -> None:
    def mib(b: int) -> str:
        return f"{b / MiB:8.1f}"

    lines = [
        f"sync_memory | {s['machine']} | rollout dtype {s['rollout_dtype']} | bucket {s['bucket_mb']} MiB",
        f"model: {s['num_params']:,} params = {s['model_bytes'] / MiB:.1f} MiB in {s['rollout_dtype']}; "
        f"largest tensor {s['largest_tensor_bytes'] / MiB:.1f} MiB ({s['largest_tensor']}); "
        f"largest vLLM (fused) param {s['vllm_largest_param_bytes'] / MiB:.1f} MiB ({s['vllm_largest_param']})",
        "rank push  time_s  rss_before  peak_extra_os  largest_bucket  live_yielded  peak/model  [MiB]",
    ]
    for r in s["ranks"]:
        for p in r["pushes"]:
            lines.append(
                f"{r['rank']:4d} {p['version']:4d} {p['push_s']:7.2f} {mib(p['rss_before']):>11}"
                f" {mib(p['peak_extra_os']):>14} {mib(p['largest_bucket']):>15} {mib(p['live_yielded_peak']):>13}"
                f" {p['peak_extra_os'] / s['model_bytes']:11.3f}"
            )
    lines += [
        f"max: peak_extra_os {s['max_peak_extra_os'] / MiB:.1f} MiB = {s['ratio_peak_extra_os_to_model']:.3f} x model"
        f" = {s['ratio_peak_extra_os_to_target']:.2f} x target (largest bucket + largest tensor ="
        f" {s['target_bytes'] / MiB:.1f} MiB); largest bucket {s['max_largest_bucket'] / MiB:.1f} MiB;"
        f" live yielded {s['max_live_yielded'] / MiB:.1f} MiB; push {s['max_push_s']:.2f} s",
        "generation: "
        + "; ".join(
            f"rank {r['rank']} {r['gen_tokens_before']} tokens before, {r['gen_tokens_after']} after"
            f" (greedy output changed: {r['gen_changed_after_push']}, embed equal: {r['embed_equal_after_push']})"
            for r in s["ranks"]
        ),
    ]
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
