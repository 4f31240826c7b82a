"""A variable-length attention path for packed sequences on devices without a varlen kernel (the CPU).

A padding-free micro-batch is one row of B sequences back to back, with per-sequence text positions that
restart at 0 (`inputs.mrope_position_ids`). flash attention takes the boundaries as `cu_seqlens`; torch's
sdpa has no such entry, and transformers' sdpa path turns the boundaries into a dense [T, T] block-diagonal
mask, which costs more than the padding it saves (T^2 mask entries and a masked kernel over every pair of
tokens of the row). This implementation runs causal sdpa per sequence instead, the sequences of equal
length batched together (gathered from the row, then put back in order): exactly the work of the valid
tokens, one kernel call per distinct length per layer (a micro-batch of 128 four-token responses to
equal-length prompts is one call, not 128: per-sequence calls made its backward 44 % slower than padded).

Shared prompts (`inputs.collate`): a group's prompt is in the row once, followed by its responses, and each
response after the first restarts the text positions at the prompt length P instead of 0. The plan
(`attention_plan`) reads that from the positions alone: the prompt's causal attention is computed once
(batched with the other runs of its length), and each group's n responses in one masked sdpa, each response
a batch row whose queries are its tokens (padded to the group's longest, Rq) and whose keys are [the P prompt
keys; its own keys], visible: every prompt key, its own keys causally. Cost per layer and group: P^2 / 2
scores for the prompt and n x Rq x (P + Rq) for the responses (unshared: n x (P + R)^2 / 2), plus the gathered
copies of the prompt's keys and values, n x P per head, and a boolean mask of n x Rq x (P + Rq). On CUDA
the shared layout runs flex attention with a block mask instead (`shared_flex.FLEX_SHARED`: no gathered
copies, no per-response mask, one fused call per layer), in place of flash attention's varlen kernel, whose
`cu_seqlens` give each sequence one length and cannot express a shared prefix; Ascend, without flex
attention, runs this function.

It is registered with transformers under `VARLEN_SDPA` (an attention function and a mask function) and is
what `varlen_attention("cpu")` below names. transformers passes the text positions to the attention
function as `position_ids`; the mask function returns no mask for a batch without an attention mask (a
packed row), so the boundaries come from those positions alone. Everything else, a padded batch with its
mask, or the vision tower's per-image calls (no positions), goes to transformers' own sdpa unchanged.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

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


@dataclass(frozen=True)
class AttentionPlan:
    """How one packed row's attention is computed, read from its text positions (row 0 of the position ids).

    `causal`: (n, starts [m]) per length n: m causal runs of n tokens (whole sequences, or the prompts of
    shared-prompt groups) batched together. `prefixed`: (prefix length P, padded response length Rq, query
    index [m, Rq], key index [m, P + Rq], mask [m, 1, Rq, P + Rq], valid [m * Rq]) per (P, Rq): m responses
    that each attend to their group's P prompt tokens and causally to themselves; a group's responses are
    padded to its longest (the padding queries repeat the response's last token and are dropped, the
    padding keys are masked).
    """

    causal: list[tuple[int, torch.Tensor]]
    prefixed: list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]

    @property
    def single_sequence(self) -> bool:
        return not self.prefixed and len(self.causal) == 1 and self.causal[0][1].numel() == 1


def row_roots(positions: torch.Tensor) -> list[list]:
    """The sequences of a packed row from its text positions [T]: [start, end, prefix length P or None,
    [(response start, length), ...]] per sequence that starts at position 0. A run of consecutive positions
    is a segment; one that starts at 0 is a sequence (or a group's prompt followed by its first response),
    one that starts at P > 0 is a further response of the last sequence that started at 0, whose first P
    tokens it attends to (the shared-prompt layout of `inputs.collate`). Raises ValueError on a row that
    is neither."""
    bounds = sequence_bounds(positions)
    firsts = positions[bounds[:-1]].tolist()
    roots: list[list] = []  # [start, end, prefix length or None, [(response start, length), ...]]
    for a, b, p in zip(bounds[:-1], bounds[1:], firsts, strict=True):
        if p == 0:
            roots.append([a, b, None, []])
            continue
        if not roots or roots[-1][2] not in (None, p) or p > roots[-1][1] - roots[-1][0]:
            raise ValueError(
                f"packed row: a segment at column {a} continues from position {p}, which no prompt before it ends at"
            )
        roots[-1][2] = p
        roots[-1][3].append((a, b - a))
    return roots


def attention_plan(positions: torch.Tensor) -> AttentionPlan:
    """The plan of a packed row from its text positions [T] (its sequences: `row_roots`)."""
    roots = row_roots(positions)
    causal: dict[int, list[int]] = {}
    prefixed: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for a, b, p, responses in roots:
        if p is None:
            causal.setdefault(b - a, []).append(a)
            continue
        causal.setdefault(p, []).append(a)
        if b - a > p:  # the group's first response follows its prompt in one segment
            responses = [(a + p, b - a - p), *responses]
        longest = max(n for _, n in responses)
        prefixed.setdefault((p, longest), []).extend((a, r, n) for r, n in responses)
    device = positions.device
    plan = AttentionPlan([(n, torch.tensor(st, device=device)) for n, st in causal.items()], [])
    for (p, rq), items in prefixed.items():
        prompt, start, length = torch.tensor(items, device=device).unbind(1)  # [m] each
        j = torch.arange(rq, device=device)
        query = start[:, None] + torch.minimum(j[None, :], length[:, None] - 1)  # [m, Rq]
        keys = torch.cat([prompt[:, None] + torch.arange(p, device=device), query], dim=1)  # [m, P + Rq]
        own = (j[None, :] <= j[:, None])[None] & (j[None, None, :] < length[:, None, None])  # [m, Rq, Rq]
        mask = torch.cat([own.new_ones(len(items), rq, p), own], dim=2)[:, None]
        plan.prefixed.append((p, rq, query, keys, mask, (j[None, :] < length[:, None]).flatten()))
    return plan


class LastRow:
    """`build(positions)` for the last packed row, rebuilt only when its text positions change: every
    attention layer of a forward asks again for the same row.

    transformers hands every layer of a forward the same positions tensor: that tensor is recognised without
    reading its values (the same memory, shape and strides, not written since), which on an accelerator would
    make the host wait for the device at every layer (torch.equal returns a Python bool). Holding the tensor
    keeps its memory from being reused by another. Any other tensor is compared by value, once per forward at
    its first layer, so passes over the same row (the old-logprob and reference passes) still share the
    build."""

    def __init__(self, build) -> None:
        self.build, self.positions, self.value = build, None, None
        self.asked, self.asked_version = None, -1  # the tensor last asked about, and its version then

    def __call__(self, positions: torch.Tensor):
        asked = self.asked
        if (
            asked is not None
            and not positions.is_inference()
            and asked.data_ptr() == positions.data_ptr()
            and asked.shape == positions.shape
            and asked.stride() == positions.stride()
            and asked.device == positions.device
            and positions._version == self.asked_version
        ):
            return self.value
        seen = self.positions
        if (
            seen is None
            or seen.shape != positions.shape
            or seen.device != positions.device
            or not torch.equal(seen, positions)
        ):
            self.value, self.positions = self.build(positions), positions.clone()
        inference = positions.is_inference()  # no version counter: never recognised by identity
        self.asked, self.asked_version = (None, -1) if inference else (positions, positions._version)
        return self.value


_cached_plan = LastRow(attention_plan)


FP32_ATTENTION_MAX_KEYS = 512
"""On the CPU, a bf16/fp16 sdpa call over at most this many keys runs in fp32 (see `_cpu_sdpa`)."""


def _cpu_sdpa(module: torch.nn.Module, query, key, value, mask, **kwargs) -> torch.Tensor:
    """transformers' sdpa, [B, T, heads, head_dim] out in the inputs' dtype. On the CPU, bf16/fp16 inputs over
    at most `FP32_ATTENTION_MAX_KEYS` keys are attended in fp32 and the output cast back: the result differs
    from the reduced-precision kernel's by rounding only.

    Why: torch's CPU flash-attention backward is slower in bf16 than in fp32 on the short calls of a packed
    micro-batch (its sequences, or a shared prompt and its responses), on a CPU with AVX-512 BF16 and no AMX.
    Measured there (2 threads): a 55-token prompt plus 4 responses of 64 tokens, 8 heads of 64, forward +
    backward 3.78 ms in bf16, 2.33 ms attended in fp32; in a bf16 update of benchmarks/bare_limit.py's
    workload (benchmarks/step_throughput.py --update-ratio, profiled) the attention backward took 1.48 s of
    7.4 s in bf16 and 0.85 s in fp32, the forward 0.42 s either way. At
    762 keys (a 634-token prompt and 128-token responses) the two are equal (53 and 55 ms), hence the bound.
    """
    dtype = query.dtype
    short = key.shape[2] <= FP32_ATTENTION_MAX_KEYS
    if query.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and short:
        query, key, value = query.float(), key.float(), value.float()
    return sdpa_attention_forward(module, query, key, value, mask, **kwargs)[0].to(dtype)


def is_packed_row(query: torch.Tensor, attention_mask, position_ids, kwargs: dict) -> bool:
    """A forward the packed attention paths take: one causal row with no mask, its sequences told apart by
    `position_ids` alone. Anything else goes to transformers' sdpa unchanged."""
    return (
        attention_mask is None
        and position_ids is not None
        and query.shape[0] == 1
        and bool(kwargs.get("is_causal", True))
    )


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
    length, over the sequences of that length; with shared prompts, one masked sdpa per (prompt length,
    longest response of the group) over those responses (`AttentionPlan`)."""
    if not is_packed_row(query, attention_mask, position_ids, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    plan = _cached_plan(position_ids.reshape(-1))
    if plan.single_sequence:
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)
    outputs, order = [], []
    for n, starts in plan.causal:
        index = (starts[:, None] + torch.arange(n, device=query.device)).flatten()
        # [1, heads, m * n, head_dim] -> [m, heads, n, head_dim]: the m sequences of length n as a batch
        pick = lambda t: t.index_select(2, index).unflatten(2, (len(starts), n)).squeeze(0).transpose(0, 1)  # noqa: E731, B023
        out = _cpu_sdpa(module, pick(query), pick(key), pick(value), None, **kwargs)
        outputs.append(out.flatten(0, 1))  # [m * n, heads, head_dim]
        order.append(index)
    for _, _, q_index, k_index, mask, valid in plan.prefixed:
        # [1, heads, T, head_dim] -> [m, heads, rows of the index, head_dim]
        pick = lambda t, i: t.index_select(2, i.flatten()).unflatten(2, i.shape).squeeze(0).transpose(0, 1)  # noqa: E731
        kw = {k: v for k, v in kwargs.items() if k != "is_causal"}
        out = _cpu_sdpa(
            module,
            pick(query, q_index),
            pick(key, k_index),
            pick(value, k_index),
            mask,
            is_causal=False,
            **kw,
        )
        outputs.append(out.flatten(0, 1)[valid])  # [valid response tokens, heads, head_dim]
        order.append(q_index.flatten()[valid])
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
    `cu_seqlens`); cuda: `flash_attention_2` when the `flash_attn` package imports (else None: the build packs
    through flex attention, `shared_flex`); cpu: `attention.VARLEN_SDPA`, causal sdpa per packed-sequence length.
    Verified here only on CPU (packed vs padded); neither GPU kernel has run in this project.
    """
    if device_type == "npu":
        return "flash_attention_2"
    if device_type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    if device_type == "cpu":
        return VARLEN_SDPA
    return None
