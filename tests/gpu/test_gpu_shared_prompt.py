"""Shared-prompt attention on CUDA (`make test-gpu`): the compiled flex-attention kernel with the shared row's
block mask (models/shared_flex.py) and the gathered masked sdpa (`attention.VARLEN_SDPA`), both fp32, each
measured against the same policy in float64 (gathered sdpa, transformers' torch Gated DeltaNet): logprobs,
entropy and every parameter's gradient of a fixed weighted sum, and flex must be within 4x of the sdpa's
distance (or 1e-5). Two fp32 kernels that reduce in different orders differ by ~1e-4 in a gradient (more where
cuDNN's default TF32 convolution runs the vision tower's patch embedding), which a direct comparison cannot
tell from a small error; a token that sees the wrong keys is orders of magnitude further from float64 (plain
sdpa on the shared row, on the CPU: logprobs 0.30 off against 4.8e-7). Cases: the tiny Qwen2.5-VL (images,
trained tower) over shared and unshared rows of different lengths (one compilation with dynamic shapes; the
109-token row is shorter than a 128-token block: without `shared_flex.KERNEL_OPTIONS` inductor lowers it to
flex decoding, and its compilation fails); the tiny Qwen3-VL-MoE and Qwen3.5-MoE (replayed routes); the
hybrid Qwen3.5-MoE's shared layout (each prompt's final Gated DeltaNet state seeding its responses,
flash-linear-attention where installed, whose Triton kernels compute fp32 in TF32) against its unshared layout. Then one attention layer of a geometry3k-shaped
group (P = 640, n = 8, R = 128, 16 heads, head dim 128, bf16), forward + backward: time and peak memory
printed, flex asserted not slower. `worker.actor.shared_prompt=auto` shares on CUDA because every test here
passed on a GPU (models/build.py `shared_prompt_setup`); what has run: docs/models.md, Devices.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make test-gpu)")


def _errors(out, ref) -> tuple[float, float, float]:
    """(max |logprob difference|, max |entropy difference|, worst relative error of a parameter's gradient)."""
    (lp, ent, grads), (lp_ref, ent_ref, grads_ref) = out, ref
    assert grads.keys() == grads_ref.keys() and len(grads) > 10
    worst = max(((g.double() - grads_ref[n]).norm() / grads_ref[n].norm().clamp(min=1e-30)).item()
                for n, g in grads.items())  # fmt: skip
    return (lp - lp_ref).abs().max().item(), (ent - ent_ref).abs().max().item(), worst


@contextmanager
def _torch_delta_rule():
    """transformers' torch Gated DeltaNet functions (chunked, and recurrent for one-token continuations) in
    place of flash-linear-attention's kernels, for the float64 runs."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen3_5_moe

    names = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
    kernels = {name: getattr(qwen3_5_moe, name) for name in names}
    for name, kernel in kernels.items():
        setattr(qwen3_5_moe, name, inspect.unwrap(kernel))
    try:
        yield
    finally:
        for name, kernel in kernels.items():
            setattr(qwen3_5_moe, name, kernel)


def _against_float64(policy, exact, runs: dict, reference) -> dict:
    """{label: `_errors`} of each run (attention, batch, shared) of the fp32 `policy` against `exact` (the same
    policy in float64) on `reference` (batch, shared) with the gathered sdpa and transformers' torch delta
    rule, for the same weighted sum of logprobs and entropy (`_run`)."""
    from spmd_grpo.models.attention import VARLEN_SDPA
    from tests.unit.test_packing import _run

    exact.hf.set_attn_implementation(VARLEN_SDPA)
    batch, exact.shared_prompt = reference
    weights = torch.rand(batch.response_mask.shape, generator=torch.Generator().manual_seed(0)).cuda()
    with _torch_delta_rule():
        ref = _run(exact, batch, weights)
    out = {}
    for label, (attention, batch, shared) in runs.items():
        policy.hf.set_attn_implementation(attention)
        policy.shared_prompt = shared
        out[label] = _errors(_run(policy, batch, weights), ref)
    return out


def _as_exact(errors: dict, label: str, baseline: str) -> None:
    """`label` is within 4x of `baseline`'s distance from float64 (or 1e-5) in all three measures."""
    print(
        {k: "logprobs {:.1e}, entropy {:.1e}, gradients {:.1e}".format(*v) for k, v in errors.items()},
        flush=True,
    )
    for measure, mine, theirs in zip(
        ("logprobs", "entropy", "gradients"), errors[label], errors[baseline], strict=True
    ):
        assert mine <= max(4 * theirs, 1e-5), (measure, errors)


def _compare(policy, exact, batches, baseline: float = 1e-3) -> None:
    """Flex attention against the gathered sdpa on each batch, both fp32, against float64; the sdpa's own
    gradient error at most `baseline`."""
    from spmd_grpo.models.attention import VARLEN_SDPA
    from spmd_grpo.models.shared_flex import FLEX_SHARED

    for batch in batches:
        batch = batch.to("cuda")
        # flushed: a run cut off by a time limit keeps what was printed, and an error names its row
        print(f"row of {batch.input_ids.shape[1]} tokens", flush=True)
        runs = {name: (name, batch, True) for name in (VARLEN_SDPA, FLEX_SHARED)}
        errors = _against_float64(policy, exact, runs, (batch, True))
        _as_exact(errors, FLEX_SHARED, VARLEN_SDPA)
        assert errors[VARLEN_SDPA][2] <= baseline


def test_flex_shared_prompt_equals_gathered_sdpa_on_cuda():
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from spmd_grpo.actor.micro_batches import collate_samples
    from spmd_grpo.models.attention import VARLEN_SDPA
    from spmd_grpo.models.policy import PolicyModule, unsamplable_token_ids
    from tests.conftest import tiny_model
    from tests.unit.test_shared_prompt import GROUPS, group_samples

    d = tiny_model()
    processor = AutoProcessor.from_pretrained(d)
    policy, exact = (
        PolicyModule(hf, unsamplable_token_ids(hf.config), 5, padding_free=True).to("cuda", dtype)
        for dtype in (torch.float32, torch.float64)
        for hf in [AutoModelForImageTextToText.from_pretrained(d, attn_implementation=VARLEN_SDPA)]
    )
    batches = [
        collate_samples(group_samples(processor, groups), 0, packed=True, shared_prompt=shared)
        for groups in (GROUPS, GROUPS[:2])
        for shared in (True, False)
    ]
    _compare(policy, exact, batches)


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_flex_shared_prompt_equals_gathered_sdpa_for_moe_on_cuda(family):
    import dataclasses

    from spmd_grpo.actor.logprob_pass import compute_logprobs
    from spmd_grpo.actor.micro_batches import collate_for
    from tests.unit.test_shared_prompt import BASE
    from tests.unit.test_shared_prompt_moe import by_group, moe_samples, tiny_moe_policy

    policy, exact = tiny_moe_policy(family).cuda(), tiny_moe_policy(family).to("cuda", torch.float64)
    policy.shared_prompt = True
    samples = moe_samples()
    spec = dataclasses.replace(BASE, pad_token_id=0, routing_replay="old")
    compute_logprobs(policy, samples, spec)
    batch = collate_for(policy, by_group(samples), spec, for_update=True)
    hybrid = family == "qwen3_5_moe"  # flash-linear-attention's Triton kernels compute fp32 in tf32
    _compare(policy, exact, [batch], 5e-2 if hybrid else 1e-3)


def test_hybrid_shared_prompt_equals_unshared_on_cuda():
    """Qwen3.5-MoE's Gated DeltaNet layers with the kernels transformers picks on CUDA (flash-linear-attention
    where it imports): each prompt once, its final state seeding its responses (models/linear_attention.py),
    through flex attention, as close to exact arithmetic as every sample whole through the packed sdpa; the
    routes replayed."""
    import dataclasses

    from transformers.utils.import_utils import is_flash_linear_attention_available

    from spmd_grpo.actor.logprob_pass import compute_logprobs
    from spmd_grpo.actor.micro_batches import collate_for
    from spmd_grpo.models.attention import VARLEN_SDPA
    from spmd_grpo.models.shared_flex import FLEX_SHARED
    from tests.unit.test_shared_prompt import BASE
    from tests.unit.test_shared_prompt_moe import by_group, moe_samples, tiny_moe_policy

    policy, exact = (
        tiny_moe_policy("qwen3_5_moe").to("cuda", dtype) for dtype in (torch.float32, torch.float64)
    )
    samples = by_group(moe_samples())
    spec = dataclasses.replace(BASE, pad_token_id=0, routing_replay="old")
    compute_logprobs(policy, samples, spec)
    batches = {}
    for shared in (False, True):
        policy.shared_prompt = shared
        batches[shared] = collate_for(policy, samples, spec, for_update=True)
    assert batches[True].input_ids.shape[1] < batches[False].input_ids.shape[1]
    runs = {"unshared": (VARLEN_SDPA, batches[False], False), "shared": (FLEX_SHARED, batches[True], True)}
    print(f"flash-linear-attention: {is_flash_linear_attention_available()}")
    _as_exact(_against_float64(policy, exact, runs, (batches[False], False)), "shared", "unshared")


def test_flex_is_faster_than_gathered_sdpa_on_a_geometry3k_group():
    from benchmarks.shared_flex import measure

    T, results, outputs = measure(P=640, n=8, R=128, H=16, Hkv=2, D=128)
    print({k: f"{t * 1e3:.2f} ms, peak {m:.0f} MiB" for k, (t, m) in results.items()}, f"T={T}")
    for a, b in zip(outputs["gathered_sdpa"], outputs["flex"], strict=True):  # bf16 rounding apart
        assert (a - b).norm() <= 2e-2 * a.norm()
    assert results["flex"][0] <= results["gathered_sdpa"][0] * 1.1
