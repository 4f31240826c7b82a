"""Packed (padding-free) rows through Gated DeltaNet layers: the recurrent state and the causal convolution
restart at every sequence.

Shapes: T tokens of a packed row, H hidden size.

A linear-attention layer (Qwen3.5's `linear_attn`) carries two things along the sequence: a causal depth-wise
convolution (kernel 4) over its q/k/v projections and the delta-rule recurrent state. In a packed row both
would run straight across a sequence boundary: the next sequence's first tokens would see the previous
sequence's last tokens through the convolution and its whole history through the state. The kernels that
restart them take `cu_seqlens` (flash-linear-attention's `chunk_gated_delta_rule`, `causal-conv1d`), but
transformers 5.19's torch fallback, the only path on the CPU, accepts `cu_seqlens` and ignores it, and the
decoder layer does not even hand the layer the packed positions (only the attention layers get them).

`split_packed_linear_attention` therefore wraps each such layer: a pre-hook on its decoder layer reads the
text positions the decoder layer gets (row 0 of the packed 4-row position ids, restarting at 0 at each
sequence), and the layer's forward then runs the sequences as a batch per distinct length (the same
grouping as the varlen attention path) and puts the outputs back in row order. A padded batch (no restart
in its positions, or no positions) runs the layer unchanged. With a varlen kernel installed (CUDA with
flash-linear-attention) this costs a few gathers per layer; it keeps the CPU exact.

Shared prompts (`inputs.collate`: a group's prompt once, its responses after it, each response after the
first restarting its text positions at the prompt length P; `attention.row_roots` reads that): the prompt
runs once, and its final state seeds every response of the group, as the prompt's tokens would in the
unshared sequence. The state is the recurrent delta-rule state after the prompt and the causal
convolution's last inputs (its kernel's width) of the prompt; both are handed to the layer through
transformers' own continuation path (a cache with a previous state: the convolution reads the kept inputs
as left context, the chunked delta rule starts from the kept state), by `_PromptState`, a stand-in for
transformers' linear-attention cache that keeps the states in the autograd graph (the cache's in-place
buffers would not), so the prompt receives every response's gradient through its state. Cost per layer:
the prompt's P tokens once and the n responses' R tokens each, instead of n (P + R); prompts of one length
run as one batch, responses of one length as another (each with its group's state). The delta rule's chunks
(64 tokens) then start at the response instead of at the sequence start: equal in exact arithmetic, within
fp32 rounding here (tests/unit/test_shared_prompt_moe.py, Qwen3.5-MoE).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from spmd_grpo.models.attention import LastRow, row_roots


class _PromptState:
    """What a Gated DeltaNet layer reads from and writes to transformers' linear-attention cache, for one
    call: empty, it keeps the call's final convolution inputs [m, C, kernel] and recurrent state (a
    prompt's); given them, it hands them to the call as the previous state (its responses'). Every tensor
    stays in the autograd graph."""

    def __init__(self, conv: torch.Tensor | None = None, recurrent: torch.Tensor | None = None) -> None:
        self.conv, self.final_conv, self.final_recurrent = conv, None, None
        # record_past: transformers' path that concatenates the kept inputs (no in-place single-token step)
        layer = SimpleNamespace(record_past=True, conv_states=[conv], recurrent_states=[recurrent])
        self.layers = defaultdict(lambda: layer)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int = 0) -> bool:
        return self.conv is not None

    def update_conv_state(
        self, inputs: torch.Tensor, layer_idx: int, conv_kernel_size: int, **_
    ) -> torch.Tensor:
        full = inputs if self.conv is None else torch.cat([self.conv, inputs], dim=-1)
        self.final_conv = F.pad(full, (max(conv_kernel_size - full.shape[-1], 0), 0))[..., -conv_kernel_size:]
        return full

    def update_recurrent_state(self, state: torch.Tensor, layer_idx: int, **_) -> torch.Tensor:
        self.final_recurrent = state
        return state


@dataclass(frozen=True)
class _RowRuns:
    """How a packed row runs through a linear-attention layer (the module docstring), read once per row from
    its text positions: each batch of runs of one length n as its token index [m * n] on the row's device,
    with the groups whose prompt (or response) each run is, and the permutation that puts the outputs back in
    row order."""

    single: bool  # one unshared sequence: the layer runs unchanged
    plain: list[tuple[int, torch.Tensor]]  # (n, index) of whole sequences
    prompts: list[tuple[int, list[int], torch.Tensor]]  # (P, group of each run, index)
    responses: list[tuple[int, list[int], torch.Tensor]]  # (n, group of each run, index)
    inverse: torch.Tensor | None  # [T]: row position -> place among the concatenated outputs


def _row_runs(positions: torch.Tensor) -> _RowRuns:
    """`_RowRuns` of the packed row of text positions [T] (its sequences: `attention.row_roots`)."""
    roots = row_roots(positions)
    if len(roots) == 1 and roots[0][2] is None:
        return _RowRuns(True, [], [], [], None)
    plain: dict[int, list[int]] = {}  # length -> starts of whole sequences
    prompts: dict[int, list[tuple[int, int]]] = {}  # prompt length -> (start, group)
    responses: dict[int, list[tuple[int, int]]] = {}  # length -> (start, group) of shared-prompt responses
    for g, (start, end, prefix, rest) in enumerate(roots):
        if prefix is None:
            plain.setdefault(end - start, []).append(start)
            continue
        prompts.setdefault(prefix, []).append((start, g))
        first = [(start + prefix, end - start - prefix)] if end - start > prefix else []
        for r, n in [*first, *rest]:
            responses.setdefault(n, []).append((r, g))
    device = positions.device

    def index(starts: list[int], n: int) -> torch.Tensor:
        return (torch.tensor(starts)[:, None] + torch.arange(n)).flatten().to(device)

    runs = _RowRuns(
        False,
        [(n, index(starts, n)) for n, starts in plain.items()],
        [(p, [g for _, g in items], index([a for a, _ in items], p)) for p, items in prompts.items()],
        [(n, [g for _, g in items], index([r for r, _ in items], n)) for n, items in responses.items()],
        None,
    )
    order = [run[-1] for run in (*runs.plain, *runs.prompts, *runs.responses)]
    return replace(runs, inverse=torch.argsort(torch.cat(order)))


_cached_runs = LastRow(_row_runs)


def _split_forward(layer: nn.Module, forward):
    """`forward` of a Gated DeltaNet `layer`, run per packed sequence when its decoder layer saw restarts,
    each shared prompt once with its final state seeding its responses (the module docstring). The row's
    runs are read once per row (`_RowRuns`), not once per layer: on an accelerator reading the positions
    and copying the index lists to the device would make the host wait at every layer."""

    def packed_forward(hidden_states: torch.Tensor, *args, **kwargs):
        positions = layer.__dict__.pop("_packed_positions", None)
        if positions is None or hidden_states.shape[0] != 1 or kwargs.get("cache_params") is not None:
            return forward(hidden_states, *args, **kwargs)
        runs = _cached_runs(positions.reshape(-1))
        if runs.single:
            return forward(hidden_states, *args, **kwargs)
        kwargs["attention_mask"] = None  # a packed row has none; each group is unpadded
        outputs = []

        def run(index: torch.Tensor, n: int, state: _PromptState | None = None) -> None:
            group = hidden_states[0].index_select(0, index).unflatten(0, (-1, n))  # [m, n, H]
            outputs.append(forward(group, *args, **{**kwargs, "cache_params": state}).flatten(0, 1))

        for n, index in runs.plain:
            run(index, n)
        seeds: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for p, groups, index in runs.prompts:
            state = _PromptState()
            run(index, p, state)
            seeds.update((g, (state.final_conv[j], state.final_recurrent[j])) for j, g in enumerate(groups))
        for n, groups, index in runs.responses:
            conv, recurrent = (torch.stack([seeds[g][k] for g in groups]) for k in (0, 1))
            run(index, n, _PromptState(conv, recurrent))
        return torch.cat(outputs).index_select(0, runs.inverse).unsqueeze(0)

    return packed_forward


def split_packed_linear_attention(decoder_layers, module_name: str) -> int:
    """Make every decoder layer's `module_name` child (its Gated DeltaNet) restart at packed sequence starts
    (see the module docstring). In place; returns the number of layers changed. Idempotent."""
    changed = 0
    for decoder_layer in decoder_layers:
        inner = getattr(decoder_layer, "_checkpoint_wrapped_module", decoder_layer)
        layer = getattr(inner, module_name, None)
        if layer is None or "_packed_split" in layer.__dict__:
            continue

        def remember_positions(module, args, kwargs, layer=layer):
            layer.__dict__["_packed_positions"] = kwargs.get("position_ids")

        inner.register_forward_pre_hook(remember_positions, with_kwargs=True)
        layer.forward = _split_forward(layer, layer.forward)
        layer.__dict__["_packed_split"] = True
        changed += 1
    return changed
