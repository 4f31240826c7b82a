"""Shared-prompt attention on CUDA at real models' head shapes: flex attention with the shared row's block mask
(`models/shared_flex.py`) against the gathered masked sdpa (`attention.VARLEN_SDPA`), bf16, forward + backward.

    python benchmarks/shared_flex.py    # needs a CUDA device (CPU flex attention has no backward)

One attention layer over one packed shared row: per group a prompt of P tokens and n responses of R, R - 8,
R - 16, ... tokens (unequal, as sampled responses are). Cases: the geometry3k shape of
tests/gpu/test_gpu_shared_prompt.py (16 / 2 heads of 128), Qwen2.5-VL-7B's heads (28 / 4 of 128) and Qwen3.5's
(16 / 4 of 256) at P = 2048, n = 8, R = 1024, and a 36k-token row with 64 / 8 heads of 128. Printed per case:
the last of 4 runs (the first compile) of each, its peak allocated memory, and the relative difference of the
output and of the query and key gradients between the two (bf16 rounding apart: ~1e-3). The comparison is of
the attention kernel only: both compute the same shared layout, whose gain (P + nR tokens instead of
n(P + R) in every other layer) benchmarks/shared_prompt.py measures.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spmd_grpo.models.attention import varlen_sdpa_forward  # noqa: E402
from spmd_grpo.models.shared_flex import flex_shared_forward  # noqa: E402

CASES = [  # (P, n, R, query heads, key/value heads, head dim)
    (640, 8, 128, 16, 2, 128),
    (2048, 8, 1024, 28, 4, 128),
    (640, 8, 128, 16, 4, 256),
    (2048, 8, 1024, 16, 4, 256),
    (4096, 16, 2048, 64, 8, 128),
]


def measure(P: int, n: int, R: int, H: int, Hkv: int, D: int) -> tuple[int, dict, dict]:
    """(tokens, {kernel: (seconds, peak MiB)} of its last of 4 runs, {kernel: (output, dq, dk)}) for the shared
    row of one group (prompt P, n responses of R, R - 8, ...) and one attention layer (H / Hkv heads of D)."""
    text = [torch.arange(P + R)] + [torch.arange(P, P + R - 8 * i) for i in range(1, n)]
    positions = torch.cat(text)[None].cuda()
    T = positions.shape[1]
    module = SimpleNamespace(num_key_value_groups=H // Hkv, is_causal=True, training=False)
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(1, h, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for h in (H, Hkv, Hkv)
    )
    results, outputs = {}, {}
    for name, fn in (("gathered_sdpa", varlen_sdpa_forward), ("flex", flex_shared_forward)):
        for _ in range(4):  # the first runs compile
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            out = fn(module, q, k, v, None, position_ids=positions, scaling=D**-0.5, dropout=0.0)[0]
            out.float().pow(2).sum().backward()
            torch.cuda.synchronize()
            results[name] = (time.perf_counter() - start, torch.cuda.max_memory_allocated() / 2**20)
            outputs[name] = (out.detach().float(), q.grad.float(), k.grad.float())
            q.grad = k.grad = v.grad = None
    return T, results, outputs


def case(P: int, n: int, R: int, H: int, Hkv: int, D: int) -> str:
    """One table row of `measure`."""
    T, results, outputs = measure(P, n, R, H, Hkv, D)
    diff = [
        ((a - b).norm() / a.norm()).item()
        for a, b in zip(outputs["gathered_sdpa"], outputs["flex"], strict=True)
    ]
    (ts, ms), (tf, mf) = results["gathered_sdpa"], results["flex"]
    return (f"| {P} | {n} | {R} | {H} / {Hkv} x {D} | {T} | {ts * 1e3:.2f} ms, {ms:.0f} MiB | "
            f"{tf * 1e3:.2f} ms, {mf:.0f} MiB | {ts / tf:.2f}x | {' / '.join(f'{d:.1e}' for d in diff)} |")  # fmt: skip


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/shared_flex.py needs a CUDA device")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(
        "| P | n | R | heads (q / kv x dim) | tokens | gathered sdpa | flex | sdpa / flex time | out / dq / dk diff |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in CASES:
        print(case(*c), flush=True)


if __name__ == "__main__":
    main()
