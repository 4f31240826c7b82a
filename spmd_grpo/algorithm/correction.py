"""Rollout correction: importance weights and rejection for the gap between vLLM's sampling distribution
(pi_rollout) and the trainer's old policy (pi_old).

The responses are sampled by vLLM, but PPO's ratio is taken against pi_old, the trainer's recomputation
(bf16 kernels, another backend, top-p truncation in the sampler: pi_rollout != pi_old). Verl's "decoupled"
correction reweights the PPO loss of each token by pi_old / pi_rollout and/or drops tokens whose ratio is
extreme. Config keys and defaults are verl's (`algorithm.rollout_correction.*`).

Papers:
- TIS: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
  (fengyao.notion.site/off-policy-rl): truncated importance sampling, per token, w = min(rho, C), C = 2.
- MIS: Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
  Mismatch" (richardli.xyz/rl-collapse): sequence-level IS, and masked IS / rejection (a sequence whose
  ratio leaves the trust region is dropped instead of truncated), and the geometric-mean ratio.

Formulas (d_t = logp_old_t - logp_rollout_t on valid tokens, S = sum_t d_t, M = S / n over a sequence's
n valid tokens; every exponent is clamped to [-20, 20] as verl's SAFETY_BOUND):
    rollout_is = token:     rho_t = exp(clamp(d_t)),  w_t = min(rho_t, C)            C = rollout_is_threshold
    rollout_is = sequence:  rho   = exp(clamp(S)),    w_t = min(rho, C) for every token of the sequence
    rollout_rs = token:     r_t = exp(clamp(d_t)),  keep_t = lower <= r_t <= upper
    rollout_rs = sequence:  r   = exp(clamp(S)),    keep the whole sequence iff lower <= r <= upper
    rollout_rs = geometric: r   = exp(clamp(M)),    idem            (upper = rollout_rs_threshold,
                                                                     lower = rollout_rs_threshold_lower or 1/upper)
The weights are constants (detached); the policy-gradient loss of token t becomes w_t * L_t (verl's
`pg_losses * rollout_is_weights`, after PPO clip and dual clip). A rejected token leaves the response mask:
it adds nothing to the policy loss, the entropy bonus or the KL loss, and it is NOT counted in the global
token/sequence normalisers (verl replaces `response_mask` by the rejection mask before the update, so its
token count and its count of sequences with a valid token exclude rejected tokens; we do the same). A
mini-batch whose every token is rejected contributes zero loss.

TIS = `rollout_is` alone; sequence-level MIS = `rollout_is: sequence` + `rollout_rs: sequence` with the same
threshold (the kept sequences have rho <= C, so the truncation does nothing and the rest are dropped).

Deviations from verl (`verl/trainer/ppo/rollout_corr_helper.py`):
- `rollout_rs` takes the level names of verl's first version (token | sequence | geometric); current verl
  names them `token_k1`, `seq_sum_k1`, `seq_mean_k1` and bounds -log r with [log lower, log upper], which
  keeps r in [1/upper, 1/lower]: the same set for the default lower = 1/upper; we bound r itself (as the
  MIS post and verl's first version). verl's k2/k3 and `seq_max` statistics, chained options, IcePop's
  "lower_upper" IS threshold, `rollout_is_batch_normalize`, the token veto and bypass mode are not provided.
- Thresholds must keep an on-policy token (ratio 1): C >= 1, upper >= 1, 0 < lower <= 1 (verl: > 0).
  `rollout_rs_threshold` defaults to 2.0 (the MIS post's C; current verl's default is null and must be set
  when `rollout_rs` is on).
- Metrics are global over ranks ((sum, count) pairs and maxima the caller all-reduces), computed once per
  step over the rank's samples: `rollout_is_max` is the largest ratio BEFORE truncation at both levels (as
  verl), `rollout_is_mean` is the mean of the weights AFTER truncation, i.e. the scale the loss actually gets
  (verl's is the mean of the ratios before truncation, so ours is lower whenever a ratio exceeds C), and
  `k3_kl` uses the clamped log-ratio. Sequence and geometric rejection sum (average) the raw token
  log-ratios and clamp the result (verl clamps each token's first: they differ only where a token's
  |d| > 20). Only these metrics are given (verl also logs min, std, ESS, perplexities, chi^2):
    rollout_corr/rollout_is_mean                  token-mean of the applied weights w = min(rho, C)
    rollout_corr/rollout_is_max                   max rho (token level: over tokens; sequence: sequences)
    rollout_corr/rollout_is_ratio_fraction_high   fraction capped: tokens (sequences) with rho > C
    rollout_corr/rollout_rs_masked_fraction       fraction of valid tokens rejected
    rollout_corr/rollout_rs_seq_masked_fraction   fraction of sequences with a rejected token
    rollout_corr/kl, rollout_corr/k3_kl           token-means of -d and of exp(d) - d - 1 (KL(rollout||old))
- No correction is computed (and no metric logged) when both `rollout_is` and `rollout_rs` are null (verl
  logs its off-policy metrics then); `rollout/logprob_diff_*` still shows the mismatch.

Caveat (as in verl): vLLM's logprobs are those of the distribution it sampled from (temperature applied,
top-p / top-k truncation renormalised), the trainer's are not truncated, so with top_p < 1 or top_k > 0 the
ratio of a sampled token also holds the kept probability mass Z <= 1 (pi_old / pi_rollout = Z up to the
numerical mismatch) and the weights scale the loss down by about Z: measured on the smoke task with
top_p = 0.6, every token weight was ~0.60. The shipped configs train with top_p = 1, top_k = -1.

Shape legend:
    B: sequences    T: padded response length
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")
SAFETY_BOUND = 20.0  # verl's: exp(20) ~ 4.9e8 bounds every ratio before it is used

MetricSums = dict[str, tuple[float, float]]


@dataclass(frozen=True)
class CorrectionSpec:
    """The correction's settings (config `algorithm.rollout_correction`); `enabled` is False when both are off."""

    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_rs: str | None = None
    rollout_rs_threshold: float = 2.0
    rollout_rs_threshold_lower: float | None = None

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None

    def check(self) -> None:
        if self.rollout_is not in (None, *IS_LEVELS):
            raise ValueError(f"unknown rollout_is level {self.rollout_is!r}; valid: {', '.join(IS_LEVELS)}")
        if self.rollout_rs not in (None, *RS_LEVELS):
            raise ValueError(f"unknown rollout_rs level {self.rollout_rs!r}; valid: {', '.join(RS_LEVELS)}")
        if not self.rollout_is_threshold >= 1:
            raise ValueError(f"rollout_is_threshold must be >= 1, got {self.rollout_is_threshold}")
        lower = self.rs_lower
        if not (self.rollout_rs_threshold >= 1 and 0 < lower <= 1):
            raise ValueError(
                f"need rollout_rs_threshold >= 1 and 0 < lower <= 1, got {self.rollout_rs_threshold}, {lower}"
            )

    @property
    def rs_lower(self) -> float:
        lower = self.rollout_rs_threshold_lower
        return 1.0 / self.rollout_rs_threshold if lower is None else lower


@dataclass(frozen=True)
class Correction:
    """`rollout_correction`'s result for B sequences.

    weights: [B, T] float32, detached: the per-token loss multiplier (1 where `rollout_is` is off, 0 on padding)
    keep:    [B, T] bool: valid and not rejected (the response mask to train with)
    sums:    {metric: (sum, count)} over this batch, to all-reduce and divide
    maxima:  {metric: max} over this batch, to all-reduce with max
    """

    weights: Tensor
    keep: Tensor
    sums: MetricSums
    maxima: dict[str, float]


def _sequence_log_ratio(log_ratio: Tensor, mask: Tensor, level: str) -> Tensor:
    """[B, 1]: S (sum over valid tokens) for "sequence", M (mean) for "geometric"; padding already zero."""
    total = log_ratio.sum(dim=-1, keepdim=True)
    if level == "sequence":
        return total
    return total / mask.sum(dim=-1, keepdim=True).clamp(min=1)


def _ratio(log_ratio: Tensor, mask: Tensor, level: str) -> Tensor:
    """The level's ratio before truncation, [B, T] (token) or [B, 1] (sequence, geometric), exponent clamped."""
    if level != "token":
        log_ratio = _sequence_log_ratio(log_ratio, mask, level)
    return torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))


def rollout_correction(
    old_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor, spec: CorrectionSpec
) -> Correction:
    """IS weights, rejection mask and metric sums of B sequences (all inputs [B, T]; see the module formulas).

    Padding may hold anything: it is zeroed before any arithmetic, and gets weight 0 and keep False.
    """
    spec.check()
    if not (old_logprobs.shape == rollout_logprobs.shape == response_mask.shape and old_logprobs.dim() == 2):
        raise ValueError(
            "old_logprobs, rollout_logprobs and response_mask must all be [B, T], got "
            f"{[tuple(t.shape) for t in (old_logprobs, rollout_logprobs, response_mask)]}"
        )
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    log_ratio = torch.where(mask, old_logprobs.float().detach() - rollout_logprobs.float().detach(), zero)
    weights = torch.where(mask, 1.0, zero)
    keep = mask.clone()
    sums: MetricSums = {}
    maxima: dict[str, float] = {}
    if spec.rollout_is is not None:
        weights = _truncated_weights(log_ratio, mask, spec, sums, maxima)
    if spec.rollout_rs is not None:
        keep = _rejection_keep(log_ratio, mask, spec, sums)
    sums.update(_mismatch_sums(log_ratio, mask))
    return Correction(weights=weights, keep=keep, sums=sums, maxima=maxima)


def _truncated_weights(
    log_ratio: Tensor, mask: Tensor, spec: CorrectionSpec, sums: MetricSums, maxima: dict[str, float]
) -> Tensor:
    """TIS: w = min(rho, C) broadcast to [B, T] (0 on padding); adds the IS metrics."""
    cap = spec.rollout_is_threshold
    rho = _ratio(log_ratio, mask, spec.rollout_is)
    weights = torch.where(mask, torch.clamp(rho, max=cap).expand_as(mask), 0.0)
    num_tokens = float(mask.sum())
    # Token level: each valid token is one ratio; sequence level: each sequence with a valid token is one.
    units = mask if spec.rollout_is == "token" else mask.any(dim=-1, keepdim=True)
    sums["rollout_corr/rollout_is_mean"] = (float(weights.sum()), num_tokens)
    sums["rollout_corr/rollout_is_ratio_fraction_high"] = (
        float((units & (rho > cap)).sum()),
        float(units.sum()),
    )
    maxima["rollout_corr/rollout_is_max"] = float(rho[units].max()) if units.any() else 0.0
    return weights


def _rejection_keep(log_ratio: Tensor, mask: Tensor, spec: CorrectionSpec, sums: MetricSums) -> Tensor:
    """MIS / RS: the valid tokens whose (token, sequence or geometric) ratio is in [lower, upper]; adds metrics."""
    r = _ratio(log_ratio, mask, spec.rollout_rs)
    inside = (r >= spec.rs_lower) & (r <= spec.rollout_rs_threshold)
    keep = mask & inside.expand_as(mask)
    rejected = mask & ~keep
    has_tokens = mask.any(dim=-1)
    sums["rollout_corr/rollout_rs_masked_fraction"] = (float(rejected.sum()), float(mask.sum()))
    sums["rollout_corr/rollout_rs_seq_masked_fraction"] = (
        float(rejected.any(dim=-1).sum()),
        float(has_tokens.sum()),
    )
    return keep


def _mismatch_sums(log_ratio: Tensor, mask: Tensor) -> MetricSums:
    """KL(rollout || old) estimates over valid tokens: k1 = -d and k3 = exp(d) - d - 1 (d clamped)."""
    d = torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    k3 = torch.where(mask, torch.expm1(d) - d, 0.0)  # exp(d) - 1 - d without the cancellation of exp(d) - 1
    num_tokens = float(mask.sum())
    return {
        "rollout_corr/kl": (float(-log_ratio.sum()), num_tokens),
        "rollout_corr/k3_kl": (float(k3.sum()), num_tokens),
    }
