"""Group advantages against hand-computed values, and split-across-ranks == single process."""

import math
import threading

import pytest
import torch

from spmd_grpo.algorithm.advantage import (
    compute_batch_std_advantages,
    compute_grpo_advantages,
    group_has_spread,
)
from spmd_grpo.data.samples import Prompt, Sample
from spmd_grpo.telemetry.metrics import sample_metrics

EPS = 1e-6


class ThreadAllReduce:
    """An all_reduce_sum across `world` threads, one per simulated rank; sums in rank order on every rank."""

    def __init__(self, world: int):
        self.barrier = threading.Barrier(world)
        self.slots: list[torch.Tensor | None] = [None] * world

    def for_rank(self, rank: int):
        def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = t.clone()
            self.barrier.wait()
            total = sum(self.slots[1:], self.slots[0].clone())
            self.barrier.wait()  # nobody overwrites a slot before every rank has read it
            return total

        return all_reduce_sum


def run_split(fn, scores, group_index, pieces):
    """Run fn(scores, group_index, all_reduce_sum) on each rank's rows (threads); results in rank order."""
    reducer = ThreadAllReduce(len(pieces))
    results: list = [None] * len(pieces)

    def work(rank):
        rows = pieces[rank]
        results[rank] = fn(scores[rows], group_index[rows], reducer.for_rank(rank))

    threads = [threading.Thread(target=work, args=(r,)) for r in range(len(pieces))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    return results


def test_grpo_hand_computed():
    # group 0: [1, 0, 0.5] -> mean 0.5, squared deviations 0.25 + 0.25 + 0 = 0.5, unbiased var 0.5 / 2 = 0.25,
    #          std 0.5 -> A = [0.5, -0.5, 0] / (0.5 + 1e-6)
    # group 1: [0.9] alone -> verl: mean 0, std 1 -> A = 0.9 / (1 + 1e-6)
    # group 2: [0.1, 0.1, 0.1] all equal -> A = 0
    scores = torch.tensor([1.0, 0.0, 0.5, 0.9, 0.1, 0.1, 0.1])
    group_index = torch.tensor([0, 0, 0, 1, 2, 2, 2])
    adv, metrics = compute_grpo_advantages(scores, group_index, 3)
    expected = [0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS), 0.0, 0.9 / (1 + EPS), 0.0, 0.0, 0.0]
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=0, atol=1e-7)
    # groups with >1 sample: 0 and 2; group 2 is flat -> 1 / 2
    assert metrics == {"adv/zero_std_group_frac": 0.5}


def test_dr_grpo_no_std():
    # A = s - mean: group 0 mean 0.5 -> [0.5, -0.5, 0]; the group of one keeps mean 0 -> 0.9
    scores = torch.tensor([1.0, 0.0, 0.5, 0.9])
    group_index = torch.tensor([0, 0, 0, 1])
    adv, _ = compute_grpo_advantages(scores, group_index, 2, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.9]), rtol=0, atol=1e-7)


def test_all_equal_float64_scores_count_as_zero_spread():
    # In float64, (0.1 + 0.1 + 0.1) / 3 != 0.1, so deviations are ~1e-17, not 0: still a flat group.
    scores = torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64)
    adv, metrics = compute_grpo_advantages(scores, torch.tensor([0, 0, 0]), 1)
    assert adv.abs().max() < 1e-9
    assert metrics["adv/zero_std_group_frac"] == 1.0
    assert group_has_spread(scores, torch.tensor([0, 0, 0]), 1).tolist() == [False]


def reference_grpo(scores, group_index, num_groups):
    """Plain per-group torch computation, verl style (but in float64)."""
    out = torch.empty(len(scores), dtype=torch.float64)
    for g in range(num_groups):
        rows = group_index == g
        s = scores[rows].double()
        if len(s) == 1:
            out[rows] = s / (1 + EPS)
        elif len(s) > 1:
            out[rows] = (s - s.mean()) / (s.std() + EPS)
    return out.float()


@pytest.mark.parametrize("dyadic", [True, False])
def test_grpo_split_across_two_ranks_equals_single_process(dyadic):
    gen = torch.Generator().manual_seed(0)
    num_groups = 5
    # group 4 has one sample (on rank 1), every other group straddles both ranks
    group_index = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 4])
    if dyadic:  # multiples of 1/4: every sum is exact, so the results must be bit-identical
        scores = torch.randint(0, 5, (13,), generator=gen).float() / 4
    else:
        scores = torch.rand(13, generator=gen)
    pieces = [torch.arange(0, 6), torch.arange(6, 13)]

    single, single_metrics = compute_grpo_advantages(scores, group_index, num_groups)
    split = run_split(
        lambda s, g, red: compute_grpo_advantages(s, g, num_groups, all_reduce_sum=red),
        scores,
        group_index,
        pieces,
    )
    joined = torch.cat([split[0][0], split[1][0]])
    if dyadic:
        assert torch.equal(joined, single)
    else:
        torch.testing.assert_close(joined, single, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(single, reference_grpo(scores, group_index, num_groups), rtol=1e-6, atol=1e-6)
    # the metric comes from global statistics, so every rank reports the single-process value
    assert split[0][1] == split[1][1] == single_metrics


def test_batch_std_hand_computed():
    # scores [1, 0 | 1, 1], group means 0.5 and 1.
    # batch mean 0.75; squared deviations 0.0625 + 0.5625 + 0.0625 + 0.0625 = 0.75; unbiased var 0.75 / 3 = 0.25
    # -> batch std 0.5; A = [0.5, -0.5, 0, 0] / (0.5 + 1e-6)
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    group_index = torch.tensor([0, 0, 1, 1])
    adv, metrics = compute_batch_std_advantages(scores, group_index, 2)
    expected = torch.tensor([0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS), 0.0, 0.0])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-7)
    assert metrics == {"adv/zero_std_group_frac": 0.5, "adv/batch_std": pytest.approx(0.5, abs=1e-12)}


def test_batch_std_split_matches_torch_std():
    gen = torch.Generator().manual_seed(1)
    scores = torch.rand(10, generator=gen)
    group_index = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 3])  # group 3 is a group of one: mean 0
    pieces = [torch.arange(0, 4), torch.arange(4, 10)]
    split = run_split(
        lambda s, g, red: compute_batch_std_advantages(s, g, 4, all_reduce_sum=red),
        scores,
        group_index,
        pieces,
    )
    group_mean = torch.stack(
        [scores[group_index == g].double().mean() for g in range(3)] + [torch.tensor(0.0)]
    )
    expected = (scores.double() - group_mean[group_index]) / (scores.double().std() + EPS)
    torch.testing.assert_close(torch.cat([split[0][0], split[1][0]]), expected.float(), rtol=1e-6, atol=1e-7)
    assert split[0][1]["adv/batch_std"] == pytest.approx(float(scores.double().std()), rel=1e-12)


def test_group_has_spread_dapo_rules():
    # group 0: [1, 0] spread -> keep; group 1: [1, 1] flat -> drop; group 2: one sample -> keep;
    # group 3: no samples anywhere -> nothing to keep
    values = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    group_index = torch.tensor([0, 0, 1, 1, 2])
    assert group_has_spread(values, group_index, 4).tolist() == [True, False, True, False]


def test_group_has_spread_split_across_ranks():
    # group 0 is [1 | 1] (flat only when seen globally), group 1 is [0 | 1] (spread only when seen globally)
    values = torch.tensor([1.0, 0.0, 1.0, 1.0])
    group_index = torch.tensor([0, 1, 0, 1])
    results = run_split(
        lambda v, g, red: group_has_spread(v, g, 2, red),
        values,
        group_index,
        [torch.tensor([0, 1]), torch.tensor([2, 3])],
    )
    assert results[0].tolist() == results[1].tolist() == [False, True]


def test_invalid_group_index_raises():
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        compute_grpo_advantages(torch.zeros(2), torch.tensor([0, 2]), 2)
    with pytest.raises(ValueError, match="shape|expected"):
        compute_grpo_advantages(torch.zeros(2), torch.tensor([0]), 2)


def test_no_multi_sample_groups_gives_zero_fraction():
    _, metrics = compute_grpo_advantages(torch.tensor([0.3]), torch.tensor([0]), 1)
    assert metrics["adv/zero_std_group_frac"] == 0.0
    assert not math.isnan(metrics["adv/zero_std_group_frac"])


def test_logged_advantage_mean_is_over_response_tokens_as_verl():
    # verl's critic/advantages/mean is the mean over valid response tokens (masked_select of the token-level
    # advantages), so a long response weighs more: here (3 x 1.0 + 1 x -1.0) / 4 = 0.5, where a mean over
    # samples would give 0.
    prompt = Prompt(uid=0, prompt_token_ids=[])
    samples = [Sample(prompt, 0, [7], [1, 2, 3], [-0.1] * 3), Sample(prompt, 1, [7], [4], [-0.2])]
    for s, a in zip(samples, (1.0, -1.0), strict=True):
        s.advantage, s.scores = a, {"overall": a}
        s.old_logprobs = torch.tensor(s.rollout_logprobs)
    m = sample_metrics(samples, max_response_length=3)
    assert m["critic/advantages/mean"] == pytest.approx(0.5)
    assert (m["critic/advantages/max"], m["critic/advantages/min"]) == (1.0, -1.0)
    assert m["critic/score/mean"] == pytest.approx(0.0)  # scores stay per sample, as verl's
    for s in samples:  # no response token in the batch: 0, not the -inf / inf of an empty max / min
        s.response_ids, s.rollout_logprobs, s.old_logprobs = [], [], torch.zeros(0)
    m = sample_metrics(samples, max_response_length=3)
    assert (m["critic/advantages/max"], m["critic/advantages/min"]) == (0.0, 0.0)


def test_batch_std_of_equal_scores_uses_one_for_groups_of_one():
    # rollout.n = 1 (every group of one) and every score 0.1: the batch std is 0. Groups of one keep the
    # numerator s (mean 0), so dividing by 0 + eps gave A = 0.1 / 1e-6 = 1e5; std 1 gives GRPO's s / (1 + eps).
    # Group 2 ([0.1, 0.1]) is flat and stays at 0.
    scores = torch.tensor([0.1, 0.1, 0.1, 0.1])
    group_index = torch.tensor([0, 1, 2, 2])
    adv, metrics = compute_batch_std_advantages(scores, group_index, 3)
    grpo, _ = compute_grpo_advantages(scores[:2], group_index[:2], 2)
    torch.testing.assert_close(adv, torch.cat([grpo, torch.zeros(2)]), rtol=0, atol=1e-7)
    assert metrics["adv/batch_std"] == 1.0
