"""Token-budget micro-batches and old logprobs from the update's forward, on an in-process bigram policy.

Balanced partitions against hand-checked sums; the gradient and losses of a mini-batch must not depend on
how it is cut (count-based, token budget, padding micro-batches), and taking the old logprobs detached from
the update's forward must give the same losses and gradient as a separate forward-only pass.
"""

import dataclasses
import random

import pytest
import torch
from torch import nn

from spmd_grpo.actor.logprob_pass import compute_logprobs
from spmd_grpo.actor.micro_batches import (
    balanced_partitions,
    length_sorted_partitions,
    micro_batches,
    padded_part_count,
)
from spmd_grpo.actor.spec import UpdateSpec
from spmd_grpo.actor.update import mini_batch_backward
from spmd_grpo.algorithm.correction import CorrectionSpec
from spmd_grpo.data.samples import Prompt, Sample
from tests.conftest import ONE_CPU_RANK
from tests.unit.bigram import BigramPolicy

RESPONSE_LENGTHS = [9, 1, 4, 0, 12, 2, 3, 7]  # long-tailed, one empty response


def make_samples(spec: UpdateSpec, policy: nn.Module) -> list[Sample]:
    gen = torch.Generator().manual_seed(11)
    samples = []
    for i, n in enumerate(RESPONSE_LENGTHS):
        response = torch.randint(1, 7, (n,), generator=gen).tolist()
        s = Sample(Prompt(uid=i // 2, prompt_token_ids=[]), i % 2, [1, 2 + i % 4], response, [0.0] * n)
        s.advantage = float(torch.randn((), generator=gen))
        samples.append(s)
    for s, lp in zip(samples, compute_logprobs(policy, samples, spec), strict=True):
        s.old_logprobs = lp
        s.ref_logprobs = lp + 0.2
        s.rollout_logprobs = (lp - 0.1).tolist()
    return samples


BASE = UpdateSpec(
    temperature=0.9, pad_token_id=0, max_response_length=12, mini_batch_size=8, micro_batch_size=8,
    experience_micro_batch_size=8, clip_ratio_high=0.28, entropy_coef=0.01, use_kl_loss=True, kl_coef=0.1,
)  # fmt: skip


def backward(policy, samples, spec, **kwargs):
    policy.zero_grad()
    sums = mini_batch_backward(policy, samples, spec, ONE_CPU_RANK, **kwargs)
    return sums, policy.table.grad.clone()


def test_balanced_partitions_by_hand():
    # Largest differencing on {8, 7, 6, 5, 4} into 2 (the textbook case): 8-7 -> 1, 6-5 -> 1, then
    # {4, 1, 1}: 4-1 -> 3, 3-1 -> 2, i.e. {8, 6} / {7, 5, 4} = 14 / 16 (the optimum 15 / 15 is not found).
    parts = balanced_partitions([8, 7, 6, 5, 4], 2)
    assert sorted(sorted([8, 7, 6, 5, 4][i] for i in p) for p in parts) == [[4, 5, 7], [6, 8]]
    assert sorted(i for p in parts for i in p) == [0, 1, 2, 3, 4]
    # More parts than items: the extra parts are empty and come last.
    assert balanced_partitions([3, 1], 3) == [[0], [1], []]
    parts = balanced_partitions([10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2)  # one long sample: alone
    assert sorted(map(len, parts)) == [1, 10]


def test_length_sorted_partitions_by_hand():
    # padded cost = count x longest; the largest is minimised: {5, 7, 20, 100} = 400, {250}, {300}
    assert length_sorted_partitions([5, 300, 20, 250, 100, 7], 3) == [[0, 2, 4, 5], [1], [3]]
    assert length_sorted_partitions([3, 1], 3) == [[0], [1], []]  # every sample in its own part first
    parts = length_sorted_partitions([9, 1, 8, 2, 7, 3], 2)
    assert parts == [[0, 2, 4], [1, 3, 5]]  # the short ones together, not one long in each part


def _padded_cost(lengths: list[int], parts: list[list[int]]) -> int:
    return max(len(p) * max(lengths[i] for i in p) for p in parts if p)


def test_padded_part_count_is_the_fewest_within_the_budget():
    gen = random.Random(3)
    for _ in range(300):
        lengths = [gen.choice([gen.randint(1, 8), gen.randint(1, 300)]) for _ in range(gen.randint(1, 30))]
        budget = gen.randint(max(lengths), sum(lengths) + 1)
        k = padded_part_count(lengths, budget)
        assert _padded_cost(lengths, length_sorted_partitions(lengths, k)) <= budget
        assert k == 1 or _padded_cost(lengths, length_sorted_partitions(lengths, k - 1)) > budget
    assert padded_part_count([50, 60], 40) == 2  # a sample longer than the budget: every sample alone
    assert padded_part_count([], 40) == 0


def test_token_budget_sets_the_number_of_micro_batches():
    samples = make_samples(BASE, BigramPolicy(vocab=7, seed=5))
    tokens = [len(s.prompt_ids) + len(s.response_ids) for s in samples]  # 56 in all
    spec = dataclasses.replace(BASE, dynamic_batching=True, max_token_len_for_update=20)
    plan = micro_batches(samples, spec, for_update=True)
    assert len(plan) == -(-sum(tokens) // 20) == 3
    assert sorted(i for rows in plan for i in rows) == list(range(8))
    sums = sorted(sum(tokens[i] for i in rows) for rows in plan)
    assert sums[-1] - sums[0] <= max(tokens)  # balanced, not first-fit
    huge = dataclasses.replace(spec, max_token_len_for_update=10**6)
    assert micro_batches(samples, huge, for_update=True) == [list(range(8))]
    tiny = dataclasses.replace(spec, max_token_len_for_update=1)  # at most one sample per micro-batch
    assert sorted(map(len, micro_batches(samples, tiny, for_update=True))) == [1] * 8
    # Padded: runs of similar lengths, as few as keep count x longest within the budget. Sorted lengths
    # 2 3 4 5 6 9 11 14: 14 and 11 must be alone (2 x 11 > 20), and 2..9 cannot be one run (6 x 9), so 4
    # parts ({2, 3, 4, 5} = 20, {6, 9} = 18); token sums alone would allow 3 (56 / 20), one padded past 20.
    padded = micro_batches(samples, spec, for_update=True, padded=True)
    assert sorted(i for rows in padded for i in rows) == list(range(8)) and len(padded) == 4
    longest = [max(tokens[i] for i in rows) for rows in padded]
    assert sorted(len(rows) * m for rows, m in zip(padded, longest, strict=True)) == [11, 14, 18, 20]
    padded_tokens = sum(len(rows) * m for rows, m in zip(padded, longest, strict=True))
    balanced = micro_batches(samples, spec, for_update=True)
    balanced_tokens = sum(len(rows) * max(tokens[i] for i in rows) for rows in balanced)
    assert padded_tokens < balanced_tokens


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_gradient_same_with_token_budget(mode):
    policy = BigramPolicy(vocab=7, seed=5)
    base = dataclasses.replace(BASE, loss_agg_mode=mode)
    samples = make_samples(base, policy)
    for s in samples:  # off-policy old logprobs: clipping is active
        s.old_logprobs = s.old_logprobs + 0.3 * torch.sin(
            torch.arange(len(s.old_logprobs), dtype=torch.float32)
        )
    ref_sums, ref_grad = backward(policy, samples, base)
    assert ref_grad.abs().max() > 0
    for budget in (7, 20):
        spec = dataclasses.replace(base, dynamic_batching=True, max_token_len_for_update=budget)
        sums, grad = backward(policy, samples, spec)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
        assert sums["actor/pg_loss"][0] == pytest.approx(ref_sums["actor/pg_loss"][0], rel=1e-5, abs=1e-7)


def test_old_logprobs_from_the_update_forward_are_exact():
    """Same losses, metrics and gradient as a separate forward-only pass (on-policy step), and the samples'
    old logprobs are set to that forward's values."""
    policy = BigramPolicy(vocab=7, seed=5)
    spec = dataclasses.replace(
        BASE, micro_batch_size=4, experience_micro_batch_size=4, old_logprobs_from_update=True
    )
    samples = make_samples(spec, policy)
    separate = [s.old_logprobs.clone() for s in samples]
    sums_sep, grad_sep = backward(policy, samples, spec)
    for s in samples:
        s.old_logprobs = None
    sums_fused, grad_fused = backward(policy, samples, spec, old_from_forward=True)
    assert torch.equal(grad_fused, grad_sep) and grad_sep.abs().max() > 0
    assert sums_fused == sums_sep
    for s, lp in zip(samples, separate, strict=True):
        assert torch.equal(s.old_logprobs, lp)
    assert spec.old_logprobs_in_update(8)
    assert not dataclasses.replace(spec, ppo_epochs=2).old_logprobs_in_update(8)
    assert not spec.old_logprobs_in_update(16)  # two mini-batches: the policy moves in between
    assert not dataclasses.replace(spec, old_logprobs_from_update=False).old_logprobs_in_update(8)
    rs = dataclasses.replace(spec, rollout_correction=CorrectionSpec(rollout_rs="token"))
    assert not rs.old_logprobs_in_update(8)


def test_old_logprobs_from_forward_with_truncated_is():
    """TIS weights computed from the forward's own old logprobs equal those of a separate pass."""
    policy = BigramPolicy(vocab=7, seed=5)
    spec = dataclasses.replace(
        BASE, rollout_correction=CorrectionSpec(rollout_is="token", rollout_is_threshold=1.05)
    )
    samples = make_samples(spec, policy)
    for s in samples:  # vLLM's logprobs further off: some weights are capped
        s.rollout_logprobs = (s.old_logprobs - 0.2 * torch.cos(torch.arange(len(s.old_logprobs)))).tolist()
    sums_sep, grad_sep = backward(policy, samples, spec)
    sums_fused, grad_fused = backward(policy, samples, spec, old_from_forward=True)
    assert torch.equal(grad_fused, grad_sep) and sums_fused == sums_sep


def test_padding_micro_batches_add_nothing():
    """A rank with fewer micro-batches than the agreed count runs zero-weight ones (here forced by a budget
    that asks for more parts than samples): same gradient, counted as forward/backward calls."""
    policy = BigramPolicy(vocab=7, seed=5)
    samples = make_samples(BASE, policy)[:2]
    spec = dataclasses.replace(BASE, micro_batch_size=1)
    sums_ref, grad_ref = backward(policy, samples, spec)
    import spmd_grpo.actor.micro_batches as micro_batches_module

    real = micro_batches_module.all_reduce_max
    micro_batches_module.all_reduce_max = lambda t: t + 3  # as if another rank needed 3 more micro-batches
    try:
        dyn = dataclasses.replace(spec, dynamic_batching=True, max_token_len_for_update=1)
        sums, grad = backward(policy, samples, dyn)
        lps = compute_logprobs(policy, samples, dataclasses.replace(dyn, max_token_len_for_experience=1))
    finally:
        micro_batches_module.all_reduce_max = real
    assert sums["train/num_micro_batches"][0] == 5 and sums_ref["train/num_micro_batches"][0] == 2
    torch.testing.assert_close(grad, grad_ref, rtol=1e-6, atol=0)
    assert sums["actor/pg_loss"][0] == pytest.approx(sums_ref["actor/pg_loss"][0], rel=1e-6)
    for s, lp in zip(samples, lps, strict=True):
        assert torch.equal(lp, s.old_logprobs)
