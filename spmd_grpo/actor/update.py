"""The policy update: forward-only logprobs in micro-batches, and PPO-clip steps over mini-batches.

Shapes: b = micro-batch size per rank, R = longest response in the micro-batch.

Global normalisation: before each mini-batch the ranks all-reduce its number of valid response tokens and
sequences; every micro-batch's loss is its contribution to that GLOBAL aggregate (loss.aggregate), so the
gradient does not depend on how the mini-batch is split into micro-batches or ranks. FSDP2 averages
gradients over ranks; the loss is multiplied by the world size to turn that average into the sum.

Metrics: `actor/pg_loss`, `actor/entropy` and `actor/kl_loss` are the global mini-batch values averaged over
the step's mini-batches and epochs; `actor/pg_clipfrac`, `pg_clipfrac_lower` and `ppo_kl` are token-means
over all of them. verl's dp actor differs: its `pg_loss` and `kl_loss` add up each rank's micro-batch shares
over EVERY mini-batch and epoch (k mini-batches: k times the value here, for the same losses), its entropy
and clip fractions are means of per-micro-batch values. Without an entropy bonus (verl's default
`entropy_coeff: 0`, `calculate_entropy` off) verl's `actor/entropy` comes from its old-logprob pass instead:
the old policy over the whole step batch, the value here only with one mini-batch and one epoch. Here it is
always the update's, over the tokens it trains on (the rollout correction's rejected tokens left out).
`actor/grad_norm` is the mean over the step's optimizer steps of the global norm before clipping (a
non-finite one included), `actor/lr` the rate those steps used (the schedule advances once per step), both
as verl.

Every setting the update reads travels as one frozen `UpdateSpec`, resolved from the config once; every
per-sample input (old and reference logprobs, advantage) is a field of the `Sample` record.

Rollout correction (algorithm/correction.py, `algorithm.rollout_correction`): each mini-batch's IS weights and
rejection mask are computed from the samples' old and vLLM logprobs before its token counts are all-reduced;
rejected tokens leave the mask of the policy, entropy and KL terms and the global counts (verl's choice), the
policy-gradient loss of the kept tokens is multiplied by the weights. Its metrics are computed once per step
over all samples.

Token-budget micro-batches (`worker.actor.dynamic_batching`, EasyR1/verl's `max_token_len_per_device_*`):
a rank's samples are split into k = ceil(its prompt+response tokens / budget) micro-batches (at most one per
sample), k is all-reduced with MAX, and the samples are partitioned into k parts of balanced token sums by
Karmarkar-Karp's largest differencing method (verl's `rearrange_micro_batches` with
`get_seqlen_balanced_partitions(..., equal_size=False)`; like verl, a part is not checked against the budget,
and parts are kept in the order of their first sample instead of verl's workload-sorted order). A rank with
fewer non-empty parts than k runs the missing ones as padding: a forward/backward of one of its own samples
with zero loss weight, so every rank runs the same number of FSDP forward/backward calls (verl instead
requires k <= number of samples and asserts that no part is empty). That balance is right for packed
(padding-free) micro-batches, whose cost follows their token sum; a right-padded micro-batch costs
(count x longest), and balanced parts would each hold a long sample and pad every part to it, so without
packing the k parts are runs of the length-sorted samples instead (`length_sorted_partitions`, minimising
the largest padded part; a deviation from verl, which always packs). The losses keep their global
normalisation, so the gradient does not depend on the partition.

Shared prompts (`worker.actor.shared_prompt`, micro_batches.py): each micro-batch holds a group's prompt once;
the loss mask covers the responses only, so the counts above and the gradient are those of the unshared
passes. `perf/shared_prompt_tokens_saved`: the prompt tokens one epoch of the update did not compute, summed
over ranks (the forward-only passes skip the same share of theirs).

On the CPU (`gathering.accumulate_unsharded`, any world size): the parameters are gathered once per
mini-batch and the gradient reduced once, after its last micro-batch, instead of FSDP's re-gather in every
micro-batch's forward and backward and a reduction per micro-batch (the same sum of the same micro-batch
gradients).

Old logprobs from the update's forward (`worker.actor.old_logprobs_from_update`, as TRL does): when the step
is exactly on-policy (one mini-batch per step, one epoch, no rejection sampling, which needs the old
logprobs before the first forward to count the kept tokens), pi_old IS the policy of the update's only
forward, so old = logprobs.detach() there and the separate forward-only pass is skipped (the samples'
`old_logprobs` are set from it for the metrics and the rollout correction's IS weights, computed per
micro-batch). Where a separate pass runs the same micro-batches, its logprobs are bit-identical to the
update's forward, and so are the losses and the gradient (tested under FSDP2 on 2 ranks); with other
experience micro-batches they differ by rounding only. With more mini-batches or epochs the policy moves
before later samples are used, and the separate pass is kept.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
from torch import nn

from spmd_grpo.actor.gathering import accumulate_unsharded, end_accumulation, gathers_once_per_pass
from spmd_grpo.actor.micro_batches import (
    collate_for,
    micro_batches,
    pad_rows,
    uses_packing,
    uses_shared_prompt,
)
from spmd_grpo.actor.optimizer import clip_grad_norm
from spmd_grpo.actor.spec import UpdateSpec
from spmd_grpo.algorithm.correction import Correction, MetricSums, rollout_correction
from spmd_grpo.algorithm.loss import aggregate, kl_penalty, policy_loss
from spmd_grpo.data.samples import Sample
from spmd_grpo.models.inputs import SequenceBatch
from spmd_grpo.parallel.collectives import World, all_reduce_max, all_reduce_min, all_reduce_sum
from spmd_grpo.telemetry.metrics import global_means

log = logging.getLogger(__name__)


MINI_BATCH_SHARES = ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/router_aux_loss")
"""Metrics summed as shares of the mini-batch value over micro-batches and ranks (one count per mini-batch)."""


def _add(sums: MetricSums, name: str, total: float, count: float) -> None:
    s, c = sums.get(name, (0.0, 0.0))
    sums[name] = (s + total, c + count)


def padded_correction(samples: list[Sample], spec: UpdateSpec) -> Correction | None:
    """The rollout correction of `samples`, [len(samples), longest response] on CPU; None when it is off."""
    if not spec.rollout_correction.enabled:
        return None
    width = max([len(s.response_ids) for s in samples] + [1])  # collate's response width
    old = pad_rows([s.old_logprobs for s in samples], width, torch.device("cpu"))
    vllm = pad_rows([torch.tensor(s.rollout_logprobs) for s in samples], width, torch.device("cpu"))
    mask = pad_rows([torch.ones(len(s.response_ids)) for s in samples], width, torch.device("cpu"))
    return rollout_correction(old, vllm, mask, spec.rollout_correction)


def _train_mask(
    response_mask: torch.Tensor, correction: Correction | None, spec: UpdateSpec
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(mask of the tokens to train on, IS weights or None): `correction` holds this micro-batch's rows."""
    if correction is None:
        return response_mask, None
    width, device = response_mask.shape[1], response_mask.device
    keep = correction.keep[:, :width].to(device)
    weights = correction.weights[:, :width].to(device) if spec.rollout_correction.rollout_is else None
    return response_mask * keep, weights


def _index_rows(correction: Correction | None, rows: list[int]) -> Correction | None:
    """The micro-batch `rows` of a mini-batch's correction (metric sums kept as they are: unused here)."""
    if correction is None or not rows:
        return None
    index = torch.tensor(rows, dtype=torch.long)
    return dataclasses.replace(correction, weights=correction.weights[index], keep=correction.keep[index])


def _old_from_forward(samples: list[Sample], logprobs: torch.Tensor, spec: UpdateSpec, *, store: bool):
    """Old logprobs taken detached from the update's own forward ([b, R]) and this micro-batch's rollout
    correction from them; with `store` they become the samples' `old_logprobs` (for the metrics)."""
    old = logprobs.detach()
    if store:
        for i, s in enumerate(samples):
            s.old_logprobs = old[i, : len(s.response_ids)].float().cpu()
    return old, padded_correction(samples, spec) if store else None


def _micro_batch_loss(
    policy: nn.Module,
    samples: list[Sample],
    spec: UpdateSpec,
    agg: dict,
    sums: MetricSums,
    correction: Correction | None = None,
    *,
    old_from_forward: bool = False,
    padding: bool = False,
    aux_weight: float = 0.0,
) -> torch.Tensor:
    """This micro-batch's share of the global mini-batch loss; adds its metric sums to `sums`.
    `old_from_forward`: the old logprobs (and the rollout correction) come from this forward, detached.
    `padding`: a zero-weight micro-batch that only keeps the ranks' forward/backward counts equal.
    `aux_weight`: this micro-batch's share of the rank's router aux loss (MoE, see `_router_aux_loss`).
    """
    device = policy.compute_device
    batch = collate_for(policy, samples, spec, for_update=True, padding=padding)
    logprobs, entropy = policy(batch, temperature=spec.temperature, with_entropy=True)
    if not padding:
        _count_shared_prompt_tokens(batch, sums)
    width = batch.response_mask.shape[1]
    if old_from_forward or padding:
        old, correction = _old_from_forward(samples, logprobs, spec, store=not padding)
    else:
        old = pad_rows([s.old_logprobs for s in samples], width, device)
    mask, is_weights = _train_mask(batch.response_mask, correction, spec)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    adv = advantages.to(device)[:, None].expand_as(mask) * mask
    pg_loss, pg_metrics = policy_loss(
        logprobs,
        old,
        adv,
        mask,
        clip_ratio_low=spec.clip_ratio_low,
        clip_ratio_high=spec.clip_ratio_high,
        clip_ratio_dual=spec.clip_ratio_dual,
        loss_mode=spec.loss_mode,
        loss_agg_mode=spec.loss_agg_mode,
        rollout_is_weights=is_weights,
        **agg,
    )
    loss = pg_loss
    entropy_agg = aggregate(entropy, mask, spec.loss_agg_mode, **agg)
    if spec.entropy_coef != 0:
        loss = loss - spec.entropy_coef * entropy_agg
    if spec.use_kl_loss:
        ref = pad_rows([s.ref_logprobs for s in samples], width, device)
        kl_agg = aggregate(kl_penalty(logprobs, ref, spec.kl_penalty), mask, spec.loss_agg_mode, **agg)
        loss = loss + spec.kl_coef * kl_agg
        _add(sums, "actor/kl_loss", kl_agg.item(), 0.0)
    loss = loss + _router_aux_loss(policy, sums, aux_weight)
    # pg_loss etc. are shares of the global mini-batch value: summed over micro-batches and ranks they
    # give it; the caller adds a count of 1 per mini-batch (on rank 0) to average over mini-batches.
    _add(sums, "actor/pg_loss", pg_loss.item(), 0.0)
    _add(sums, "actor/entropy", entropy_agg.item(), 0.0)
    for name, (total, count) in pg_metrics.items():
        _add(sums, f"actor/{name}", float(total), float(count))
    return loss * 0.0 if padding else loss


def _count_shared_prompt_tokens(batch: SequenceBatch, sums: MetricSums) -> None:
    """`perf/shared_prompt_tokens_saved`: the prompt tokens this forward did not compute (held once per group)."""
    if batch.shares_prompt is not None:
        saved = batch.prompt_lengths[batch.shares_prompt.to(batch.prompt_lengths.device)].sum().item()
        _add(sums, "perf/shared_prompt_tokens_saved", float(saved), 0.0)


def _router_aux_loss(policy: nn.Module, sums: MetricSums, weight: float) -> torch.Tensor | float:
    """coef x the routers' load-balancing loss of this forward (an MoE policy with
    `worker.actor.moe.router_aux_loss_coef` > 0), times `weight`: the micro-batch's tokens over the rank's
    mini-batch tokens, over the world size, so the gradient is the token-weighted mean of the micro-batch
    losses averaged over ranks. transformers computes the loss once per forward batch; here a mini-batch
    of several micro-batches gets the weighted mean of theirs (Megatron also computes it per micro-batch)."""
    moe = getattr(policy, "moe", None)
    if moe is None or moe.aux_loss_coef <= 0:
        return 0.0
    aux = moe.aux_loss_value()
    _add(sums, "actor/router_aux_loss", aux.item() * weight, 0.0)
    return moe.aux_loss_coef * weight * aux


def _global_counts(samples: list[Sample], correction: Correction | None, spec: UpdateSpec) -> dict:
    """The mini-batch's global token and sequence counts (all ranks; rejected tokens not counted)."""
    if correction is None:
        lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
    else:
        lengths = correction.keep.sum(dim=-1).double()
    counts = all_reduce_sum(
        torch.tensor([lengths.sum().item(), float((lengths > 0).sum())], dtype=torch.float64)
    )
    return dict(
        num_global_tokens=max(counts[0].item(), 1.0),
        num_global_seqs=max(counts[1].item(), 1.0),
        max_response_length=spec.max_response_length,
    )


def mini_batch_backward(
    policy: nn.Module,
    samples: list[Sample],
    spec: UpdateSpec,
    world: World,
    *,
    old_from_forward: bool = False,
) -> MetricSums:
    """Accumulate the gradient of one mini-batch (this rank's `samples`) in micro-batches.

    Returns metric sums {name: (local sum, local count)} plus `train/num_micro_batches` (forward/backward
    calls, padding included). The loss contributions are shares of the global mini-batch value, so the
    gradient is the same for any micro-batch split and any world size. With `old_from_forward` the samples'
    old logprobs are taken from this forward (exactly on-policy steps only; no rejection sampling).
    """
    if old_from_forward and spec.rollout_correction.rollout_rs is not None:
        raise ValueError("old logprobs from the update's forward cannot be used with rollout_rs")
    correction = None if old_from_forward else padded_correction(samples, spec)
    agg = _global_counts(samples, correction, spec)
    sums: MetricSums = {}
    shared = uses_shared_prompt(policy)
    plan = micro_batches(samples, spec, for_update=True, padded=not uses_packing(policy), shared=shared)
    once = gathers_once_per_pass(policy)
    tokens = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    for k, rows in enumerate(plan):
        if once:
            accumulate_unsharded(policy, first=k == 0, last=k == len(plan) - 1)
        loss = _micro_batch_loss(
            policy,
            [samples[i] for i in rows] or samples[:1],
            spec,
            agg,
            sums if rows else {},
            _index_rows(correction, rows),
            old_from_forward=old_from_forward,
            padding=not rows,
            aux_weight=sum(tokens[i] for i in rows) / sum(tokens) / world.world_size,
        )
        (loss * world.world_size).backward()
    if once:
        end_accumulation(policy)
    sums["train/num_micro_batches"] = (float(len(plan)), 0.0)
    return sums


def _optimizer_step(policy: nn.Module, optim, spec: UpdateSpec) -> tuple[float, float]:
    """Clip by the global norm and step (skipped on a non-finite norm); returns (grad norm, lr)."""
    grad_norm = clip_grad_norm(policy, spec.max_grad_norm)
    lr = optim.scheduler.get_last_lr()[0]
    if math.isfinite(grad_norm):
        optim.optimizer.step()
    else:
        log.warning("non-finite grad norm %s: optimizer step skipped", grad_norm)
    optim.optimizer.zero_grad(set_to_none=True)
    return grad_norm, lr


def update_policy(
    policy: nn.Module, optim, samples: list[Sample], spec: UpdateSpec, world: World
) -> dict[str, float]:
    """ppo_epochs x mini-batches (global_batch_size samples over all ranks) x micro-batches; returns metrics.

    When `spec.old_logprobs_in_update(len(samples))`, the samples' old logprobs are set here (from the
    update's forward) and the caller skips the forward-only pass."""
    sums: MetricSums = {}
    grad_norms, lrs = [], []
    num_micro_batches, saved = 0, 0.0
    old_from_forward = spec.old_logprobs_in_update(len(samples))
    for _ in range(spec.ppo_epochs):
        for start in range(0, len(samples), spec.mini_batch_size):
            mini = samples[start : start + spec.mini_batch_size]
            optim.optimizer.zero_grad(set_to_none=True)
            mini_sums = mini_batch_backward(policy, mini, spec, world, old_from_forward=old_from_forward)
            num_micro_batches += int(mini_sums.pop("train/num_micro_batches")[0])
            saved += mini_sums.pop("perf/shared_prompt_tokens_saved", (0.0, 0.0))[0]
            for name, (total, count) in mini_sums.items():
                if name in MINI_BATCH_SHARES and world.rank == 0:
                    count += 1.0
                _add(sums, name, total, count)
            grad_norm, lr = _optimizer_step(policy, optim, spec)
            grad_norms.append(grad_norm)
            lrs.append(lr)
    optim.scheduler.step()
    metrics = global_means(sums)
    metrics.update(correction_metrics(samples, spec))
    metrics["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
    metrics["actor/lr"] = lrs[-1]
    # Every rank must run the same number of forward/backward passes (else FSDP collectives hang): logged.
    count = torch.tensor([float(num_micro_batches)])
    metrics["train/num_micro_batches_min"] = float(all_reduce_min(count))
    metrics["train/num_micro_batches_max"] = float(all_reduce_max(count))
    # Prompt tokens one epoch of the update did not compute (all ranks); the forward-only passes save the
    # same share of theirs.
    metrics["perf/shared_prompt_tokens_saved"] = (
        float(all_reduce_sum(torch.tensor([saved]))) / spec.ppo_epochs
    )
    if spec.use_kl_loss:
        metrics["actor/kl_coef"] = spec.kl_coef
    return metrics


def correction_metrics(samples: list[Sample], spec: UpdateSpec) -> dict[str, float]:
    """`rollout_corr/*` over every rank's `samples` (empty when the correction is off); collective."""
    correction = padded_correction(samples, spec)
    if correction is None:
        return {}
    metrics = global_means(correction.sums)
    names = sorted(correction.maxima)
    maxima = all_reduce_max(torch.tensor([correction.maxima[n] for n in names], dtype=torch.float64))
    metrics.update(zip(names, maxima.tolist(), strict=True))
    return metrics
