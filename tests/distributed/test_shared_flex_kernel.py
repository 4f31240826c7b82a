"""How the shared row's flex attention compiles on CUDA (models/shared_flex.py), decided without a GPU: which
Triton kernel inductor lowers it to (inductor's own rule on the arguments `flex_shared_forward` passes), and
how many graphs dynamo keeps over the passes' calls (dynamo's own guards, traced on the CPU).

A row shorter than 128 tokens whose query heads per key/value head are a power of two would go to inductor's
flex-decoding kernel, whose default query tile (the next power of two of T x heads per key/value head) has to
divide the 128-token block: a 109-token row of the tiny model (2 query heads, 1 key/value head) leaves it no
configuration, and the compilation fails. The shared row must always get the main kernel.

Graphs: past a function's recompile limit dynamo would run flex attention unfused (the whole score matrix of a
row, an out-of-memory error on a long one). Over old-logprob, reference and update calls on rows of one block
and of several, a reference in fp32, and a first layer whose keys need no grad (LoRA on q_proj and v_proj),
flex attention keeps 8 graphs and the block mask 2 (built without autograd); one kind of call past the limit
raises.

In this tier rather than tests/unit: importing inductor's lowering costs about half a second, tracing the
graphs a few seconds.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex

from spmd_grpo.models import shared_flex
from spmd_grpo.models.attention import LastRow
from spmd_grpo.models.shared_flex import flex_shared_forward


def test_a_row_shorter_than_one_block_lowers_to_the_main_flex_kernel(monkeypatch):
    from torch._inductor.kernel.flex.flex_decoding import _use_flex_decoding
    from torch._inductor.sizevars import SizeVarAllocator
    from torch._inductor.virtualized import V

    calls, real = [], torch_flex.flex_attention

    def recorded(query, key, value, **kwargs):
        calls.append((query.shape, key.shape, kwargs))
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(torch_flex, "flex_attention", recorded)
    # a prompt of 60 tokens with its first response (20), then responses of 15 and 14 restarting at 60
    positions = torch.cat([torch.arange(80), torch.arange(60, 75), torch.arange(60, 74)])[None]
    T, H, Hkv, D = positions.shape[1], 2, 1, 32
    module = SimpleNamespace(num_key_value_groups=H // Hkv, is_causal=True, training=False)
    q, k, v = (torch.randn(1, h, T, D) for h in (H, Hkv, Hkv))
    flex_shared_forward(module, q, k, v, None, position_ids=positions, scaling=D**-0.5)
    [(q_shape, k_shape, kwargs)] = calls
    assert T == 109 and kwargs["block_mask"].seq_lengths == (T, T)

    def flex_decoding(kernel_options: dict) -> bool:
        """Inductor's choice for this call: flex decoding (True) or the main flex-attention kernel."""
        sizes = lambda shape: SimpleNamespace(get_size=lambda: list(shape))  # noqa: E731
        with V.set_graph_handler(SimpleNamespace(sizevars=SizeVarAllocator())):
            return _use_flex_decoding(
                sizes(q_shape),
                sizes(kwargs["block_mask"].kv_indices.shape),
                sizes(k_shape),
                kernel_options,
                kwargs["enable_gqa"],
            )

    assert flex_decoding({})  # what the row would get without the option
    assert not flex_decoding(kwargs.get("kernel_options") or {})


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    """`flex_shared_forward`'s compiled path on the CPU, traced by dynamo and run by its eager backend (CPU
    inductor compiles no flex backward), torch's refusal of the CPU backward lifted; fresh dynamo caches."""
    monkeypatch.setattr(shared_flex, "COMPILED_ON", ("cpu",))
    monkeypatch.setattr(shared_flex, "_compiled", {})
    monkeypatch.setattr(shared_flex, "_block_mask", LastRow(shared_flex._build_block_mask))
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    monkeypatch.setattr(torch_flex, "_validate_device", lambda *_: None)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _graphs(fn) -> int:
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(fn.__code__))


def test_the_passes_calls_fit_the_compiled_functions_limit_and_one_more_kind_raises(
    compiled_on_cpu, monkeypatch
):
    H, Hkv, D, limit = 4, 2, 32, torch._dynamo.config.recompile_limit
    module = SimpleNamespace(num_key_value_groups=H // Hkv, is_causal=True, training=False)

    def attend(positions, dtype, *, grad, key_grad=True):
        T = positions.numel()
        q, k, v = (torch.randn(1, h, T, D, dtype=dtype) for h in (H, Hkv, Hkv))
        for t in (q, k, v) if key_grad else (q, v):
            t.requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            out = flex_shared_forward(module, q, k, v, None, position_ids=positions[None], scaling=D**-0.5)[0]
            if grad:
                out.float().sum().backward()

    # shared rows of one 128-token block and of several: a prompt with its first response, then responses
    # restarting at the prompt length; the update's micro-batches are not the logprob passes'
    row = lambda P, n, R: torch.cat([torch.arange(P + R), *(torch.arange(P, P + R - i) for i in range(1, n))])  # noqa: E731
    for passes, update in ((row(60, 3, 20), row(50, 3, 20)), (row(200, 3, 70), row(190, 3, 80))):
        with torch.no_grad():
            attend(passes, torch.bfloat16, grad=False)  # old logprobs
            attend(passes, torch.float32, grad=False)  # reference in worker.ref.dtype=float32
        attend(update, torch.bfloat16, grad=True)
        attend(update, torch.bfloat16, grad=True, key_grad=False)  # its first layer with LoRA on q, v
    assert (_graphs(torch_flex.flex_attention), _graphs(torch_flex.create_block_mask)) == (8, 2)
    assert torch._dynamo.config.recompile_limit == limit  # the process-wide limit, untouched

    monkeypatch.setattr(shared_flex, "RECOMPILE_LIMIT", 8)
    with pytest.raises(RuntimeError, match="worker.actor.padding_free=false"), torch.no_grad():
        attend(row(200, 3, 70), torch.float16, grad=False)  # a ninth kind: dynamo would run it unfused
