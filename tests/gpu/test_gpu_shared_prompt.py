"""Shared-prompt attention on CUDA (`make test-gpu`): the compiled flex-attention kernel with the shared row's
block mask (models/shared_flex.py) against the gathered masked sdpa (`attention.VARLEN_SDPA`) on the same
device, in fp32: logprobs, entropy and every parameter's gradient of the tiny Qwen2.5-VL (images, trained
tower) and the tiny Qwen3-VL-MoE (replayed routes), over rows of different lengths (one compilation with
dynamic shapes). Then one attention layer of a geometry3k-shaped group (P = 640, n = 8, R = 128, 16 heads,
head dim 128, bf16), both functions forward + backward: time and peak memory printed, flex asserted not
slower. Never run by this project so far (no GPU was available): the tolerances are first estimates; when
this passes, `worker.actor.shared_prompt=auto` can turn on for CUDA (models/build.py `shared_prompt_setup`).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make test-gpu)")


def _compare(policy, batches) -> None:
    from spmd_grpo.models.attention import VARLEN_SDPA
    from spmd_grpo.models.shared_flex import FLEX_SHARED
    from tests.unit.test_packing import _run
    from tests.unit.test_shared_prompt import _same

    for batch in batches:
        batch = batch.to("cuda")
        weights = torch.rand(batch.response_mask.shape, generator=torch.Generator().manual_seed(0)).cuda()
        out = {}
        for name in (VARLEN_SDPA, FLEX_SHARED):
            policy.hf.set_attn_implementation(name)
            out[name] = _run(policy, batch, weights)
        _same(out[VARLEN_SDPA], out[FLEX_SHARED], atol=1e-4)


def test_flex_shared_prompt_equals_gathered_sdpa_on_cuda():
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from spmd_grpo.actor.micro_batches import collate_samples
    from spmd_grpo.models.attention import VARLEN_SDPA
    from spmd_grpo.models.policy import PolicyModule, unsamplable_token_ids
    from tests.conftest import tiny_model
    from tests.unit.test_shared_prompt import GROUPS, group_samples

    d = tiny_model()
    processor = AutoProcessor.from_pretrained(d)
    hf = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32, attn_implementation=VARLEN_SDPA)
    policy = PolicyModule(hf, unsamplable_token_ids(hf.config), 5, padding_free=True).cuda()
    batches = [
        collate_samples(group_samples(processor, groups), 0, packed=True, shared_prompt=shared)
        for groups in (GROUPS, GROUPS[:2])
        for shared in (True, False)
    ]
    _compare(policy, batches)


def test_flex_shared_prompt_equals_gathered_sdpa_for_moe_on_cuda():
    import dataclasses

    from spmd_grpo.actor.logprob_pass import compute_logprobs
    from spmd_grpo.actor.micro_batches import collate_for
    from tests.unit.test_shared_prompt import BASE
    from tests.unit.test_shared_prompt_moe import by_group, moe_samples, tiny_moe_policy

    policy = tiny_moe_policy().cuda()
    policy.shared_prompt = True
    samples = moe_samples()
    spec = dataclasses.replace(BASE, pad_token_id=0, routing_replay="old")
    compute_logprobs(policy, samples, spec)
    _compare(policy, [collate_for(policy, by_group(samples), spec, for_update=True)])


def test_flex_is_faster_than_gathered_sdpa_on_a_geometry3k_group():
    from spmd_grpo.models.attention import varlen_sdpa_forward
    from spmd_grpo.models.shared_flex import flex_shared_forward

    P, n, R, H, Hkv, D = 640, 8, 128, 16, 2, 128
    # the shared row's text positions: prompt + first response, then responses restarting at P
    text = [torch.arange(P + R)] + [torch.arange(P, P + R - 8 * i) for i in range(1, n)]
    positions = torch.cat(text)[None].cuda()
    T = positions.shape[1]
    module = SimpleNamespace(num_key_value_groups=H // Hkv, is_causal=True, training=False)
    make = lambda h: torch.randn(1, h, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v = make(H), make(Hkv), make(Hkv)
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
            outputs[name] = (out.detach().float(), q.grad.float())
            q.grad = k.grad = v.grad = None
    print({k: f"{t * 1e3:.2f} ms, peak {m:.0f} MiB" for k, (t, m) in results.items()}, f"T={T}")
    for a, b in zip(outputs["gathered_sdpa"], outputs["flex"], strict=True):  # bf16 rounding apart
        assert (a - b).norm() <= 2e-2 * a.norm()
    assert results["flex"][0] <= results["gathered_sdpa"][0] * 1.1
