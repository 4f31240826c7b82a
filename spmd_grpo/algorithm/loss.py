"""Policy-gradient loss (PPO clip, dual clip, GSPO), KL penalties and loss aggregation.

Papers:
- PPO: Schulman et al. 2017 (arXiv:1707.06347), clipped surrogate objective.
- Dual-clip PPO: Ye et al. 2020 (arXiv:1912.09729): for A < 0 the loss is also capped at -A * c, c > 1.
- Clip-higher and token-mean aggregation: DAPO, Yu et al. 2025 (arXiv:2503.14476).
- Dr.GRPO: Liu et al. 2025 (arXiv:2503.20783): `seq-mean-token-sum-norm` (divide by a constant length).
- GSPO: Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071): sequence-level ratio
  s_i = exp(mean_t (logp - logp_old)), used in its token-level form s_i,t = sg[s_i] * exp(logp_t - sg[logp_t])
  (GSPO-token; same value and, with one advantage per sequence, the same gradient as GSPO).
- KL estimators k1/k2/k3: Schulman 2020, "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html).

Formulas are verl's (`verl/trainer/ppo/core_algos.py`). Deviations:
- Aggregation is GLOBAL. `aggregate` returns this micro-batch's contribution to the aggregate over the whole
  mini-batch on all ranks, divided by global counts that the caller all-reduces beforehand; summing the
  contributions (gradient accumulation plus the data-parallel gradient sum) gives exactly the global value.
  We do NOT reproduce verl's legacy FSDP path (each micro-batch divided by its own token count, then by the
  number of micro-batches: a mean of means that up-weights short micro-batches). Note for the caller: FSDP
  averages gradients over ranks, so it must multiply by the data-parallel world size (or disable that
  averaging) to obtain the sum.
- Masks are read as booleans (non-zero = valid token) and masked positions are ZEROED with `torch.where`,
  not multiplied (`aggregate` zeroes the values; `policy_loss` zeroes its inputs), so NaN/inf in padding
  reaches neither the loss nor, in `policy_loss`, the gradient.
- GSPO uses the aggregation mode it is given (verl's `compute_policy_loss_gspo` hard-codes
  `seq-mean-token-mean`, which is also what the GSPO paper's objective is: pass that mode to reproduce it).
  As in verl, the GSPO log-ratio is clamped at max 10 (no lower clamp), and dual clip does not apply to
  GSPO: passing `clip_ratio_dual` with `loss_mode="gspo"` is a ValueError instead of being ignored.
- `ppo_kl` is the masked mean of -(logp - logp_old) after the [-20, 20] clamp, in both modes (verl's vanilla
  path uses the clamped value, its GSPO path the raw one; they differ only where |delta| > 20).
- Metrics come back as (masked sum, token count) pairs so that the caller can all-reduce both and divide,
  getting the exact global token-mean (verl averages per-micro-batch means).
- Only the KL kinds "kl" (k1), "abs", "mse" (k2) and "low_var_kl" (k3) are provided; verl's "k1"/"k2"/"k3"
  aliases and "+" straight-through variants are not.
- k3 is computed as expm1(k) - k, not exp(k) - k - 1 (verl): the same value, but near k = 0 (policy close to
  the reference, the usual case) exp(k) rounds to 1 and the difference loses the k^2 / 2 it should return
  (at |k| = 1e-4 in fp32, exp(k) - k - 1 gives 0 where k^2 / 2 = 5e-9: relative error 1; expm1 - k: 3e-4).
- `seq-mean-token-sum-norm` (Dr.GRPO) divides sum(L m) by num_sequences x max_response_length, where verl's
  `agg_loss` divides each micro-batch's sum(L m) by the constant only (its `actor.loss_scale_factor`, default
  the padded response width, i.e. max_response_length; here the constant is always max_response_length).
  The Dr.GRPO paper's objective keeps GRPO's 1/G mean over the sequences and replaces only the per-sequence
  1/|o_i| by a constant, so its loss is ours. verl's gradient is ours times the sequences per micro-batch
  (its dp actor scales each micro-batch by 1 / gradient-accumulation steps; with `use_dynamic_bsz` each
  micro-batch is weighted by its sequence count instead) or times the sequences per rank (its engine
  path), so the step size depends on the batch shape there and not here. The same factor separates the
  `actor/entropy` and `actor/kl_loss` values in this mode.
- The KL is a loss term only (verl's `kl_loss_type` / `kl_loss_coef`, named `algorithm.kl_penalty` /
  `kl_coef` here as in EasyR1); verl's KL-in-reward (`use_kl_in_reward` with a fixed or adaptive
  controller, which subtracts kl_coef x KL from the token rewards before the advantages) is not provided.

Shape legend:
    B: sequences in this micro-batch    T: padded response length
"""

import torch
from torch import Tensor

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("kl", "abs", "mse", "low_var_kl")
LOSS_MODES = ("vanilla", "gspo")

# verl's bounds: exp() of a log-ratio above 20 overflows nothing in fp32 but makes the surrogate useless,
# and k3 is clamped to +-10 because its variance explodes for large |delta|.
_LOG_RATIO_CLAMP = 20.0
_GSPO_LOG_RATIO_MAX = 10.0
_LOW_VAR_KL_CLAMP = 10.0

MetricSums = dict[str, tuple[Tensor, Tensor]]


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate between the policy and the reference, [B, T] -> [B, T].

    delta = logp - logp_ref. "kl": delta; "abs": |delta|; "mse": 0.5 delta^2;
    "low_var_kl" (k3): clamp(exp(k) - k - 1, -10, 10) with k = clamp(-delta, -20, 20), computed as
    expm1(k) - k (exact near k = 0).
    """
    delta = logprobs - ref_logprobs
    if kind == "kl":
        return delta
    if kind == "abs":
        return delta.abs()
    if kind == "mse":
        return 0.5 * delta.square()
    if kind == "low_var_kl":
        k = torch.clamp(-delta, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return torch.clamp(torch.expm1(k) - k, -_LOW_VAR_KL_CLAMP, _LOW_VAR_KL_CLAMP)
    raise ValueError(f"unknown KL penalty kind {kind!r}; valid kinds: {', '.join(KL_KINDS)}")


def _masked(values: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask.bool(), values, torch.zeros_like(values))


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_global_tokens: float,
    num_global_seqs: float,
    max_response_length: int,
) -> Tensor:
    """This micro-batch's contribution to the global aggregate of per-token `values` [B, T] -> scalar.

    The global counts are over every micro-batch on every rank of the mini-batch (the caller all-reduces
    them). Modes (m = mask, sums over this micro-batch):
      token-mean:              sum(v m) / num_global_tokens
      seq-mean-token-mean:     sum_i [sum_t(v m)_i / n_i] / num_global_seqs  (a sequence with n_i = 0 adds 0)
      seq-mean-token-sum:      sum_i [sum_t(v m)_i] / num_global_seqs
      seq-mean-token-sum-norm: sum(v m) / (num_global_seqs * max_response_length)   (Dr.GRPO)
    verl's seq-mean modes divide by the number of sequences with at least one valid token; count
    `num_global_seqs` the same way to match it.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")
    if values.shape != mask.shape or values.dim() != 2:
        raise ValueError(
            f"expected values and mask of the same shape [B, T], got {values.shape} and {mask.shape}"
        )
    masked_values = _masked(values, mask)
    if mode == "token-mean":
        _check_positive("num_global_tokens", num_global_tokens)
        return masked_values.sum() / num_global_tokens
    _check_positive("num_global_seqs", num_global_seqs)
    if mode == "seq-mean-token-mean":
        tokens_per_seq = mask.bool().sum(dim=-1).clamp(min=1)
        return (masked_values.sum(dim=-1) / tokens_per_seq).sum() / num_global_seqs
    if mode == "seq-mean-token-sum":
        return masked_values.sum() / num_global_seqs
    _check_positive("max_response_length", max_response_length)
    return masked_values.sum() / (num_global_seqs * max_response_length)


def _check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value}")


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_dual: float | None = None,
    loss_mode: str = "vanilla",
    loss_agg_mode: str = "token-mean",
    num_global_tokens: float,
    num_global_seqs: float,
    max_response_length: int,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, MetricSums]:
    """Clipped policy-gradient loss contribution of this micro-batch, and metric sums.

    All tensors are [B, T] (`advantages` already broadcast over tokens). The loss is aggregated with
    `aggregate(..., loss_agg_mode, ...)`, so it is this micro-batch's share of the global loss.

    vanilla: r = exp(clamp(logp - logp_old, -20, 20)),
             L = max(-A r, -A clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high));
             with dual clip (clip_ratio_dual = c > 1), for A < 0: L = min(L, -A c).
    gspo:    r = s_i,t = sg[s_i] * exp(logp_t - sg[logp_t]), s_i = exp(mean over valid tokens of
             (logp - logp_old)) (log clamped at max 10), same clipped L; no dual clip.
    rollout_is_weights ([B, T], see correction.py): L is multiplied by these constants (detached) before
    aggregation, as verl's `pg_losses * rollout_is_weights`; the metrics do not see them.

    Metrics, each a (masked sum, valid-token count) pair of detached 0-d float32 tensors; global token-mean
    = all_reduce(sum) / all_reduce(count):
      pg_clipfrac:       tokens where the clipped branch is active (-A clamp(r) > -A r)
      pg_clipfrac_lower: tokens where the dual-clip cap is active (A < 0 and max(..) > -A c); 0 for gspo
      ppo_kl:            -(logp - logp_old)
    """
    tensors = (logprobs, old_logprobs, advantages, response_mask)
    weights = () if rollout_is_weights is None else (rollout_is_weights,)
    _check_policy_inputs((*tensors, *weights), clip_ratio_dual=clip_ratio_dual, loss_mode=loss_mode)
    mask = response_mask.bool()
    # Padding may hold anything (-inf old logprobs, NaN advantages). Zero it before any arithmetic: masking
    # only the final loss is not enough, because a NaN times a zero upstream gradient is still a NaN gradient.
    logprobs, old_logprobs, advantages = (_masked(t, mask) for t in (logprobs, old_logprobs, advantages))
    log_ratio = torch.clamp(logprobs - old_logprobs, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio) if loss_mode == "vanilla" else _gspo_ratio(logprobs, old_logprobs, mask)

    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_loss = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    per_token_loss, dual_active = _dual_clip(clip_loss, advantages, clip_ratio_dual)
    if rollout_is_weights is not None:
        per_token_loss = per_token_loss * _masked(rollout_is_weights.detach(), mask)

    counts = dict(num_global_tokens=num_global_tokens, num_global_seqs=num_global_seqs)
    loss = aggregate(per_token_loss, mask, loss_agg_mode, **counts, max_response_length=max_response_length)
    return loss, _metric_sums(mask, clip_active=clip_active, dual_active=dual_active, log_ratio=log_ratio)


def _metric_sums(mask: Tensor, *, clip_active: Tensor, dual_active: Tensor, log_ratio: Tensor) -> MetricSums:
    """`policy_loss`'s metrics as (masked sum, valid-token count) pairs, detached float32."""
    num_tokens = mask.sum().to(torch.float32)
    with torch.no_grad():
        return {
            "pg_clipfrac": ((clip_active & mask).sum().to(torch.float32), num_tokens),
            "pg_clipfrac_lower": ((dual_active & mask).sum().to(torch.float32), num_tokens),
            "ppo_kl": (_masked(-log_ratio, mask).sum().to(torch.float32), num_tokens),
        }


def _check_policy_inputs(
    tensors: tuple[Tensor, ...], *, clip_ratio_dual: float | None, loss_mode: str
) -> None:
    """`policy_loss`'s argument checks: a known mode, [B, T] tensors, a dual clip only where it applies."""
    if loss_mode not in LOSS_MODES:
        raise ValueError(f"unknown policy loss mode {loss_mode!r}; valid modes: {', '.join(LOSS_MODES)}")
    if len({t.shape for t in tensors}) != 1 or tensors[0].dim() != 2:
        raise ValueError(
            "logprobs, old_logprobs, advantages, response_mask (and rollout_is_weights) must all be [B, T], got "
            f"{[tuple(t.shape) for t in tensors]}"
        )
    if clip_ratio_dual is not None:
        if loss_mode != "vanilla":
            raise ValueError(
                f"clip_ratio_dual applies to loss_mode='vanilla' only, got loss_mode={loss_mode!r}"
            )
        if not clip_ratio_dual > 1.0:
            raise ValueError(f"clip_ratio_dual must be > 1.0, got {clip_ratio_dual}")


def _gspo_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """GSPO-token ratio s_i,t = sg[s_i] * exp(logp_t - sg[logp_t]), [B, T] (inputs already zeroed on padding).

    The sequence ratio is a constant (sg) per sequence; the `logprobs - logprobs.detach()` term is 0 in value
    and only routes each token's own gradient, so all tokens of a sequence share the ratio value.
    """
    tokens_per_seq = mask.sum(dim=-1, keepdim=True).clamp(min=1)
    seq_log_ratio = (logprobs - old_logprobs).sum(dim=-1, keepdim=True) / tokens_per_seq
    log_seq_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach()
    return torch.exp(torch.clamp(log_seq_ratio, max=_GSPO_LOG_RATIO_MAX))


def _dual_clip(clip_loss: Tensor, advantages: Tensor, clip_ratio_dual: float | None) -> tuple[Tensor, Tensor]:
    """(per-token loss, bool [B, T] where the dual-clip cap is active); without dual clip: (clip_loss, False).

    Dual clip bounds the loss of a negative-advantage token whose ratio has grown very large, where the PPO
    max() would otherwise let -A r grow without bound.
    """
    if clip_ratio_dual is None:
        return clip_loss, torch.zeros_like(clip_loss, dtype=torch.bool)
    dual_cap = -advantages * clip_ratio_dual
    negative = advantages < 0
    per_token_loss = torch.where(negative, torch.minimum(clip_loss, dual_cap), clip_loss)
    return per_token_loss, negative & (clip_loss > dual_cap)
