"""Peak extra memory of one trainer -> vLLM weight push (FSDP2 shards -> `RolloutEngine.load_weights`).

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 benchmarks/sync_memory.py \
        [--model-dir D] [--bucket-mb 64] [--dtype bfloat16] [--pushes 3] [--out result.json]

Without --model-dir a random Qwen2.5-VL of ~136M parameters is built from config (no download) into
.cache/bench_model_100m, or reused from there. Each rank holds the FSDP2 policy (fp32 masters) and its own
in-process vLLM engine (tensor_parallel_size 1). Every push perturbs the masters (a new policy version), then
streams them with `iter_weight_buckets` (what `iter_sharded_weights` flattens; cast to the rollout dtype
before the all-gather) into the engine. The measurement tools are in memtools.py.

Per push and rank:
  peak_extra_os     OS level: `5` -> /proc/self/clear_refs resets VmHWM to VmRSS right before the push
                    (after gc + malloc_trim, so freed heap pages do not hide allocations);
                    peak extra = VmHWM after - VmRSS before.
  live_heap_peak    live heap: glibc `mallinfo2()` in-use bytes (uordblks + hblkhd: heap chunks plus mmapped
                    chunks, which with MALLOC_MMAP_THRESHOLD_ or big tensors are not in uordblks) sampled by a
                    thread every ~1 ms (switch interval 1 ms during the push) and at every yield; peak minus
                    the value right before the push. Freed-but-resident pages do not count here.
  tensors_peak      tensor accounting: max over yields of (current gathered bucket + yielded tensors still
                    alive). Misses vLLM's own transients (rebuilt fused weight, new oneDNN pack).
  largest_bucket    the largest gathered (receive) buffer, as `iter_weight_buckets` reports each bucket.
  live_yielded_peak diagnostic: the most bytes of yielded tensors still alive at a yield (i.e. held by
                    the consumer, vLLM's layerwise reload buffers), tracked with storage weak references.
  rss_left          VmRSS after the push (and its heap trim on CPU) minus before.
The target is the largest bucket + the largest single tensor; every peak is printed as a multiple of the
model size (rollout dtype) and of the target. A greedy generation of two short text prompts runs before the
first and after the last push (token counts). Rank 0 prints one table and writes it as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # memtools.py sits beside this script
from memtools import (  # noqa: E402
    HeapSampler,
    LiveTensors,
    MiB,
    ensure_model,
    proc_mem,
    release_free_memory,
    reset_peak_rss,
)

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


class PushObserver:
    """Observes one push: each gathered bucket's bytes, the yielded tensors still alive, and bucket + alive."""

    def __init__(self, heap: HeapSampler | None = None) -> None:
        self.yielded = LiveTensors()  # peak / peak_at: the live_yielded diagnostic
        self.buckets: list[int] = []  # every gathered bucket's bytes; the last one is being yielded from
        self.bucket = 0
        self.tensors_peak = 0  # max of bucket + alive yielded tensors
        self.heap = heap

    def on_bucket(self, nbytes: int) -> None:
        """A bucket was just gathered."""
        self.buckets.append(nbytes)
        self.bucket = nbytes
        if self.heap is not None:
            self.heap.sample()

    def stream(
        self, buckets: Iterator[tuple[int, Iterator[tuple[str, torch.Tensor]]]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of `iter_weight_buckets(...)`, in order (what `iter_sharded_weights` yields), observed
        bucket by bucket and tensor by tensor."""
        for nbytes, tensors in buckets:
            self.on_bucket(nbytes)
            for name, t in tensors:
                live = self.yielded.track(name, t)
                self.tensors_peak = max(self.tensors_peak, self.bucket + live)
                if self.heap is not None:
                    self.heap.sample()
                    self.heap.where = f"vLLM loading {name}"
                yield name, t
                if self.heap is not None:
                    self.heap.where = f"stream after {name} (gather/take)"
                del t


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

    from transformers import AutoProcessor

    import spmd_grpo.rollout.engine as engine_mod
    from spmd_grpo.config.loader import load_config
    from spmd_grpo.data.prompts import processor_sizes
    from spmd_grpo.models.build import build_policy
    from spmd_grpo.parallel.collectives import init_distributed
    from spmd_grpo.parallel.devices import DTYPES
    from spmd_grpo.rollout.engine import RolloutEngine
    from spmd_grpo.rollout.weight_sync import iter_weight_buckets

    world = init_distributed("cpu")
    model_dir = (args.model_dir or DEFAULT_MODEL_DIR).resolve()
    if args.model_dir is None:
        ensure_model(model_dir, BENCH_SPEC, world.rank)
    dtype = DTYPES[args.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    bucket_bytes = args.bucket_mb * MiB

    cfg = load_config(None, [
        f"worker.actor.model.model_path={model_dir}", "worker.actor.fsdp.param_dtype=float32",
        f"worker.rollout.dtype={args.dtype}", f"worker.rollout.weight_sync_bucket_mb={args.bucket_mb}",
        "trainer.seed=0",
    ])  # fmt: skip
    policy = build_policy(cfg.worker.actor, world)
    tie = bool(policy.config.tie_word_embeddings)
    sizes = processor_sizes(
        cfg.data, AutoProcessor.from_pretrained(model_dir), cfg.worker.rollout.limit_videos
    )
    engine = RolloutEngine.from_config(cfg, world, tie_word_embeddings=tie, sizes=sizes)

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

    # Time the post-push heap trim that `load_weights` does on CPU.
    trim_s: list[float] = []
    _trim = getattr(engine_mod, "_malloc_trim", None)

    def timed_trim() -> None:
        t = time.perf_counter()
        _trim()
        trim_s.append(time.perf_counter() - t)

    if hasattr(engine_mod, "_malloc_trim"):  # absent in engines without the post-push trim
        engine_mod._malloc_trim = timed_trim

    # Generation before any push.
    before = greedy_tokens(engine, args.max_tokens)

    pushes = []
    for i in range(args.pushes):
        version = i + 1
        perturb_masters(policy, version, world.rank)
        release_free_memory()
        dist.barrier()
        rss_before = proc_mem()["VmRSS"]
        reset_peak_rss()
        trim_s.clear()
        with HeapSampler(where="gathering the first bucket") as heap:
            live = PushObserver(heap)

            t0 = time.perf_counter()
            engine.load_weights(
                live.stream(iter_weight_buckets(policy, dtype, bucket_bytes, tie_word_embeddings=tie)),
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
                "live_heap_peak": heap.peak_extra,
                "live_heap_peak_at": heap.peak_at,
                "heap_samples": heap.num_samples,
                "tensors_peak": live.tensors_peak,
                "rss_left": mem["VmRSS"] - rss_before,
                "trim_s": sum(trim_s),
                "num_buckets": len(live.buckets),
                "largest_bucket": max(live.buckets, default=0),
                "live_yielded_peak": live.yielded.peak,
                "live_yielded_peak_at": live.yielded.peak_at,
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
        peak_heap = max(p["live_heap_peak"] for p in all_pushes)
        peak_tensors = max(p["tensors_peak"] for p in all_pushes)
        peak_bucket = max(p["largest_bucket"] for p in all_pushes)
        peak_live = max(p["live_yielded_peak"] for p in all_pushes)
        target = peak_bucket + largest_tensor_bytes
        summary = {
            "machine": f"{os.cpu_count()}-core CPU, {world.backend}, {world.world_size} ranks, vLLM TP 1",
            "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
            "model_dir": str(model_dir),
            "rollout_dtype": args.dtype,
            "bucket_mb": args.bucket_mb,
            "num_params": num_params,
            "model_bytes": model_bytes,
            "largest_tensor": largest_name,
            "largest_tensor_bytes": largest_tensor_bytes,
            "vllm_largest_param": vllm_largest[0],
            "vllm_largest_param_bytes": vllm_largest[1],
            "target_bytes": target,
            "max_peak_extra_os": peak_os,
            "max_live_heap_peak": peak_heap,
            "max_live_heap_peak_at": next(
                p["live_heap_peak_at"] for p in all_pushes if p["live_heap_peak"] == peak_heap
            ),
            "max_tensors_peak": peak_tensors,
            "max_largest_bucket": peak_bucket,
            "max_live_yielded": peak_live,
            "max_rss_left": max(p["rss_left"] for p in all_pushes),
            "ratio_peak_extra_os_to_model": peak_os / model_bytes,
            "ratio_peak_extra_os_to_target": peak_os / target,
            "ratio_live_heap_peak_to_model": peak_heap / model_bytes,
            "ratio_live_heap_peak_to_target": peak_heap / target,
            "ratio_tensors_peak_to_model": peak_tensors / model_bytes,
            "ratio_tensors_peak_to_target": peak_tensors / target,
            "max_push_s": max(p["push_s"] for p in all_pushes),
            "max_trim_s": max(p["trim_s"] for p in all_pushes),
            "min_heap_samples_per_s": min(p["heap_samples"] / p["push_s"] for p in all_pushes),
            "ranks": gathered,
        }
        print_table(summary)
        if args.out is not None:
            args.out.write_text(json.dumps(summary, indent=1))
    dist.barrier()  # no destroy_process_group: vLLM's shutdown hook tears its groups down at exit


def print_table(s: dict) -> None:
    model, target = s["model_bytes"], s["target_bytes"]

    def mib(b: int) -> str:
        return f"{b / MiB:.1f}"

    def x(b: int) -> str:  # "MiB (x model, x target)"
        return f"{b / model:.2f}/{b / target:.2f}"

    lines = [
        f"sync_memory | {s['machine']} | rollout dtype {s['rollout_dtype']} | bucket {s['bucket_mb']} MiB"
        f" | MALLOC_MMAP_THRESHOLD_={s['malloc_mmap_threshold'] or 'unset'}",
        f"model: {s['num_params']:,} params = {mib(model)} MiB in {s['rollout_dtype']}; "
        f"largest tensor {mib(s['largest_tensor_bytes'])} MiB ({s['largest_tensor']}); "
        f"largest vLLM (fused) param {mib(s['vllm_largest_param_bytes'])} MiB ({s['vllm_largest_param']})",
        f"target = largest bucket {mib(s['max_largest_bucket'])} + largest tensor {mib(s['largest_tensor_bytes'])}"
        f" = {mib(target)} MiB = {target / model:.2f} x model",
        "[MiB; x = multiple of model/target]",
        f"{'rank':>4} {'push':>4} {'time_s':>6} {'trim_ms':>7} {'rss_before':>10} {'rss_left':>8}"
        f" {'peak_os':>7} {'x':>9} {'live_heap':>9} {'x':>9} {'tensors':>7} {'x':>9} {'bucket':>6} {'yielded':>7}",
    ]
    for r in s["ranks"]:
        for p in r["pushes"]:
            lines.append(
                f"{r['rank']:4d} {p['version']:4d} {p['push_s']:6.2f} {p['trim_s'] * 1e3:7.1f}"
                f" {mib(p['rss_before']):>10} {mib(p['rss_left']):>8}"
                f" {mib(p['peak_extra_os']):>7} {x(p['peak_extra_os']):>9}"
                f" {mib(p['live_heap_peak']):>9} {x(p['live_heap_peak']):>9}"
                f" {mib(p['tensors_peak']):>7} {x(p['tensors_peak']):>9}"
                f" {mib(p['largest_bucket']):>6} {mib(p['live_yielded_peak']):>7}"
            )
    lines += [
        "max: "
        + "; ".join(
            f"{label} {mib(s[key])} MiB = {s[key] / model:.3f} x model = {s[key] / target:.2f} x target"
            for label, key in (
                ("peak_os", "max_peak_extra_os"),
                ("live_heap", "max_live_heap_peak"),
                ("tensors", "max_tensors_peak"),
            )
        ),
        f"     live_heap peak: {s['max_live_heap_peak_at']};"
        f" rss_left {mib(s['max_rss_left'])} MiB; live yielded {mib(s['max_live_yielded'])} MiB;"
        f" push {s['max_push_s']:.2f} s (trim {s['max_trim_s'] * 1e3:.1f} ms);"
        f" heap samples >= {s['min_heap_samples_per_s']:.0f}/s",
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
