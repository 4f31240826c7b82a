"""The policy update: forward-only logprobs in micro-batches, and PPO-clip steps over mini-batches.

Shapes: b = micro-batch size per rank, R = longest response in the micro-batch.

Global normalisation: before each mini-batch the ranks all-reduce its number of valid response tokens and
sequences; every micro-batch's loss is its contribution to that GLOBAL aggregate (loss.aggregate), so the
gradient does not depend on how the mini-batch is split into micro-batches or ranks. FSDP2 averages
gradients over ranks; the loss is multiplied by the world size to turn that average into the sum.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from torch import nn

from .config import ActorConfig, AlgorithmConfig, DataConfig
from .distributed import World, all_reduce_max, all_reduce_min, all_reduce_sum
from .logprobs import SequenceBatch, collate
from .loss import aggregate, kl_penalty, policy_loss
from .metrics import global_means
from .rollout import Sample

log = logging.getLogger(__name__)


def collate_samples(samples: list[Sample], pad_id: int, device: torch.device | str = "cpu") -> SequenceBatch:
    """Right-padded prompt+response batch of rollout samples, with their images, on `device`."""
    return collate(
        [s.prompt_ids for s in samples],
        [s.response_ids for s in samples],
        [s.pixel_values for s in samples],
        [s.image_grid_thw for s in samples],
        pad_id,
    ).to(device)


def _pad(rows: list[torch.Tensor], width: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=torch.float32, device=device)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r.to(device)
    return out


@torch.no_grad()
def compute_logprobs(
    model: nn.Module, samples: list[Sample], actor: ActorConfig, temperature: float, pad_id: int
) -> list[torch.Tensor]:
    """Per-sample response logprobs (1-D CPU float32 tensors), micro-batched for experience."""
    device = next(model.parameters()).device
    out: list[torch.Tensor] = []
    size = actor.micro_batch_size_per_device_for_experience
    for start in range(0, len(samples), size):
        chunk = samples[start : start + size]
        lp, _ = model(collate_samples(chunk, pad_id, device), temperature=temperature)
        out += [lp[i, : len(s.response_ids)].float().cpu() for i, s in enumerate(chunk)]
    return out


def mini_batch_backward(
    policy: nn.Module,
    samples: list[Sample],
    old_logprobs: list[torch.Tensor],
    ref_logprobs: list[torch.Tensor] | None,
    advantages: torch.Tensor,
    actor: ActorConfig,
    alg: AlgorithmConfig,
    max_response_length: int,
    temperature: float,
    pad_id: int,
    world: World,
) -> dict[str, tuple[float, float]]:
    """Accumulate the gradient of one mini-batch (this rank's `samples`) in micro-batches.

    Returns metric sums {name: (local sum, local count)}. The loss contributions are shares of the global
    mini-batch value, so the gradient is the same for any micro-batch size and any world size.
    """
    device = next(policy.parameters()).device
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
    counts = all_reduce_sum(
        torch.tensor([lengths.sum().item(), float((lengths > 0).sum())], dtype=torch.float64)
    )
    agg = dict(
        num_global_tokens=max(counts[0].item(), 1.0),
        num_global_seqs=max(counts[1].item(), 1.0),
        max_response_length=max_response_length,
    )
    sums: dict[str, tuple[float, float]] = {}

    def add(name: str, total: float, count: float) -> None:
        s, c = sums.get(name, (0.0, 0.0))
        sums[name] = (s + total, c + count)

    size = actor.micro_batch_size_per_device_for_update
    for start in range(0, len(samples), size):
        idx = list(range(start, min(start + size, len(samples))))
        batch = collate_samples([samples[i] for i in idx], pad_id, device)
        mask = batch.response_mask
        width = mask.shape[1]
        logprobs, entropy = policy(batch, temperature=temperature, with_entropy=True)
        old = _pad([old_logprobs[i] for i in idx], width, device)
        adv = advantages[idx].to(device)[:, None].expand_as(mask) * mask
        pg_loss, pg_metrics = policy_loss(
            logprobs,
            old,
            adv,
            mask,
            clip_ratio_low=actor.clip_ratio_low,
            clip_ratio_high=actor.clip_ratio_high,
            clip_ratio_dual=actor.clip_ratio_dual if actor.loss_mode == "vanilla" else None,
            loss_mode=actor.loss_mode,
            loss_agg_mode=actor.loss_agg_mode,
            **agg,
        )
        loss = pg_loss
        entropy_agg = aggregate(entropy, mask, actor.loss_agg_mode, **agg)
        if actor.entropy_coef != 0:
            loss = loss - actor.entropy_coef * entropy_agg
        if ref_logprobs is not None:
            ref = _pad([ref_logprobs[i] for i in idx], width, device)
            kl_agg = aggregate(kl_penalty(logprobs, ref, alg.kl_penalty), mask, actor.loss_agg_mode, **agg)
            loss = loss + alg.kl_coef * kl_agg
            add("actor/kl_loss", kl_agg.item(), 0.0)
        (loss * world.world_size).backward()
        # pg_loss etc. are shares of the global mini-batch value: summed over micro-batches and ranks they
        # give it; the caller adds a count of 1 per mini-batch (on rank 0) to average over mini-batches.
        add("actor/pg_loss", pg_loss.item(), 0.0)
        add("actor/entropy", entropy_agg.item(), 0.0)
        for name, (total, count) in pg_metrics.items():
            add(f"actor/{name}", float(total), float(count))
    return sums


def update_policy(
    policy: nn.Module,
    optim,
    samples: list[Sample],
    old_logprobs: list[torch.Tensor],
    ref_logprobs: list[torch.Tensor] | None,
    advantages: torch.Tensor,
    actor: ActorConfig,
    alg: AlgorithmConfig,
    data: DataConfig,
    temperature: float,
    pad_id: int,
    world: World,
    clip_grad_norm: Callable[[nn.Module, float], float],
) -> dict[str, float]:
    """ppo_epochs x mini-batches (global_batch_size samples over all ranks) x micro-batches; returns metrics."""
    mini_size = actor.global_batch_size // world.world_size
    sums: dict[str, tuple[float, float]] = {}
    grad_norms, lrs = [], []
    num_micro_batches = 0
    for _ in range(actor.ppo_epochs):
        for start in range(0, len(samples), mini_size):
            idx = list(range(start, min(start + mini_size, len(samples))))
            num_micro_batches += math.ceil(len(idx) / actor.micro_batch_size_per_device_for_update)
            optim.optimizer.zero_grad(set_to_none=True)
            mini_sums = mini_batch_backward(
                policy,
                [samples[i] for i in idx],
                [old_logprobs[i] for i in idx],
                [ref_logprobs[i] for i in idx] if ref_logprobs is not None else None,
                advantages[idx],
                actor,
                alg,
                data.max_response_length,
                temperature,
                pad_id,
                world,
            )
            for name, (total, count) in mini_sums.items():
                if name in ("actor/pg_loss", "actor/entropy", "actor/kl_loss") and world.rank == 0:
                    count += 1.0
                s, c = sums.get(name, (0.0, 0.0))
                sums[name] = (s + total, c + count)
            grad_norm = clip_grad_norm(policy, actor.max_grad_norm)
            grad_norms.append(grad_norm)
            lrs.append(optim.scheduler.get_last_lr()[0])
            if math.isfinite(grad_norm):
                optim.optimizer.step()
            else:
                log.warning("non-finite grad norm %s: optimizer step skipped", grad_norm)
            optim.optimizer.zero_grad(set_to_none=True)
    optim.scheduler.step()
    metrics = global_means(sums)
    metrics["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
    metrics["actor/lr"] = lrs[-1]
    # Every rank must run the same number of forward/backward passes (else FSDP collectives hang): logged.
    count = torch.tensor([float(num_micro_batches)])
    metrics["train/num_micro_batches_min"] = float(all_reduce_min(count))
    metrics["train/num_micro_batches_max"] = float(all_reduce_max(count))
    if ref_logprobs is not None:
        metrics["actor/kl_coef"] = alg.kl_coef
    return metrics
