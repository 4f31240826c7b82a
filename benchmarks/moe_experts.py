"""Routed experts of one MoE layer: ours (models/moe/experts.py) against transformers 5.19's eager experts.

    OMP_NUM_THREADS=1 python benchmarks/moe_experts.py [--experts 128 --top-k 8 --hidden 1024
        --moe-intermediate 768 --tokens 2048 --dtype float32 --reps 3 --device auto]

One `Qwen3VLMoeTextExperts` (Qwen3-VL-30B-A3B's experts: 128 experts, top-8, moe_intermediate 768; hidden
1024 instead of 2048 to fit a shared CPU), random weights, `--tokens` tokens routed by a random softmax
router with top-k renormalisation (the model's). Timed, the median of `--reps` after one warm-up: the
forward alone and forward + backward (gradients of the hidden states, the routing weights and both expert
weights), for
  * `hf_eager`: transformers' loop over the experts hit,
  * `hf_grouped_mm`: transformers' own grouped-mm experts (`experts_implementation="grouped_mm"`),
  * `ours`: sort by expert -> grouped GEMM -> combine (`torch.nn.functional.grouped_mm` where it runs),
  * `ours_looped`: ours with the per-expert matmul loop that serves where grouped_mm does not run.
All four are measured in this one process, one after the other, so the ratios compare like with like. The
same script runs on a GPU unchanged (`--device auto` takes CUDA when present; use `--dtype bfloat16`
there). Prints one line per implementation and the ratio line `ours vs hf_eager`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch


def _experts(args, device, dtype):
    from transformers import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextExperts

    config = Qwen3VLMoeTextConfig(
        hidden_size=args.hidden,
        moe_intermediate_size=args.moe_intermediate,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
    )
    config._experts_implementation = "eager"
    module = Qwen3VLMoeTextExperts(config).to(device=device, dtype=dtype)
    with torch.no_grad():
        module.gate_up_proj.normal_(0, 0.02)
        module.down_proj.normal_(0, 0.02)
    return module


def _inputs(args, device, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(args.tokens, args.hidden, generator=g).to(device, dtype)
    router = torch.randn(args.hidden, args.experts, generator=g).to(device) * 0.05
    probs = torch.softmax(hidden.float() @ router, dim=-1)
    top, index = torch.topk(probs, args.top_k, dim=-1)
    return hidden, index, (top / top.sum(-1, keepdim=True)).to(dtype)


def _implementations(module):
    from transformers.integrations.moe import grouped_mm_experts_forward

    from spmd_grpo.models.moe import experts as ours

    def looped(h, i, w):
        with mock.patch.object(ours, "_grouped_mm_runs", lambda *_: False):
            return ours.grouped_experts_forward(module, h, i, w)

    return {
        "hf_eager": module.forward,
        "hf_grouped_mm": lambda h, i, w: grouped_mm_experts_forward(module, h, i, w),
        "ours": lambda h, i, w: ours.grouped_experts_forward(module, h, i, w),
        "ours_looped": looped,
    }


def _time(fn, sync, reps: int) -> float:
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--moe-intermediate", type=int, default=768)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", default="auto")
    args = p.parse_args()
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    dtype = getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    module = _experts(args, device, dtype)
    hidden, index, weights = _inputs(args, device, dtype)
    grad = torch.randn_like(hidden)
    print(
        f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.dtype}; E={args.experts} "
        f"K={args.top_k} H={args.hidden} I={args.moe_intermediate} T={args.tokens}"
    )
    results, reference = {}, None
    for name, fn in _implementations(module).items():
        module.zero_grad(set_to_none=True)
        with torch.no_grad():
            out = fn(hidden, index, weights)
        if reference is None:
            reference = out.float()
        err = ((out.float() - reference).norm() / reference.norm()).item()
        fwd = _time(lambda fn=fn: torch.no_grad()(fn)(hidden, index, weights), sync, args.reps)

        def step(fn=fn):
            h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
            fn(h, index, w).backward(grad)

        fwd_bwd = _time(step, sync, args.reps)
        results[name] = (fwd, fwd_bwd)
        print(f"{name:14s} forward {fwd * 1e3:9.1f} ms   forward+backward {fwd_bwd * 1e3:9.1f} ms   "
              f"relative error vs hf_eager {err:.1e}")  # fmt: skip
    (ef, eb), (of, ob) = results["hf_eager"], results["ours"]
    print(f"ours vs hf_eager: forward {ef / of:.2f}x faster, forward+backward {eb / ob:.2f}x faster")


if __name__ == "__main__":
    main()
