"""The shared-prompt attention for accelerators: torch flex attention with a block mask over the packed row.

Shapes: T tokens of one packed row, H query heads, Hkv key/value heads, D head dim, blocks of 128 x 128.

The row is the one `inputs.collate` builds and `attention.row_roots` reads from the text positions: each
group's prompt once, its first response right after it, its further responses after that, each
restarting its text positions at the prompt length P. Each token gets three numbers (`shared_row_layout`):
its document (the sequence or group it belongs to), its segment (the run of consecutive positions: the
prompt with the first response, or one further response) and its prefix end (the column where its group's
prompt ends). A query q sees a key k iff

    document[q] == document[k] and k <= q and (segment[q] == segment[k] or k < prefix_end[q])

that is, its own segment causally and its group's prompt. A packed row without shared prompts is the same
rule with one segment per sequence (block-diagonal causal). `create_block_mask` turns the rule into a
`BlockMask` once per forward (every layer reuses it); `flex_attention` then computes only the 128 x 128
blocks the mask touches, evaluates the rule element-wise on the partial ones, and skips the rest.

Cost per layer and group (prompt P, n responses of length R, compared with the CPU formulation of
`attention.VARLEN_SDPA`, which gathers the prompt's keys and values for each response and runs a masked
sdpa over [prompt keys; own keys]):
  * scores: P^2 / 2 + n R P + n R^2 / 2, rounded up to whole blocks (a response shorter than a block
    still costs the blocks it overlaps: up to two query blocks x (P / 128 + 2) key blocks); the gathered
    sdpa computes n Rq (P + Rq) with Rq the group's longest response (the padding of shorter ones too).
  * memory: no copy of the prompt's keys and values (the gathered sdpa holds n x P x Hkv x D of each per
    layer for the backward: Qwen2.5-VL-7B, P = 1024, n = 8, bf16: 32 MiB per layer), no [Rq, P + Rq]
    boolean mask per response; the block mask is O((T / 128)^2) block indices per forward, built from the
    rule evaluated over T x T positions once (compiled on accelerators).
  * kernel: one fused call per layer for the whole row (the gathered sdpa: one call per distinct length
    and per (P, Rq), with an explicit mask, which rules out the flash kernel inside torch's sdpa).

Where it runs: `shared_prompt_attention` picks it on CUDA, compiled (`torch.compile(flex_attention,
dynamic=True)`, one graph for every row length of a kind of call; tests/gpu/test_gpu_shared_prompt.py measures
it and the gathered sdpa against float64 and times both; docs/models.md, Devices, says what has run on a GPU),
always with flex attention's main kernel (`KERNEL_OPTIONS`): for a row shorter than 128 tokens whose query
heads per key/value head are a power of two, inductor would otherwise lower the forward to its flex-decoding
kernel, whose default query tile (the next power of two of T x query heads per key/value head) must divide the
128-token block; past 128 no configuration is left and the compilation fails (torch 2.13's lowering:
NoValidChoicesError for a 109-token row with 2 query heads per key/value head).

Compiled graphs (`RECOMPILE_LIMIT`): dynamo keeps one graph of flex attention per kind of call and recompiles
for each new kind, and past its process-wide limit of 8 graphs per function it runs the function uncompiled
from then on, with a single log line: flex attention unfused holds the whole [H, T, T] score matrix (a
16k-token row with 28 heads: 30 GB in fp32), an out-of-memory error minutes into a run. The kinds, counted on
the CPU over the passes' calls (dynamo's own guards; tests/distributed/test_shared_flex_kernel.py): grad mode
(the logprob passes run without, the update with), the dtype (a reference in another `worker.ref.dtype` than
the policy's param_dtype), which inputs require grad (a LoRA adapter on q_proj and v_proj only: the first
layer's keys do not), and a row of one 128-token block against a longer one (dynamo specialises a size of 1);
on CUDA inductor's kernel choice adds a guard T < 128 (a row of exactly 128 tokens). That is 8 graphs with an
fp32 reference and such adapters on the CPU, 12 on CUDA: past 8. Both compiled functions therefore run under
their own limit and `fullgraph=True`, which makes dynamo raise instead of falling back; the error names the
setting that avoids flex attention (padded batches). The global limit, which the in-process vLLM engine also
reads, is unchanged. The block mask is built without autograd (integer block indices: grad mode would double
its graphs).

On the CPU torch runs flex attention's forward unfused (the full score matrix) and refuses its backward, so
the CPU keeps `attention.VARLEN_SDPA`; the CPU tests run this function's forward for real and its backward
through torch's reference (math) implementation. torch_npu has no flex kernel: Ascend keeps the gathered
sdpa. Calls without text positions (the vision tower) or with an attention mask (a padded batch) go to
transformers' sdpa unchanged.
"""

from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from spmd_grpo.models.attention import VARLEN_SDPA, LastRow, is_packed_row, row_roots, varlen_sdpa_mask

FLEX_SHARED = "flex_shared"


def shared_prompt_attention(device_type: str) -> str:
    """The transformers `attn_implementation` that computes the shared-prompt layout on `device_type`:
    flex attention with a block mask on CUDA (`FLEX_SHARED`), the gathered masked sdpa elsewhere
    (`attention.VARLEN_SDPA`: the CPU, whose flex attention has no backward, and Ascend, which has none)."""
    return FLEX_SHARED if device_type == "cuda" else VARLEN_SDPA


def shared_row_layout(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(document, segment, prefix end), [T] long each, of a packed row's text positions [T] (module
    docstring)."""
    document, segment, prefix_end = (torch.empty(positions.numel(), dtype=torch.long) for _ in range(3))
    runs = 0
    for d, (start, end, prefix, responses) in enumerate(row_roots(positions.cpu())):
        for a, b in [(start, end), *((r, r + n) for r, n in responses)]:
            document[a:b], segment[a:b], prefix_end[a:b] = d, runs, start + (prefix or 0)
            runs += 1
    return tuple(t.to(positions.device) for t in (document, segment, prefix_end))


def shared_row_mask_mod(positions: torch.Tensor):
    """flex attention's `mask_mod` (batch, head, query index, key index) -> visible, for the packed row
    of `positions` [T]."""
    document, segment, prefix_end = shared_row_layout(positions)

    def mask_mod(b, h, q, k):
        own = segment[q] == segment[k]
        return (document[q] == document[k]) & (k <= q) & (own | (k < prefix_end[q]))

    return mask_mod


KERNEL_OPTIONS = {"FORCE_USE_FLEX_ATTENTION": True}
"""flex attention's kernel options: its main kernel for every row length, never flex decoding (module
docstring). vLLM's flex-attention backend passes the same option."""

COMPILED_ON = ("cuda",)
"""Device types whose flex attention is compiled into fused kernels; elsewhere (the CPU) it runs unfused."""

RECOMPILE_LIMIT = 32
"""Graphs each of the two compiled functions (flex attention, the block mask) may hold in one process: the
kinds of call the module docstring lists, 12 at most on CUDA, with room for a change of the global state
dynamo guards on (TF32, the thread count). One more raises (`_within_limit`) instead of running flex
attention unfused."""

_compiled: dict = {}


def _compile(name: str, fn):
    """`fn` compiled once per process with dynamic shapes, one graph per call (`fullgraph`)."""
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, dynamic=True, fullgraph=True)
    return _compiled[name]


def _within_limit(compiled, *args, **kwargs):
    """`compiled(*args, **kwargs)` with at most `RECOMPILE_LIMIT` graphs for its function; one more raises
    (module docstring)."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    try:
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return compiled(*args, **kwargs)
    except FailOnRecompileLimitHit as e:
        raise RuntimeError(
            f"packed-row flex attention needed more than {RECOMPILE_LIMIT} compiled graphs of "
            f"{getattr(compiled, '__name__', compiled)} in this process (TORCH_LOGS=recompiles names the guards "
            "that failed); unfused, it would hold each row's whole score matrix. Set "
            "worker.actor.padding_free=false to run padded batches through sdpa instead"
        ) from e


def _build_block_mask(positions: torch.Tensor):
    from torch.nn.attention.flex_attention import create_block_mask

    n = positions.numel()
    args = (shared_row_mask_mod(positions), None, None, n, n)
    if positions.device.type not in COMPILED_ON:
        return create_block_mask(*args, device=positions.device)
    with torch.no_grad():  # block indices: no autograd, one graph for every pass
        return _within_limit(_compile("block_mask", create_block_mask), *args, device=positions.device)


_block_mask = LastRow(_build_block_mask)


def _flex(device_type: str):
    """flex attention: compiled on accelerators (fused kernels; `_within_limit`), eager on the CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    if device_type not in COMPILED_ON:
        return flex_attention
    return functools.partial(_within_limit, _compile("flex", flex_attention))


def flex_shared_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (query [1, H, T, D], key/value [1, Hkv, T, D]); returns
    [1, T, H, D]. One packed row with no mask: flex attention over the row's block mask; anything else:
    transformers' sdpa."""
    if not is_packed_row(query, attention_mask, position_ids, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if kwargs.get("dropout", 0.0):
        raise NotImplementedError("attention dropout with shared-prompt flex attention")
    out = _flex(query.device.type)(
        query,
        key,
        value,
        block_mask=_block_mask(position_ids.reshape(-1)),
        scale=kwargs.get("scaling"),
        enable_gqa=query.shape[1] != key.shape[1],
        kernel_options=KERNEL_OPTIONS,
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(FLEX_SHARED, flex_shared_forward)
AttentionMaskInterface.register(FLEX_SHARED, varlen_sdpa_mask)
