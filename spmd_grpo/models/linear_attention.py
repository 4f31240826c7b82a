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
"""

from __future__ import annotations

import torch
from torch import nn

from spmd_grpo.models.attention import sequence_bounds


def _grouped_by_length(bounds: list[int]) -> dict[int, list[int]]:
    """{sequence length: the starts of the sequences of that length}."""
    groups: dict[int, list[int]] = {}
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        groups.setdefault(b - a, []).append(a)
    return groups


def _split_forward(layer: nn.Module, forward):
    """`forward` of a Gated DeltaNet `layer`, run per packed sequence when its decoder layer saw restarts."""

    def packed_forward(hidden_states: torch.Tensor, *args, **kwargs):
        positions = layer.__dict__.pop("_packed_positions", None)
        if positions is None or hidden_states.shape[0] != 1 or kwargs.get("cache_params") is not None:
            return forward(hidden_states, *args, **kwargs)
        bounds = sequence_bounds(positions.reshape(-1))
        if len(bounds) == 2:
            return forward(hidden_states, *args, **kwargs)
        kwargs["attention_mask"] = None  # a packed row has none; each group is unpadded
        outputs, order = [], []
        for n, starts in _grouped_by_length(bounds).items():
            device = hidden_states.device
            index = (torch.tensor(starts, device=device)[:, None] + torch.arange(n, device=device)).flatten()
            group = hidden_states[0].index_select(0, index).unflatten(0, (len(starts), n))  # [m, n, H]
            outputs.append(forward(group, *args, **kwargs).flatten(0, 1))
            order.append(index)
        return torch.cat(outputs).index_select(0, torch.argsort(torch.cat(order))).unsqueeze(0)

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
