"""Which Triton kernel inductor lowers the shared row's flex attention to on CUDA (models/shared_flex.py), decided
without a GPU by inductor's own rule on the arguments `flex_shared_forward` passes.

A row shorter than 128 tokens whose query heads per key/value head are a power of two would go to inductor's
flex-decoding kernel, whose default query tile (the next power of two of T x heads per key/value head) has to
divide the 128-token block: a 109-token row of the tiny model (2 query heads, 1 key/value head) leaves it no
configuration, and the compilation fails. The shared row must always get the main kernel.

In this tier rather than tests/unit: importing inductor's lowering costs about half a second.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.attention.flex_attention as torch_flex

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
