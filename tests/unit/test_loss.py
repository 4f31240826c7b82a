"""KL kinds, global aggregation and PPO/dual-clip/GSPO losses against hand-computed values."""

import math

import pytest
import torch

from spmd_grpo.algorithm.loss import AGG_MODES, aggregate, kl_penalty, policy_loss

CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}


def agg_counts(mask: torch.Tensor, max_response_length: int | None = None) -> dict:
    mask = mask.bool()
    return {
        "num_global_tokens": int(mask.sum()),
        "num_global_seqs": int((mask.sum(-1) > 0).sum()),
        "max_response_length": max_response_length or mask.shape[1],
    }


# ---- KL -----------------------------------------------------------------------------------------------------


def test_kl_kinds_hand_computed():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.5]])
    # delta = logp - ref = [0.5, -0.5]
    assert kl_penalty(logp, ref, "kl").tolist() == [[0.5, -0.5]]
    assert kl_penalty(logp, ref, "abs").tolist() == [[0.5, 0.5]]
    assert kl_penalty(logp, ref, "mse").tolist() == [[0.125, 0.125]]  # 0.5 * 0.25
    # k3 with k = -delta: [exp(-0.5) + 0.5 - 1, exp(0.5) - 0.5 - 1] = [0.10653066, 0.14872127]
    expected = [[math.exp(-0.5) + 0.5 - 1, math.exp(0.5) - 0.5 - 1]]
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), torch.tensor(expected))


def test_low_var_kl_is_clamped():
    # delta = -30 -> k = clamp(30, -20, 20) = 20 -> exp(20) - 21 ~ 4.85e8 -> clamp to 10
    # delta = +30 -> k = -20 -> exp(-20) + 20 - 1 ~ 19 -> clamp to 10
    out = kl_penalty(torch.tensor([[-31.0, -1.0]]), torch.tensor([[-1.0, -31.0]]), "low_var_kl")
    assert out.tolist() == [[10.0, 10.0]]
    # The inner clamp is what keeps the gradient finite: without it exp(100) = inf and 0 * inf = nan.
    logp = torch.tensor([[-101.0]], requires_grad=True)
    kl_penalty(logp, torch.tensor([[-1.0]]), "low_var_kl").sum().backward()
    assert torch.equal(logp.grad, torch.zeros(1, 1))


def test_unknown_kl_kind_names_it():
    with pytest.raises(ValueError, match="'k4'"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


# ---- aggregation --------------------------------------------------------------------------------------------


def test_aggregate_modes_hand_computed():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), float("inf")]])  # padding may hold garbage
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    counts = agg_counts(mask)  # 4 tokens, 2 sequences, max length 3
    # token-mean: (1 + 2 + 3 + 4) / 4 = 2.5
    assert aggregate(values, mask, "token-mean", **counts).item() == pytest.approx(2.5)
    # seq-mean-token-mean: (6 / 3 + 4 / 1) / 2 = 3
    assert aggregate(values, mask, "seq-mean-token-mean", **counts).item() == pytest.approx(3.0)
    # seq-mean-token-sum: (6 + 4) / 2 = 5
    assert aggregate(values, mask, "seq-mean-token-sum", **counts).item() == pytest.approx(5.0)
    # seq-mean-token-sum-norm: 10 / (2 * 3)
    assert aggregate(values, mask, "seq-mean-token-sum-norm", **counts).item() == pytest.approx(10 / 6)


def test_empty_sequence_contributes_zero_to_seq_mean():
    values = torch.tensor([[5.0, 5.0], [7.0, 7.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    # (10 / 2 + 0) / 1 sequence
    out = aggregate(
        values, mask, "seq-mean-token-mean", num_global_tokens=2, num_global_seqs=1, max_response_length=2
    )
    assert out.item() == pytest.approx(5.0)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_micro_batches_sum_to_whole_batch(mode):
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([5, 1, 3, 2, 4, 5])  # micro-batches of very different token counts
    mask = torch.arange(5) < lengths[:, None]
    counts = agg_counts(mask, max_response_length=8)
    whole = aggregate(values, mask, mode, **counts)
    parts = sum(aggregate(values[rows], mask[rows], mode, **counts) for rows in ([0], [1, 2], [3, 4, 5]))
    torch.testing.assert_close(parts, whole)
    # and the whole-batch value is the plain global definition
    per_seq_sum = (values * mask).sum(-1)
    plain = {
        "token-mean": per_seq_sum.sum() / lengths.sum(),
        "seq-mean-token-mean": (per_seq_sum / lengths).mean(),
        "seq-mean-token-sum": per_seq_sum.mean(),
        "seq-mean-token-sum-norm": per_seq_sum.sum() / (6 * 8),
    }[mode]
    torch.testing.assert_close(whole, plain)


def test_unknown_agg_mode_lists_valid_ones():
    with pytest.raises(ValueError, match="token-mean.*seq-mean-token-sum-norm"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "mean", **agg_counts(torch.ones(1, 1)))


# ---- policy loss --------------------------------------------------------------------------------------------


def token_loss(advantage: float, ratio: float, **kwargs) -> tuple[float, dict]:
    """Loss of a single valid token (token-mean over 1 token = the per-token loss) and its metric sums."""
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64)
    loss, metrics = policy_loss(
        logp,
        torch.zeros(1, 1, dtype=torch.float64),
        torch.tensor([[advantage]], dtype=torch.float64),
        torch.ones(1, 1),
        num_global_tokens=1,
        num_global_seqs=1,
        max_response_length=1,
        **{**CLIP, **kwargs},
    )
    return loss.item(), {k: v[0].item() for k, v in metrics.items()}


def test_ppo_clip_hand_computed():
    # A > 0, r = 1.5 > 1 + 0.28: max(-1.5, -1.28) = -1.28, clipped branch active
    loss, metrics = token_loss(1.0, 1.5)
    assert loss == pytest.approx(-1.28)
    assert metrics == {"pg_clipfrac": 1, "pg_clipfrac_lower": 0, "ppo_kl": pytest.approx(-math.log(1.5))}
    # A > 0, r = 0.5 < 1 - 0.2: max(-0.5, -0.8) = -0.5, unclipped (PPO never clips a worse-than-old action up)
    loss, metrics = token_loss(1.0, 0.5)
    assert loss == pytest.approx(-0.5) and metrics["pg_clipfrac"] == 0
    # A < 0, r = 0.5: max(0.5, 0.8) = 0.8, clipped
    loss, metrics = token_loss(-1.0, 0.5)
    assert loss == pytest.approx(0.8) and metrics["pg_clipfrac"] == 1


def test_clip_high_is_asymmetric():
    # A > 0, r = 1.25: inside 1 + 0.28 -> -1.25 unclipped; with a symmetric 0.2 range it is clipped to -1.2
    assert token_loss(1.0, 1.25)[0] == pytest.approx(-1.25)
    assert token_loss(1.0, 1.25, clip_ratio_high=0.2)[0] == pytest.approx(-1.2)
    # A < 0, r = 0.75: below 1 - 0.2 -> clamp to 0.8 -> max(0.75, 0.8) = 0.8
    assert token_loss(-1.0, 0.75)[0] == pytest.approx(0.8)


def test_dual_clip_both_branches():
    # A = -1, r = 4: PPO gives max(4, 1.28) = 4; dual clip c = 3 caps it at -A c = 3 (lower clip active)
    loss, metrics = token_loss(-1.0, 4.0, clip_ratio_dual=3.0)
    assert loss == pytest.approx(3.0)
    assert metrics["pg_clipfrac_lower"] == 1 and metrics["pg_clipfrac"] == 0  # -A clamp(r) = 1.28 < 4
    # A = -1, r = 2: max(2, 1.28) = 2 < 3, the cap is not reached
    loss, metrics = token_loss(-1.0, 2.0, clip_ratio_dual=3.0)
    assert loss == pytest.approx(2.0) and metrics["pg_clipfrac_lower"] == 0
    # A = +1, r = 4: dual clip never applies to positive advantages: max(-4, -1.28) = -1.28
    loss, metrics = token_loss(1.0, 4.0, clip_ratio_dual=3.0)
    assert loss == pytest.approx(-1.28) and metrics["pg_clipfrac_lower"] == 0


def test_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match="clip_ratio_dual"):
        token_loss(-1.0, 2.0, clip_ratio_dual=1.0)


@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo"])
def test_masked_tokens_are_ignored_in_loss_metrics_and_gradient(loss_mode):
    # the second token is padding holding garbage: logprob 50, old logprob -inf, advantage NaN
    logp = torch.tensor([[math.log(1.1), 50.0]], requires_grad=True)
    old = torch.tensor([[0.0, -math.inf]])
    adv = torch.tensor([[1.0, float("nan")]])
    mask = torch.tensor([[1, 0]])
    loss, metrics = policy_loss(logp, old, adv, mask, **CLIP, loss_mode=loss_mode, **agg_counts(mask))
    # r = 1.1 is inside [0.8, 1.28]: L = -A r = -1.1, dL/dlogp = -A r = -1.1; padding gets exactly 0
    assert loss.item() == pytest.approx(-1.1)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.1, 0.0]]))
    assert [v.item() for v in metrics["pg_clipfrac"]] == [0.0, 1.0]  # (masked sum, valid tokens)
    assert metrics["ppo_kl"][0].item() == pytest.approx(-math.log(1.1))


def test_policy_loss_micro_batches_sum_to_whole_batch():
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 6, generator=gen, dtype=torch.float64)
    old = logp + 0.3 * torch.randn(4, 6, generator=gen, dtype=torch.float64)
    adv = torch.randn(4, 1, generator=gen, dtype=torch.float64).expand(4, 6)
    mask = torch.arange(6) < torch.tensor([6, 2, 4, 1])[:, None]
    kwargs = {**CLIP, "clip_ratio_dual": 3.0, "loss_agg_mode": "seq-mean-token-mean", **agg_counts(mask)}
    whole, whole_metrics = policy_loss(logp, old, adv, mask, **kwargs)
    parts = [policy_loss(logp[r], old[r], adv[r], mask[r], **kwargs) for r in ([0, 1], [2], [3])]
    torch.testing.assert_close(sum(p[0] for p in parts), whole)
    for name, (total, count) in whole_metrics.items():
        assert sum(p[1][name][0] for p in parts) == total
        assert sum(p[1][name][1] for p in parts) == count == 13


def test_gspo_ratio_is_sequence_level():
    # one sequence, token log-ratios [ln 2, 0] and a padded third token with log-ratio 5 (ignored):
    # s = exp((ln 2 + 0) / 2) = sqrt(2) for BOTH tokens (vanilla would use 2 and 1)
    old = torch.zeros(1, 3)
    logp = torch.tensor([[math.log(2.0), 0.0, 5.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    adv = torch.ones(1, 3)
    wide = {"clip_ratio_low": 0.9, "clip_ratio_high": 10.0}
    counts = {"num_global_tokens": 2, "num_global_seqs": 1, "max_response_length": 3}
    loss, metrics = policy_loss(
        logp, old, adv, mask, **wide, loss_mode="gspo", loss_agg_mode="seq-mean-token-sum", **counts
    )
    # seq-mean-token-sum over one sequence: -A s - A s = -2 sqrt(2)
    assert loss.item() == pytest.approx(-2 * math.sqrt(2))
    loss.backward()
    # d/d logp_t of -A sg[s] exp(logp_t - sg[logp_t]) = -A s: the same for every valid token, 0 for padding
    torch.testing.assert_close(logp.grad, torch.tensor([[-math.sqrt(2), -math.sqrt(2), 0.0]]))
    assert metrics["pg_clipfrac"][0].item() == 0
    # with the default clip range sqrt(2) > 1.28 is clipped on every valid token of the sequence
    _, metrics = policy_loss(logp.detach(), old, adv, mask, **CLIP, loss_mode="gspo", **agg_counts(mask))
    assert metrics["pg_clipfrac"][0].item() == 2 and metrics["pg_clipfrac_lower"][0].item() == 0


def test_gspo_rejects_dual_clip_and_unknown_mode():
    args = (torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))
    with pytest.raises(ValueError, match="clip_ratio_dual"):
        policy_loss(*args, **CLIP, clip_ratio_dual=3.0, loss_mode="gspo", **agg_counts(torch.ones(1, 1)))
    with pytest.raises(ValueError, match="'ppo2'.*vanilla"):
        policy_loss(*args, **CLIP, loss_mode="ppo2", **agg_counts(torch.ones(1, 1)))


def test_low_var_kl_keeps_precision_near_zero():
    # k3 = exp(k) - k - 1 ~ k^2 / 2 for small k: in fp32, exp(k) - k - 1 rounds to 0 at |k| = 1e-4.
    delta = torch.tensor([[1e-4, -1e-4, 1e-3]])
    got = kl_penalty(delta, torch.zeros_like(delta), "low_var_kl").double()
    k = -delta.double()
    exact = torch.exp(k) - k - 1  # float64
    assert ((got - exact).abs() / exact).max() < 1e-3
