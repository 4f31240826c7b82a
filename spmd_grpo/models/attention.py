"""A variable-length attention path for packed sequences on devices without a varlen kernel (the CPU).

A padding-free micro-batch is one row of B sequences back to back, with per-sequence text positions that
restart at 0 (`inputs.mrope_position_ids`). flash attention takes the boundaries as `cu_seqlens`; torch's
sdpa has no such entry, and transformers' sdpa path turns the boundaries into a dense [T, T] block-diagonal
mask, which costs more than the padding it saves (T^2 mask entries and a masked kernel over every pair of
tokens of the row). This implementation runs causal sdpa per sequence instead, the sequences of equal
length batched together (gathered from the row, then put back in order): exactly the work of the valid
tokens, one kernel call per distinct length per layer (a micro-batch of 128 four-token responses to
equal-length prompts is one call, not 128: per-sequence calls made its backward 44 % slower than padded).

It is registered with transformers under `VARLEN_SDPA` (an attention function and a mask function) and is
what `varlen_attention("cpu")` below names. transformers passes the text positions to the attention
function as `position_ids`; the mask function returns no mask for a batch without an attention mask (a
packed row), so the boundaries come from those positions alone. Everything else, a padded batch with its
mask, or the vision tower's per-image calls (no positions), goes to transformers' own sdpa unchanged.
"""

from __future__ import annotations

import importlib.util

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

VARLEN_SDPA = "sdpa_varlen"


def sequence_bounds(positions: torch.Tensor) -> list[int]:
    """Start offsets of the packed sequences in a row of text positions [T], plus T: a sequence starts
    wherever the position is not the previous one + 1."""
    starts = torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1
    return [0, *starts.tolist(), positions.numel()]


def varlen_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (query/key/value [B, heads, T, head_dim]); returns
    [B, T, heads, head_dim]. One row with no mask and positions that restart: one causal sdpa per sequence
    length, over the sequences of that length."""
    if (
        attention_mask is not None
        or position_ids is None
        or query.shape[0] != 1
        or not kwargs.get("is_causal", True)
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    bounds = sequence_bounds(position_ids.reshape(-1))
    if len(bounds) == 2:
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)
    groups: dict[int, list[int]] = {}  # sequence length -> the starts of the sequences of that length
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        groups.setdefault(b - a, []).append(a)
    outputs, order = [], []
    for n, starts in groups.items():
        index = (
            torch.tensor(starts, device=query.device)[:, None] + torch.arange(n, device=query.device)
        ).flatten()
        # [1, heads, m * n, head_dim] -> [m, heads, n, head_dim]: the m sequences of length n as a batch
        pick = lambda t: t.index_select(2, index).unflatten(2, (len(starts), n)).squeeze(0).transpose(0, 1)  # noqa: E731, B023
        out = sdpa_attention_forward(module, pick(query), pick(key), pick(value), None, **kwargs)[0]
        outputs.append(out.flatten(0, 1))  # [m * n, heads, head_dim]
        order.append(index)
    rows = torch.cat(outputs).index_select(0, torch.argsort(torch.cat(order)))
    return rows.unsqueeze(0), None


def varlen_sdpa_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """No mask for a packed row (no attention mask): the attention function cuts it at the sequence
    boundaries. A padded batch gets transformers' sdpa mask."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_forward)
AttentionMaskInterface.register(VARLEN_SDPA, varlen_sdpa_mask)


def varlen_attention(device_type: str) -> str | None:
    """The transformers `attn_implementation` with a variable-length kernel for packed sequences, or None.

    npu: `flash_attention_2`, which transformers maps to torch_npu's `npu_fusion_attention` (varlen through
    `cu_seqlens`); cuda: `flash_attention_2` when the `flash_attn` package imports (else None: sdpa would
    build a dense block-diagonal mask); cpu: `attention.VARLEN_SDPA`, causal sdpa per packed-sequence length.
    Verified here only on CPU (packed vs padded); neither GPU kernel has run in this project.
    """
    if device_type == "npu":
        return "flash_attention_2"
    if device_type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    if device_type == "cpu":
        return VARLEN_SDPA
    return None
