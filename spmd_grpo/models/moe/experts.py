"""Routed experts as grouped GEMMs over tokens sorted by expert, replacing the Hugging Face experts' forward.

Shapes: T tokens, H hidden size, I expert intermediate size, E experts, K experts per token (top-k),
N = T x K routed (token, expert) pairs, in expert order after `sort_by_expert`.

transformers 5.19's Qwen3-VL-MoE / Qwen3.5-MoE experts (`Qwen3VLMoeTextExperts`, `Qwen3_5MoeExperts`) hold
stacked weights, `gate_up_proj` [E, 2I, H] (gate rows first, then up) and `down_proj` [E, H, I], and their
eager forward loops over the experts hit in Python: per expert a `where` over the one-hot routing mask, a
gather, two small matmuls and an `index_add_`. Here the same computation is three steps with one job each
(the seams torchtitan's MoE has, where expert parallelism later puts its all-to-all):

    sort_by_expert   stable argsort of the N expert ids; gather tokens and routing weights in that order;
                     tokens per expert (the GEMM group sizes)
    expert_mlp       down(act(gate(x)) * up(x)) per group: two grouped GEMMs over all experts
    combine          weight each row by its routing weight, put rows back in token order, sum the K rows of
                     each token in fp32 (a gather and a sum: deterministic on every device, where CUDA's
                     `index_add_` is not)

The grouped GEMM is `torch.nn.functional.grouped_mm` (torch >= 2.10; CUDA sm80+ and the CPU, forward and
backward) where the device and the shapes allow it (row strides a multiple of 16 bytes, which Qwen sizes
always are), and otherwise a loop of one matmul per non-empty expert on slices of the sorted rows (the
weights are `unbind`-ed, so the backward writes one stacked gradient instead of E full-size ones).

Exactness: the same operations as the eager experts in another summation order; in fp32 the logprobs and
every gradient agree to rounding (tests/unit/test_moe.py). Why not transformers' own
`experts_implementation="grouped_mm"` (integrations/moe.py), which is this computation too: it sorts,
computes and unsorts inside one function, so there is no place for the expert-parallel dispatch between
the sort and the GEMM, and it sums the K rows in the activation dtype (bf16 on accelerators). It is measured
beside ours in benchmarks/moe_experts.py: on a Qwen3-VL-30B-A3B-shaped layer on a shared 2-core CPU both
take about 3.2 s for forward + backward when timed alternately (the eager experts: 73 s).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class SortedTokens:
    """The routed pairs in expert order, and what `combine` needs to undo the order."""

    hidden: torch.Tensor  # [N, H]: the token of each pair
    weights: torch.Tensor  # [N]: the pair's routing weight
    tokens_per_expert: torch.Tensor  # [E] long (sums to N)
    order: torch.Tensor  # [N] long: pair (flattened [T, K] index) at each sorted position
    num_tokens: int  # T


def sort_by_expert(
    hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int
) -> SortedTokens:
    """hidden [T, H], top_k_index / top_k_weights [T, K] -> the N = T x K pairs sorted by expert (stable:
    a token's pairs keep token order inside each expert)."""
    expert_ids = top_k_index.reshape(-1)
    order = torch.argsort(expert_ids, stable=True)
    counts = torch.bincount(expert_ids, minlength=num_experts)
    k = top_k_index.shape[-1]
    return SortedTokens(
        hidden=hidden[order // k],
        weights=top_k_weights.reshape(-1)[order],
        tokens_per_expert=counts,
        order=order,
        num_tokens=hidden.shape[0],
    )


def combine(rows: torch.Tensor, sorted_tokens: SortedTokens) -> torch.Tensor:
    """Expert outputs [N, H] in expert order -> [T, H], in the rows' dtype: each token's K rows back in token
    order, weighted by their routing weights and summed by one batched matmul ([T, 1, K] x [T, K, H]) in the
    wider of the two dtypes. The matmul accumulates in fp32, and a product of two bf16 values is exact in
    fp32, so a bf16 result is the fp32 sum of the exact products rounded once, as multiplying in fp32 and
    summing would give up to the order of the additions, without an fp32 copy of all N rows."""
    inverse = torch.empty_like(sorted_tokens.order)
    inverse[sorted_tokens.order] = torch.arange(inverse.numel(), device=inverse.device)
    t, dtype = sorted_tokens.num_tokens, torch.promote_types(rows.dtype, sorted_tokens.weights.dtype)
    gathered = rows[inverse].view(t, -1, rows.shape[-1]).to(dtype)
    weights = sorted_tokens.weights[inverse].view(t, 1, -1).to(dtype)
    return torch.bmm(weights, gathered).squeeze(1).to(rows.dtype)


@cache
def _grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `F.grouped_mm` exists and runs on this device type and dtype: tried once on a 2-expert
    problem, since support depends on the build, the device and its capability. Forward only, without
    autograd: the first call may come inside an activation-checkpointed layer, whose recomputation must
    save the same tensors as its first run (and the later calls find the answer cached)."""
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        with torch.no_grad():
            x = torch.ones(4, 8, device=device_type, dtype=dtype)
            w = torch.ones(2, 8, 8, device=device_type, dtype=dtype)
            offsets = torch.tensor([1, 4], device=device_type, dtype=torch.int32)
            F.grouped_mm(x, w, offs=offsets)
        return True
    except (RuntimeError, NotImplementedError):
        return False


def _aligned(t: torch.Tensor) -> bool:
    """grouped_mm wants 16-byte aligned row strides (the CPU and CUDA kernels check)."""
    return all(s == 1 or (s * t.element_size()) % 16 == 0 for s in t.stride()) and t.data_ptr() % 16 == 0


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Rows of `x` [N, D_in], grouped by expert in order, times their expert's `weight` [E, D_in, D_out]
    (a transposed view is fine) -> [N, D_out]."""
    x = x.to(weight.dtype)
    if _grouped_mm_runs(x.device.type, x.dtype) and _aligned(x) and _aligned(weight):
        offsets = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
        return F.grouped_mm(x, weight, offs=offsets)
    return _looped_mm(x, weight, tokens_per_expert)


def _looped_mm(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """The fallback: one matmul per non-empty expert (one host sync for the group sizes)."""
    counts = tokens_per_expert.tolist()
    per_expert = weight.unbind(0)
    pieces = [rows @ per_expert[e] for e, rows in enumerate(x.split(counts)) if counts[e]]
    if not pieces:  # no token at all: an empty result that still reaches the weights (zero gradient)
        return x @ weight[0] + 0 * weight.sum()
    return torch.cat(pieces)


def expert_mlp(
    rows: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act_fn: nn.Module,
) -> torch.Tensor:
    """The SwiGLU expert MLP of the Qwen MoE families on expert-sorted rows [N, H] -> [N, H]: gate_up_proj
    [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I] in transformers' layout."""
    gate_up = grouped_mm(rows, gate_up_proj.transpose(1, 2), tokens_per_expert)
    gate, up = gate_up.chunk(2, dim=-1)
    return grouped_mm(act_fn(gate) * up, down_proj.transpose(1, 2), tokens_per_expert)


def grouped_experts_forward(
    experts: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Drop-in for the HF experts' forward (same arguments and result: hidden [T, H] -> [T, H])."""
    sorted_tokens = sort_by_expert(hidden, top_k_index, top_k_weights, experts.num_experts)
    rows = expert_mlp(
        sorted_tokens.hidden,
        sorted_tokens.tokens_per_expert,
        experts.gate_up_proj,
        experts.down_proj,
        experts.act_fn,
    )
    return combine(rows, sorted_tokens).to(hidden.dtype)


def is_stacked_experts(module: nn.Module) -> bool:
    """An experts module in the layout `expert_mlp` computes: stacked, concatenated [gate; up], not
    transposed, no bias (what transformers' `use_experts_implementation` records on the class)."""
    return (
        isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
        and isinstance(getattr(module, "down_proj", None), torch.Tensor)
        and getattr(module, "has_gate", True)
        and not getattr(module, "has_bias", False)
        and not getattr(module, "is_transposed", False)
        and getattr(module, "is_concatenated", True)
    )


def use_grouped_experts(experts: nn.Module) -> None:
    """Swap one HF experts module's forward for `grouped_experts_forward` (in place, this instance only)."""
    if not is_stacked_experts(experts):
        raise NotImplementedError(
            f"{type(experts).__name__}: an experts layout the grouped GEMM does not know"
        )
    experts.forward = types.MethodType(grouped_experts_forward, experts)
