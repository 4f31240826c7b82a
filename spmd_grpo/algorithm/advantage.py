"""Group-relative advantages (GRPO, Dr.GRPO, batch-std) and DAPO's dynamic-sampling group filter.

Papers:
- GRPO: Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300): A_i = (s_i - mean(group)) / std(group).
- Dr.GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training" (arXiv:2503.20783): A_i = s_i - mean(group).
- Batch std: Liu et al. 2025, "Tricks or Traps? A Deep Dive into RL for LLM Reasoning" (arXiv:2508.08221,
  "group-level mean, batch-level std"), implemented like TRL's `scale_rewards="batch"`.
- DAPO: Yu et al. 2025 (arXiv:2503.14476), dynamic sampling: drop groups whose scores are all equal.

Semantics follow verl's `compute_grpo_outcome_advantage` (`verl/trainer/ppo/core_algos.py`):
- a group with ONE sample gets mean 0 and std 1 (so A = s / (1 + eps), or A = s for Dr.GRPO);
- otherwise mean and UNBIASED std (N - 1); A = (s - mean) / (std + eps), eps = 1e-6;
- all-equal groups get A = 0 with no explicit mask; we only log their fraction (`adv/zero_std_group_frac`).

Distributed form (why the `all_reduce_sum` argument): the samples of one group may live on several ranks
(TP scatter, DAPO rebalancing), so statistics come from per-group SUMS that the caller all-reduces. This
module stays free of `torch.distributed`: the caller passes `all_reduce_sum`, which must return the
element-wise sum of its argument over all ranks (identity = single process). It is called on float64
tensors of shape [G], in the same order on every rank: count, sum, sum of squared deviations (three small
collectives per call). Two passes (mean first, then squared deviations from it) instead of one pass of
sum(s^2) avoid catastrophic cancellation.

Deviations from the papers and from verl:
- Statistics are computed in float64 and advantages returned in float32 (verl: float32 throughout). For
  float32 scores every pass-1 partial sum is exact in float64, so the group means are bit-identical however
  the batch is split across ranks; only pass 2 can differ in the last bit.
- "Zero spread" (the metric and `group_has_spread`) means population std <= 1e-12 * |mean|, not exactly 0,
  so float64 scores such as 0.1 + 0.1 + 0.1, whose float64 mean is not exactly 0.1, still count as equal.
  For float32 scores this is the same as std == 0 (see above). verl uses `np.std(...) > 0` in DAPO.
- Batch std: std is the unbiased std of the raw scores over the whole global batch (TRL `scale_rewards=
  "batch"`), the numerator is still s - group mean with verl's group-of-one convention (mean 0), and eps is
  1e-6 (TRL uses 1e-4). A global batch of one sample, or of all-equal scores ("zero spread" as above), uses
  std 1: TRL's groups of one have advantage 0, ours keep the numerator s, which std 0 would turn into
  s / eps. REINFORCE++-baseline instead whitens the centred advantages over the batch's tokens; that is not
  what this computes.
- Scores are per sample (the caller sums token-level rewards); `group_index` is a global integer in [0, G)
  rather than verl's uid strings, so that per-group sums can be all-reduced as dense tensors.

Shape legend:
    B: samples held by this rank        G: number of groups (prompts) in the GLOBAL batch
"""

from collections.abc import Callable

import torch
from torch import Tensor

AllReduceSum = Callable[[Tensor], Tensor]

# Population std below this fraction of |mean| counts as "all scores equal" (see module docstring).
_ZERO_SPREAD_RTOL = 1e-12


def _identity(t: Tensor) -> Tensor:
    return t


def _check_inputs(values: Tensor, group_index: Tensor, num_groups: int) -> None:
    if values.dim() != 1 or group_index.shape != values.shape:
        raise ValueError(
            f"expected scores [B] and group_index [B], got {tuple(values.shape)} and {tuple(group_index.shape)}"
        )
    if group_index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"group_index must be an integer tensor, got {group_index.dtype}")
    if num_groups <= 0:
        raise ValueError(f"num_groups must be positive, got {num_groups}")
    if group_index.numel() > 0 and (group_index.min() < 0 or group_index.max() >= num_groups):
        raise ValueError(
            f"group_index must lie in [0, {num_groups}), got values in "
            f"[{int(group_index.min())}, {int(group_index.max())}]"
        )


def _group_sum(values: Tensor, group_index: Tensor, num_groups: int) -> Tensor:
    """[B] float64 -> [G] per-group sums of this rank's samples."""
    return values.new_zeros(num_groups).index_add_(0, group_index, values)


def _group_moments(
    values: Tensor, group_index: Tensor, num_groups: int, all_reduce_sum: AllReduceSum
) -> tuple[Tensor, Tensor, Tensor]:
    """Global per-group (count, mean, sum of squared deviations from the mean), all float64 [G].

    A group with no samples anywhere gets count 0, mean 0 and squared deviations 0.
    """
    values = values.to(torch.float64)
    group_index = group_index.long()
    count = all_reduce_sum(_group_sum(torch.ones_like(values), group_index, num_groups))
    total = all_reduce_sum(_group_sum(values, group_index, num_groups))
    mean = total / count.clamp(min=1)
    deviation = values - mean[group_index]
    sq_dev_sum = all_reduce_sum(_group_sum(deviation * deviation, group_index, num_groups))
    return count, mean, sq_dev_sum


def _has_spread(count: Tensor, mean: Tensor, sq_dev_sum: Tensor) -> Tensor:
    """[G] bool: the group's values are not all equal (False for groups of 0 or 1 samples)."""
    population_std = torch.sqrt(sq_dev_sum / count.clamp(min=1))
    return (count > 1) & (population_std > _ZERO_SPREAD_RTOL * mean.abs())


def _zero_std_group_frac(count: Tensor, mean: Tensor, sq_dev_sum: Tensor) -> float:
    """Fraction of groups with >1 sample whose values are all equal (0.0 when there are none)."""
    multi = count > 1
    num_multi = int(multi.sum())
    if num_multi == 0:
        return 0.0
    num_flat = int((multi & ~_has_spread(count, mean, sq_dev_sum)).sum())
    return num_flat / num_multi


def compute_grpo_advantages(
    scores: Tensor,
    group_index: Tensor,
    num_groups: int,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    all_reduce_sum: AllReduceSum = _identity,
) -> tuple[Tensor, dict[str, float]]:
    """GRPO outcome advantages, one per sample: float32 [B], plus metrics.

    norm_by_std=True: A = (s - mean) / (std + eps) (GRPO); False: A = s - mean (Dr.GRPO). A group of one
    sample uses mean 0 and std 1, as verl. Every rank must call this with the same `num_groups`.
    Metrics: `adv/zero_std_group_frac` over the global batch (identical on every rank).
    """
    _check_inputs(scores, group_index, num_groups)
    count, mean, sq_dev_sum = _group_moments(scores, group_index, num_groups, all_reduce_sum)
    singleton = count == 1
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    std = torch.sqrt(sq_dev_sum / (count - 1).clamp(min=1))
    std = torch.where(singleton, torch.ones_like(std), std)

    index = group_index.long()
    advantages = scores.to(torch.float64) - mean[index]
    if norm_by_std:
        advantages = advantages / (std[index] + eps)
    metrics = {"adv/zero_std_group_frac": _zero_std_group_frac(count, mean, sq_dev_sum)}
    return advantages.to(torch.float32), metrics


def compute_batch_std_advantages(
    scores: Tensor,
    group_index: Tensor,
    num_groups: int,
    *,
    eps: float = 1e-6,
    all_reduce_sum: AllReduceSum = _identity,
) -> tuple[Tensor, dict[str, float]]:
    """Group mean, batch std: A = (s - group mean) / (std of all scores in the global batch + eps).

    The batch std is the unbiased std of the raw scores over every sample on every rank. It is derived from
    the per-group moments (Chan et al.'s parallel-variance formula), so no extra collective is needed:
    sum (s - m_batch)^2 = sum_g [M2_g + n_g (m_g - m_batch)^2]. A group of one keeps verl's mean 0; a global
    batch of one sample, or one whose scores are all equal, uses std 1 (then a group of one gets s / (1 + eps),
    as under GRPO, instead of s / eps, and every other advantage is 0). Metrics: `adv/zero_std_group_frac`,
    `adv/batch_std` (the std divided by).
    """
    _check_inputs(scores, group_index, num_groups)
    count, mean, sq_dev_sum = _group_moments(scores, group_index, num_groups, all_reduce_sum)
    num_samples = count.sum()
    batch_mean = (count * mean).sum() / num_samples.clamp(min=1)
    batch_sq_dev_sum = (sq_dev_sum + count * (mean - batch_mean) ** 2).sum()
    population_std = torch.sqrt(batch_sq_dev_sum / num_samples.clamp(min=1))
    if num_samples > 1 and population_std > _ZERO_SPREAD_RTOL * batch_mean.abs():
        batch_std = torch.sqrt(batch_sq_dev_sum / (num_samples - 1))
    else:  # no spread: only groups of one have a non-zero numerator (s), which must not be divided by eps
        batch_std = torch.ones_like(batch_sq_dev_sum)

    group_mean = torch.where(count == 1, torch.zeros_like(mean), mean)
    advantages = (scores.to(torch.float64) - group_mean[group_index.long()]) / (batch_std + eps)
    metrics = {
        "adv/zero_std_group_frac": _zero_std_group_frac(count, mean, sq_dev_sum),
        "adv/batch_std": float(batch_std),
    }
    return advantages.to(torch.float32), metrics


def group_has_spread(
    metric_values: Tensor,
    group_index: Tensor,
    num_groups: int,
    all_reduce_sum: AllReduceSum = _identity,
) -> Tensor:
    """DAPO dynamic sampling: which groups to keep, bool [G] (identical on every rank).

    Keep a group if its metric (usually the score or accuracy) is not the same for all its samples, or if
    it has exactly one sample (verl's `std > 0 or len == 1`). A group with no samples anywhere is not kept.
    """
    _check_inputs(metric_values, group_index, num_groups)
    count, mean, sq_dev_sum = _group_moments(metric_values, group_index, num_groups, all_reduce_sum)
    return (count == 1) | _has_spread(count, mean, sq_dev_sum)
