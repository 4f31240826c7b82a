"""Shared-prompt passes of a mixture-of-experts policy give the unshared packed results, routes included.

Tiny random Qwen3-VL-MoE (8 experts, top-2, 2 layers) in fp32 on CPU with the varlen sdpa, text-only groups
(the vision tower is the dense families' and is covered there). Routing replay `old`: the old pass records
each sample's routes in its layout, the routers are then perturbed (as an optimizer step would move them,
so that the replayed experts are not the routers' own choice any more) and the reference pass and the
update replay them; everything must equal the unshared layout: the recorded routes, old and reference
logprobs, the update's logprobs, entropy, loss metrics and every parameter's gradient, and the MoE load and
route-difference counts and the load-balancing loss. Replay `rollout` with a group whose samples disagree on the prompt's routes: the
disagreeing sample holds its own copy of the prompt, and the result is still the unshared one. A shared row
whose routes sit at the wrong tokens must fail the comparison.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spmd_grpo.actor.logprob_pass import compute_logprobs
from spmd_grpo.actor.micro_batches import collate_for, prompt_groups
from spmd_grpo.actor.update import mini_batch_backward
from spmd_grpo.data.samples import Prompt, Sample
from spmd_grpo.models.attention import VARLEN_SDPA
from spmd_grpo.models.moe.install import install_moe, moe_blocks
from spmd_grpo.models.policy import PolicyModule
from tests.conftest import ONE_CPU_RANK
from tests.jobs.common import MOE_TEXT, tiny_moe_model
from tests.unit.test_packing import _run
from tests.unit.test_shared_prompt import BASE, _same

# (prompt length, response lengths) per group, interleaved as DAPO's rebalancing can leave them.
GROUPS = [(9, [5, 1, 7]), (6, [3, 3]), (11, [4]), (7, [6, 2])]
ORDER = [0, 3, 4, 1, 5, 6, 7, 2]  # A B B A C D D A: group A's samples apart


@pytest.fixture(scope="module")
def moe_policy() -> PolicyModule:
    return tiny_moe_policy()


def tiny_moe_policy(family: str = "qwen3_vl_moe") -> PolicyModule:
    hf = tiny_moe_model(family)  # its Gated DeltaNet heads decay moderately (tools.make_tiny_model)
    hf.set_attn_implementation(VARLEN_SDPA)
    policy = PolicyModule(hf, [], chunk_size=5, padding_free=True)
    policy.moe = install_moe(hf, aux_loss_coef=0.01)  # the load-balancing loss in the update, too
    return policy


def moe_samples() -> list[Sample]:
    g = torch.Generator().manual_seed(7)
    ids = lambda n: torch.randint(0, MOE_TEXT["vocab_size"], (n,), generator=g).tolist()  # noqa: E731
    samples = []
    for k, (p, lengths) in enumerate(GROUPS):
        prompt_ids = ids(p)
        prompt = Prompt(k, prompt_ids)
        samples += [Sample(prompt, i, prompt_ids, ids(n), [0.0] * n) for i, n in enumerate(lengths)]
    return [samples[i] for i in ORDER]


def by_group(samples: list[Sample], by_routes: bool = False) -> list[Sample]:
    """The samples group by group, as the passes' micro-batches hold them."""
    return [samples[i] for g in prompt_groups(samples, by_routes=by_routes) for i in g]


def _perturbed_routers(policy: PolicyModule):
    """(perturb, restore) of every router's weight: a fixed relative change of 30 %."""
    gates = [block.gate.weight for _, block in moe_blocks(policy.hf)]
    saved = [w.detach().clone() for w in gates]
    noise = [torch.randn(w.shape, generator=torch.Generator().manual_seed(11)) for w in gates]

    def perturb():
        with torch.no_grad():
            for w, s, n in zip(gates, saved, noise, strict=True):
                w.copy_(s * (1 + 0.3 * n))

    def restore():
        with torch.no_grad():
            for w, s in zip(gates, saved, strict=True):
                w.copy_(s)

    return perturb, restore


def _passes(policy: PolicyModule, samples: list[Sample], spec, shared: bool) -> dict:
    """Old pass (records routes), perturbed routers, reference pass and update (replaying them), and one
    direct forward of all samples in the update layout: everything the comparison reads."""
    policy.shared_prompt = shared
    for s in samples:
        s.routes = None
    policy.moe.take_metrics()
    perturb, restore = _perturbed_routers(policy)
    old = compute_logprobs(policy, samples, spec)
    routes = [s.routes.clone() for s in samples]
    perturb()
    try:
        ref = compute_logprobs(policy, samples, spec, route_pass="ref")
        gen = torch.Generator().manual_seed(5)
        for s, lp, r in zip(samples, old, ref, strict=True):
            s.old_logprobs, s.ref_logprobs = lp, r
            s.rollout_logprobs = (lp - 0.5 * torch.rand(lp.shape, generator=gen)).tolist()
            s.advantage = float(torch.randn((), generator=gen))
        policy.zero_grad(set_to_none=True)
        sums = mini_batch_backward(policy, samples, spec, ONE_CPU_RANK)
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        moe = policy.moe.take_metrics()
        batch = collate_for(policy, by_group(samples), spec, for_update=True)
        weights = torch.rand(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
        forward = _run(policy, batch, weights)
    finally:
        restore()
        policy.shared_prompt = False
    return dict(
        old=old, routes=routes, ref=ref, sums=sums, grads=grads, moe=moe, forward=forward, batch=batch
    )


@pytest.mark.parametrize(
    "family, split",
    [
        ("qwen3_vl_moe", {}),
        ("qwen3_vl_moe", {"micro_batch_size": 3, "experience_micro_batch_size": 3}),
        ("qwen3_5_moe", {}),
    ],
)
def test_moe_shared_prompt_with_routing_replay_old_equals_unshared(moe_policy, family, split):
    """One micro-batch per pass, and fixed counts of 3 that cut group A (its prompt is then routed once per
    part in the old pass, and each part's routes are replayed). Qwen3.5-MoE: hybrid layers, whose Gated
    DeltaNet state after the shared prompt seeds each response (models/linear_attention.py)."""
    if family != "qwen3_vl_moe":
        moe_policy = tiny_moe_policy(family)
    samples = moe_samples()
    spec = dataclasses.replace(BASE, pad_token_id=0, routing_replay="old", **split)
    a, b = (_passes(moe_policy, samples, spec, shared) for shared in (False, True))
    assert b["batch"].shares_prompt.sum() == 4 and a["batch"].shares_prompt is None
    for x, y in zip(a["routes"], b["routes"], strict=True):
        assert torch.equal(x, y)  # [P + R, Y, K] per sample, the same tokens in both layouts
    for key in ("old", "ref"):
        for x, y in zip(a[key], b[key], strict=True):
            torch.testing.assert_close(y, x, atol=1e-5, rtol=0)
    _same(a["forward"], b["forward"])  # logprobs, entropy and every gradient of one replayed forward
    _same((torch.zeros(1), torch.zeros(1), a["grads"]), (torch.zeros(1), torch.zeros(1), b["grads"]))
    assert any(".experts." in n for n in b["grads"]) and any(".gate." in n for n in b["grads"])
    b["sums"].pop("perf/shared_prompt_tokens_saved")
    assert "actor/router_aux_loss" in a["sums"]
    for name in set(a["sums"]) - {"train/num_micro_batches"}:
        torch.testing.assert_close(
            torch.tensor(b["sums"][name]), torch.tensor(a["sums"][name]), atol=1e-5, rtol=1e-5
        )
    assert a["moe"].keys() == b["moe"].keys() >= {"load", "diff/ref", "diff/update"}
    for name in a["moe"]:  # a shared prompt's tokens count once per sample they stand for
        torch.testing.assert_close(b["moe"][name], a["moe"][name], atol=1e-9, rtol=1e-9)
    differing, compared = a["moe"]["diff/update"].tolist()
    assert differing / compared > 0.05  # the update replays experts its routers would not choose


def test_moe_shared_row_with_misplaced_routes_fails_the_comparison(moe_policy):
    """Negative control: the shared row's replayed routes shifted by 3 tokens change the logprobs."""
    samples = moe_samples()
    spec = dataclasses.replace(BASE, pad_token_id=0, routing_replay="old")
    moe_policy.shared_prompt = True
    try:
        compute_logprobs(moe_policy, samples, spec)
        perturb, restore = _perturbed_routers(moe_policy)
        perturb()
        batch = collate_for(moe_policy, by_group(samples), spec, for_update=True)
        weights = torch.ones(batch.response_mask.shape)
        right = _run(moe_policy, batch, weights)[0]
        batch.routes = batch.routes.roll(3, 0)
        wrong = _run(moe_policy, batch, weights)[0]
        restore()
    finally:
        moe_policy.shared_prompt = False
    assert (right - wrong).abs().max() > 1e-3


def test_moe_rollout_routes_that_disagree_on_the_prompt_keep_the_result_unshared(moe_policy):
    """Routes given by the rollout (here: recorded by an unshared old pass of the perturbed routers, the
    last token left out, as vLLM may), one token of the prompt routed differently for group A's second
    sample: it holds its own copy of the prompt, the others share; logprobs, entropy and gradients are the
    unshared ones."""
    samples = moe_samples()
    perturb, restore = _perturbed_routers(moe_policy)
    perturb()
    compute_logprobs(moe_policy, samples, dataclasses.replace(BASE, pad_token_id=0))
    restore()
    for s in samples:
        s.routes = s.routes[:-1]
    odd = samples[3].routes  # group A's second sample (ORDER)
    odd[4, 0, 0] = next(e for e in range(MOE_TEXT["num_experts"]) if e not in odd[4, 0].tolist())
    samples = by_group(samples, by_routes=True)
    spec = dataclasses.replace(BASE, pad_token_id=0, routing_replay="rollout")
    results = {}
    for shared in (False, True):
        moe_policy.shared_prompt = shared
        batch = collate_for(moe_policy, samples, spec, for_update=True)
        weights = torch.rand(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
        results[shared] = (batch, _run(moe_policy, batch, weights))
    moe_policy.shared_prompt = False
    shared_batch = results[True][0]
    # grouped with the odd sample of A apart (groups in order of their first sample): A A | B B | A | C | D D
    assert [s.prompt.uid for s in samples] == [0, 0, 1, 1, 0, 2, 3, 3]
    assert shared_batch.shares_prompt.tolist() == [False, True, False, True, False, False, False, True]
    _same(results[False][1], results[True][1])
