"""Rollout correction (TIS, MIS / rejection) against formulas written out here, its place in the update
(loss, gradient and global counts), and its config keys."""

import dataclasses
import math

import pytest
import torch

from spmd_grpo.actor.logprob_pass import compute_logprobs
from spmd_grpo.actor.spec import UpdateSpec
from spmd_grpo.actor.update import correction_metrics, mini_batch_backward
from spmd_grpo.algorithm.correction import CorrectionSpec, rollout_correction
from spmd_grpo.algorithm.loss import policy_loss
from spmd_grpo.config.checks import ConfigError
from spmd_grpo.config.loader import load_config
from spmd_grpo.config.validate import validate
from spmd_grpo.data.samples import Prompt, Sample
from tests.conftest import ONE_CPU_RANK
from tests.unit.bigram import BigramPolicy

NAN, INF = float("nan"), float("inf")
PREFIX = "rollout_corr/"


def run(old, rollout, mask, **settings):
    c = rollout_correction(
        torch.tensor(old), torch.tensor(rollout), torch.tensor(mask), CorrectionSpec(**settings)
    )
    means = {k.removeprefix(PREFIX): s / n for k, (s, n) in c.sums.items()}
    maxima = {k.removeprefix(PREFIX): v for k, v in c.maxima.items()}
    return c, means, maxima


# ---- the formulas, by hand ----------------------------------------------------------------------------------


def test_token_tis_hand_computed():
    # d = old - rollout = [0.5, -1.0, 0.0] on the valid tokens; the 4th token is padding holding garbage.
    c, means, maxima = run(
        [[-1.0, -2.0, -0.5, NAN]], [[-1.5, -1.0, -0.5, -INF]], [[1, 1, 1, 0]], rollout_is="token",
        rollout_is_threshold=1.5,
    )  # fmt: skip
    rho = [math.exp(0.5), math.exp(-1.0), 1.0]
    w = [min(r, 1.5) for r in rho]  # [1.5 (capped), 0.3679, 1.0]
    torch.testing.assert_close(c.weights, torch.tensor([[*w, 0.0]]))
    assert c.keep.tolist() == [[True, True, True, False]]  # no rejection asked
    assert means["rollout_is_mean"] == pytest.approx(sum(w) / 3)
    assert means["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)  # one token of three capped
    assert maxima["rollout_is_max"] == pytest.approx(math.exp(0.5))  # before truncation
    assert means["kl"] == pytest.approx(-(0.5 - 1.0 + 0.0) / 3)
    assert means["k3_kl"] == pytest.approx(sum(math.exp(d) - d - 1 for d in (0.5, -1.0, 0.0)) / 3)


def test_sequence_tis_hand_computed():
    # Sequence 1: d = [0.5, 0.3], S = 0.8, rho = e^0.8 = 2.2255 > 2: both tokens get 2.
    # Sequence 2: d = [-0.2], rho = e^-0.2 = 0.8187.
    c, means, maxima = run(
        [[-1.0, -1.0], [-1.2, 0.0]], [[-1.5, -1.3], [-1.0, 5.0]], [[1, 1], [1, 0]], rollout_is="sequence"
    )
    torch.testing.assert_close(c.weights, torch.tensor([[2.0, 2.0], [math.exp(-0.2), 0.0]]))
    assert means["rollout_is_mean"] == pytest.approx((2 + 2 + math.exp(-0.2)) / 3)  # over tokens
    assert means["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 2)  # over sequences
    assert maxima["rollout_is_max"] == pytest.approx(math.exp(0.8))


def test_sequence_ratio_is_clamped_at_exp_20():
    # S = 30 nats: the ratio is exp(20), not exp(30) (verl's safety bound); the weight is the cap.
    c, _, maxima = run(
        [[0.0] * 3], [[-10.0] * 3], [[1, 1, 1]], rollout_is="sequence", rollout_is_threshold=3.0
    )
    assert c.weights.tolist() == [[3.0, 3.0, 3.0]]
    assert maxima["rollout_is_max"] == pytest.approx(math.exp(20.0), rel=1e-6)


def test_token_rejection_hand_computed():
    # d = [0.5, 1.0, -1.0, 0.0]: r = [1.65, 2.72, 0.37, 1.0]; bounds [1/2, 2]: the middle two are rejected.
    c, means, _ = run([[0.5, 1.0, -1.0, 0.0]], [[0.0] * 4], [[1, 1, 1, 1]], rollout_rs="token")
    assert c.keep.tolist() == [[True, False, False, True]]
    assert c.weights.tolist() == [[1.0] * 4]  # no IS weights asked
    assert means["rollout_rs_masked_fraction"] == pytest.approx(2 / 4)
    assert means["rollout_rs_seq_masked_fraction"] == 1.0
    assert "rollout_is_mean" not in means


def test_sequence_and_geometric_rejection_hand_computed():
    old, rollout, mask = [[0.5, 0.3], [-0.2, 0.0]], [[0.0, 0.0], [0.0, 0.0]], [[1, 1], [1, 0]]
    # sequence: r1 = e^0.8 = 2.23 > 2 -> whole sequence 1 rejected; r2 = e^-0.2 = 0.82 kept.
    c, means, _ = run(old, rollout, mask, rollout_rs="sequence")
    assert c.keep.tolist() == [[False, False], [True, False]]
    assert means["rollout_rs_masked_fraction"] == pytest.approx(2 / 3)
    assert means["rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)
    # geometric: r1 = e^(0.8 / 2) = 1.49 kept; an explicit lower bound 0.9 now rejects r2 = 0.82.
    c, means, _ = run(old, rollout, mask, rollout_rs="geometric", rollout_rs_threshold_lower=0.9)
    assert c.keep.tolist() == [[True, True], [False, False]]
    assert means["rollout_rs_masked_fraction"] == pytest.approx(1 / 3)


def test_masked_importance_sampling_drops_instead_of_capping():
    # Seq-MIS: sequence IS + sequence rejection at the same C: kept sequences carry rho, the others are gone.
    c, means, _ = run(
        [[0.5, 0.3], [-0.2, 0.0]], [[0.0, 0.0], [0.0, 0.0]], [[1, 1], [1, 0]],
        rollout_is="sequence", rollout_rs="sequence",
    )  # fmt: skip
    assert c.keep.tolist() == [[False, False], [True, False]]
    assert c.weights[1, 0].item() == pytest.approx(math.exp(-0.2))
    assert means["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 2)


def test_on_policy_gives_unit_weights_and_keeps_everything():
    lp = torch.tensor([[-0.3, -2.0, -7.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    for level in ("token", "sequence"):
        for rs in ("token", "sequence", "geometric"):
            c = rollout_correction(lp, lp.clone(), mask, CorrectionSpec(rollout_is=level, rollout_rs=rs))
            assert torch.equal(c.weights, mask.float()) and torch.equal(c.keep, mask.bool())


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"rollout_is": "tok"}, "unknown rollout_is level 'tok'"),
        ({"rollout_rs": "seq"}, "unknown rollout_rs level 'seq'"),
        ({"rollout_is_threshold": 0.5}, "rollout_is_threshold must be >= 1"),
        ({"rollout_rs_threshold_lower": 1.5}, "0 < lower <= 1"),
    ],
)
def test_bad_settings_raise(settings, message):
    with pytest.raises(ValueError, match=message):
        rollout_correction(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), CorrectionSpec(**settings))


# ---- in the loss ---------------------------------------------------------------------------------------------


def test_policy_loss_with_unit_weights_equals_no_weights():
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(3, 5, generator=gen)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    adv = torch.randn(3, 1, generator=gen).expand(3, 5) * mask
    counts = {"num_global_tokens": 10, "num_global_seqs": 3, "max_response_length": 5}
    weights = rollout_correction(old, old, mask, CorrectionSpec(rollout_is="token")).weights
    out = []
    for w in (None, weights):
        logp = (old + 0.3 * torch.randn(3, 5, generator=torch.Generator().manual_seed(1))).requires_grad_()
        loss, _ = policy_loss(
            logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_dual=3.0,
            rollout_is_weights=w, **counts,
        )  # fmt: skip
        loss.backward()
        out.append((loss.detach(), logp.grad))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def test_policy_loss_multiplies_each_token_loss():
    # ratio 1 (logp = old): the per-token loss is -A w_t; token-mean over 3 tokens.
    logp = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    w = torch.tensor([[2.0, 0.5, 1.0]])
    loss, _ = policy_loss(
        logp, logp.detach(), torch.full((1, 3), 2.0), torch.ones(1, 3), clip_ratio_low=0.2,
        clip_ratio_high=0.2, rollout_is_weights=w, num_global_tokens=3, num_global_seqs=1,
        max_response_length=3,
    )  # fmt: skip
    assert loss.item() == pytest.approx(-2.0 * (2.0 + 0.5 + 1.0) / 3)
    loss.backward()  # d/dlogp of -A w r = -A w (r = 1): the weights are constants
    torch.testing.assert_close(logp.grad, -2.0 * w / 3)


# ---- in the update --------------------------------------------------------------------------------------------


def make_samples(policy, spec, shifts: list[list[float]]) -> list[Sample]:
    """Samples whose old logprobs are the policy's and whose vLLM logprobs are old - shift (d = shift)."""
    samples = [
        Sample(
            Prompt(uid=i, prompt_token_ids=[]),
            0,
            [1, 2 + i % 3],
            [(i + t) % 5 + 1 for t in range(len(d))],
            [],
        )
        for i, d in enumerate(shifts)
    ]
    for i, (s, lp) in enumerate(zip(samples, compute_logprobs(policy, samples, spec), strict=True)):
        s.old_logprobs = lp
        s.rollout_logprobs = (lp - torch.tensor(shifts[i])).tolist()
        s.advantage = [1.0, -0.5, 2.0, -1.5][i % 4]
    return samples


def backward(policy, samples, spec):
    policy.zero_grad()
    sums = mini_batch_backward(policy, samples, spec, ONE_CPU_RANK)
    return sums["actor/pg_loss"][0], policy.table.grad.clone()


SHIFTS = [[0.1, 0.9, -0.2], [0.0, -1.0], [0.3, 0.4, 0.5, 0.6], [-0.05]]
BASE = UpdateSpec(
    temperature=1.0, pad_token_id=0, max_response_length=4, mini_batch_size=4, micro_batch_size=4,
    experience_micro_batch_size=4, use_kl_loss=False,
)  # fmt: skip


def test_update_with_rollout_equal_to_old_is_unchanged():
    policy = BigramPolicy(vocab=6, seed=3)
    samples = make_samples(policy, BASE, [[0.0] * len(d) for d in SHIFTS])
    on = dataclasses.replace(
        BASE, rollout_correction=CorrectionSpec(rollout_is="sequence", rollout_rs="token"), entropy_coef=0.1
    )
    off = dataclasses.replace(BASE, entropy_coef=0.1)
    loss_off, grad_off = backward(policy, samples, off)
    loss_on, grad_on = backward(policy, samples, on)
    assert loss_on == loss_off and torch.equal(grad_on, grad_off)


def test_update_loss_is_weighted_and_normalised_by_kept_tokens():
    # old = the policy's logprobs, so r = 1 and the token loss is -A_i w_t. Token TIS (C = 2) + token
    # rejection ([1/2, 2]): e^0.9 = 2.46 and e^-1 = 0.37 are rejected, the rest are kept with w = e^d.
    policy = BigramPolicy(vocab=6, seed=3)
    samples = make_samples(policy, BASE, SHIFTS)
    spec = dataclasses.replace(
        BASE, rollout_correction=CorrectionSpec(rollout_is="token", rollout_rs="token")
    )
    kept = [
        [(d, s.advantage) for d in ds if 0.5 <= math.exp(d) <= 2]
        for s, ds in zip(samples, SHIFTS, strict=True)
    ]
    num_kept = sum(map(len, kept))
    assert num_kept == 10 - 2
    expected = -sum(a * math.exp(d) for row in kept for d, a in row) / num_kept
    loss, grad = backward(policy, samples, spec)
    assert loss == pytest.approx(expected, rel=1e-6)
    # The same gradient whatever the micro-batch split (the kept-token count is all-reduced first).
    _, grad_micro1 = backward(policy, samples, dataclasses.replace(spec, micro_batch_size=1))
    torch.testing.assert_close(grad_micro1, grad)
    # The metrics, over the step's samples: 2 of 10 tokens rejected, in 2 of 4 sequences.
    m = correction_metrics(samples, spec)
    assert m[PREFIX + "rollout_rs_masked_fraction"] == pytest.approx(2 / 10)
    assert m[PREFIX + "rollout_rs_seq_masked_fraction"] == pytest.approx(2 / 4)
    assert m[PREFIX + "rollout_is_max"] == pytest.approx(math.exp(0.9), rel=1e-5)
    assert m[PREFIX + "rollout_is_ratio_fraction_high"] == pytest.approx(1 / 10)


def test_no_metrics_when_off():
    policy = BigramPolicy(vocab=6, seed=3)
    assert correction_metrics(make_samples(policy, BASE, SHIFTS), BASE) == {}


# ---- config ---------------------------------------------------------------------------------------------------

KEY = "algorithm.rollout_correction."


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout_is=tok", f"{KEY}rollout_is: must be 'token' or 'sequence', got 'tok'"),
        ("rollout_rs=seq", f"{KEY}rollout_rs: must be 'token', 'sequence' or 'geometric', got 'seq'"),
        ("rollout_is_threshold=0.5", f"{KEY}rollout_is_threshold: must be greater than or equal to 1"),
        (
            "rollout_rs_threshold=0.9",
            f"{KEY}rollout_rs_threshold: must be greater than or equal to 1, got 0.9",
        ),
        ("rollout_rs_threshold_lower=0", f"{KEY}rollout_rs_threshold_lower: must be greater than 0, got 0"),
        ("rollout_is_threshold=big", f"{KEY}rollout_is_threshold: must be a valid number, got 'big'"),
        ("rollout_cap=2", f"unknown config key {KEY}rollout_cap"),
    ],
)
def test_config_errors_are_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, ["worker.actor.model.model_path=/m", KEY + override]), 1)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_config_reaches_the_update_spec():
    cfg = load_config(
        None,
        ["worker.actor.model.model_path=/m", KEY + "rollout_is=sequence", KEY + "rollout_rs_threshold=3"],
    )
    spec = UpdateSpec.from_config(cfg, world_size=1, pad_token_id=0).rollout_correction
    assert spec == CorrectionSpec(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs_threshold=3.0)
    default = UpdateSpec.from_config(
        load_config(None, ["worker.actor.model.model_path=/m"]), world_size=1, pad_token_id=0
    )
    assert not default.rollout_correction.enabled  # off unless asked


@pytest.mark.parametrize(
    "name, level",
    [
        ("smoke", None),
        ("smoke_dapo", None),
        ("qwen2_5_vl_3b_geo3k_grpo", "token"),
        ("qwen2_5_vl_7b_geo3k_grpo", "token"),
        ("qwen2_5_vl_32b_geo3k_grpo", "token"),
        ("qwen2_5_vl_7b_geo3k_dapo", "token"),
    ],
)
def test_shipped_configs(name, level):
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / f"{name}.yaml"
    rc = load_config(path).algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_is_threshold, rc.rollout_rs) == (level, 2.0, None)
