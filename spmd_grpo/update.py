"""The policy update: forward-only logprobs in micro-batches, and PPO-clip steps over mini-batches.

Shapes: b = micro-batch size per rank, R = longest response in the micro-batch.

Global normalisation: before each mini-batch the ranks all-reduce its number of valid response tokens and
sequences; every micro-batch's loss is its contribution to that GLOBAL aggregate (loss.aggregate), so the
gradient does not depend on how the mini-batch is split into micro-batches or ranks. FSDP2 averages
gradients over ranks; the loss is multiplied by the world size to turn that average into the sum.

Every setting the update reads travels as one frozen `UpdateSpec`, resolved from the config once; every
per-sample input (old and reference logprobs, advantage) is a field of the `Sample` record.

Rollout correction (correction.py, `algorithm.rollout_correction`): each mini-batch's IS weights and
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

One rank on the CPU (`_accumulate_unsharded`): the parameters are gathered once per mini-batch and the gradient
reduced once, after its last micro-batch, instead of FSDP's re-gather in every micro-batch's forward and
backward and a reduction per micro-batch (the same sum of the same micro-batch gradients).

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
import heapq
import itertools
import logging
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from .config import Config
from .correction import Correction, CorrectionSpec, rollout_correction
from .distributed import World, all_reduce_max, all_reduce_min, all_reduce_sum
from .families import family_of
from .logprobs import ImageBatch, SequenceBatch, collate
from .loss import aggregate, kl_penalty, policy_loss
from .metrics import global_means
from .model import clip_grad_norm
from .rollout import Sample

log = logging.getLogger(__name__)

MetricSums = dict[str, tuple[float, float]]


@dataclass(frozen=True)
class UpdateSpec:
    """What the trainer-side passes need from the config (one place, derived once)."""

    temperature: float
    pad_token_id: int
    max_response_length: int
    mini_batch_size: int
    """Samples per mini-batch on each rank (worker.actor.global_batch_size / world size)."""
    micro_batch_size: int
    experience_micro_batch_size: int
    ppo_epochs: int = 1
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_dual: float | None = 3.0
    """None for GSPO (dual clip is defined for the token ratio only)."""
    loss_mode: str = "vanilla"
    loss_agg_mode: str = "token-mean"
    entropy_coef: float = 0.0
    use_kl_loss: bool = False
    kl_penalty: str = "low_var_kl"
    kl_coef: float = 0.0
    max_grad_norm: float = 1.0
    rollout_correction: CorrectionSpec = field(default_factory=CorrectionSpec)
    """Off (both levels null) unless the config enables it."""
    reuse_image_features: bool = False
    """Encode each prompt's images once per step (`encode_images`); only with a frozen vision tower."""
    encode_once_per_pass: bool = False
    """A trained tower: each forward-only pass (`compute_logprobs`: old logprobs, reference) encodes each
    prompt's images once with its own model and drops the features after the pass."""
    dynamic_batching: bool = False
    """Micro-batches by token budget (the two below) instead of by sample count."""
    max_token_len_for_update: int = 16384
    max_token_len_for_experience: int = 16384
    old_logprobs_from_update: bool = False
    """Take the old logprobs from the update's forward when the step is exactly on-policy."""

    @classmethod
    def from_config(cls, cfg: Config, *, world_size: int, pad_token_id: int) -> UpdateSpec:
        a, alg = cfg.worker.actor, cfg.algorithm
        return cls(
            temperature=cfg.worker.rollout.temperature,
            pad_token_id=pad_token_id,
            max_response_length=cfg.data.max_response_length,
            mini_batch_size=a.global_batch_size // world_size,
            micro_batch_size=a.micro_batch_size_per_device_for_update,
            experience_micro_batch_size=a.micro_batch_size_per_device_for_experience,
            ppo_epochs=a.ppo_epochs,
            clip_ratio_low=a.clip_ratio_low,
            clip_ratio_high=a.clip_ratio_high,
            clip_ratio_dual=a.clip_ratio_dual if a.loss_mode == "vanilla" else None,
            loss_mode=a.loss_mode,
            loss_agg_mode=a.loss_agg_mode,
            entropy_coef=a.entropy_coef,
            use_kl_loss=alg.use_kl_loss,
            kl_penalty=alg.kl_penalty,
            kl_coef=alg.kl_coef,
            max_grad_norm=a.max_grad_norm,
            rollout_correction=CorrectionSpec(**dataclasses.asdict(alg.rollout_correction)),
            reuse_image_features=a.reuse_image_features and a.model.freeze_vision_tower,
            encode_once_per_pass=a.reuse_image_features and not a.model.freeze_vision_tower,
            dynamic_batching=a.dynamic_batching,
            max_token_len_for_update=a.max_token_len_per_device_for_update,
            max_token_len_for_experience=a.max_token_len_per_device_for_experience,
            old_logprobs_from_update=a.old_logprobs_from_update,
        )

    def old_logprobs_in_update(self, num_samples: int) -> bool:
        """True when the update takes the old logprobs from its own forward (the step is exactly on-policy:
        one epoch, one mini-batch holding this rank's `num_samples`, no rejection sampling)."""
        return (
            self.old_logprobs_from_update
            and self.ppo_epochs == 1
            and self.mini_batch_size >= num_samples
            and self.rollout_correction.rollout_rs is None
        )


def collate_samples(
    samples: list[Sample], pad_id: int, device: torch.device | str = "cpu", *, packed: bool = False
) -> SequenceBatch:
    """Prompt+response batch of rollout samples on `device`, right-padded or packed (padding-free), with
    their images: the precomputed features where `encode_images` attached them, else the pixels."""
    return collate(
        [s.prompt_ids for s in samples],
        [s.response_ids for s in samples],
        [s.pixel_values for s in samples],
        [s.image_grid_thw for s in samples],
        pad_id,
        packed=packed,
        image_features=[s.image_features for s in samples],
    ).to(device)


def _packs(model: nn.Module) -> bool:
    """Whether `model` takes packed (padding-free) micro-batches (its attention has a varlen path)."""
    return bool(getattr(model, "padding_free", False))


def _collate_for(model: nn.Module, samples: list[Sample], spec: UpdateSpec) -> SequenceBatch:
    """`samples` in the layout `model` was built for (packed when its attention has a varlen path)."""
    device = next(model.parameters()).device
    return collate_samples(samples, spec.pad_token_id, device, packed=_packs(model))


def _pad(rows: list[torch.Tensor], width: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=torch.float32, device=device)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r.to(device)
    return out


def balanced_partitions(lengths: list[int], k: int) -> list[list[int]]:
    """Indices of `lengths` in `k` parts of balanced sums (Karmarkar-Karp's largest differencing method).

    Each item starts as a k-way state (its own part plus k-1 empty ones); the two states with the largest
    spread are merged, pairing the largest part of one with the smallest of the other, until one is left.
    Parts come back with sorted indices, in the order of their first index; some may be empty when
    k > len(lengths).
    """
    if k < 1:
        raise ValueError(f"need at least one part, got {k}")
    tie = itertools.count()
    heap = []
    for i, n in sorted(enumerate(lengths), key=lambda item: (item[1], item[0])):
        parts = [(n, [i])] + [(0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-n, next(tie), parts))
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b), strict=True)]
        merged.sort(key=lambda part: -part[0])
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], next(tie), merged))
    parts = [sorted(items) for _, items in heap[0][2]] if heap else [[] for _ in range(k)]
    return sorted(parts, key=lambda p: (not p, p[0] if p else 0))


def length_sorted_partitions(lengths: list[int], k: int) -> list[list[int]]:
    """Indices of `lengths` in `k` parts of similar lengths, for right-padded micro-batches, whose cost is
    (count x longest): the lengths sorted and cut into `k` runs (non-empty while there are samples) that
    minimise the largest padded cost (dynamic programming over the cut points). Balanced token sums would
    instead put a long sample in every part and pad all of them to it. Parts come back with sorted indices,
    in the order of their first index; empty ones last."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    cut = _sorted_runs([lengths[i] for i in order], min(k, len(lengths)))
    parts, j = [], len(lengths)
    for g in range(len(cut) - 1, 0, -1):
        parts.append(sorted(order[cut[g][j] : j]))
        j = cut[g][j]
    parts += [[] for _ in range(k - len(cut) + 1)]
    return sorted(parts, key=lambda p: (not p, p[0] if p else 0))


def padded_part_count(lengths: list[int], budget: int) -> int:
    """The fewest length-sorted runs (`length_sorted_partitions`) whose padded cost (count x longest) is at
    most `budget` tokens each; one per sample when a single one is longer. The budget is what a right-padded
    micro-batch really holds in activations: cutting by token sums instead (ceil(sum / budget) parts) let
    one part of 32 samples, most short and one of 552 tokens, hold 17,664 padded tokens under a budget of
    10,240, both more memory than promised and most of it padding."""
    if not lengths:
        return 0
    cut = _sorted_runs(sorted(lengths), len(lengths), budget=budget)
    return len(cut) - 1


def _sorted_runs(a: list[int], k: int, *, budget: float | None = None) -> list[list[int]]:
    """The cut table of the dynamic program over sorted lengths `a`: row g (1..k) holds, for each j, where
    the last of g runs over the first j items starts when the largest padded cost of the g runs is least.
    With `budget`, rows stop at the first g whose least largest cost over all items is within it.

    The last run of the first j sorted items starts at the cut i minimising max(best[g-1][i], (j - i) x
    a[j-1]): the first term never decreases with i, the second strictly decreases, so the smallest minimiser
    is at their crossing, found by bisection: O(k n log n) instead of trying every i, O(k n^2) (1280
    samples in 100 parts: 33 s of pure Python that way, on every trainer pass of a step)."""
    n = len(a)
    prev = [0.0] + [float("inf")] * n  # best[g - 1][j]: the first j sorted items in g - 1 runs
    cuts: list[list[int]] = [[0] * (n + 1)]
    for g in range(1, k + 1):
        best, cut = [float("inf")] * (n + 1), [0] * (n + 1)
        for j in range(g, n + 1):
            cut[j] = i = _crossing(prev, g - 1, j, a[j - 1])
            best[j] = max(prev[i], (j - i) * a[j - 1])
        cuts.append(cut)
        prev = best
        if budget is not None and best[n] <= budget:
            break
    return cuts


def _crossing(prev: list[float], lo: int, j: int, longest: int) -> int:
    """The smallest i in [lo, j) minimising max(prev[i], (j - i) x longest), prev non-decreasing from lo."""
    left, right = lo, j  # the first i with prev[i] >= (j - i) x longest lies in [lo, j]
    while left < right:
        mid = (left + right) // 2
        if prev[mid] >= (j - mid) * longest:
            right = mid
        else:
            left = mid + 1
    if left == j:  # never crossed: the padded term is the larger one everywhere, least at j - 1
        return j - 1
    if left > lo and (j - left + 1) * longest <= prev[left]:
        return left - 1
    return left


def micro_batches(
    samples: list[Sample], spec: UpdateSpec, *, for_update: bool, padded: bool = False
) -> list[list[int]]:
    """Index lists of `samples`, one per forward; the same count on every rank (collective with dynamic
    batching). An empty list is a padding micro-batch (zero weight). With dynamic batching the parts
    balance token sums (packed layout: cost ~ tokens; ceil(tokens / budget) parts) or, `padded`, are runs
    of similar lengths, as few as keep every part's count x longest within the budget."""
    if not spec.dynamic_batching:
        size = spec.micro_batch_size if for_update else spec.experience_micro_batch_size
        return [list(range(i, min(i + size, len(samples)))) for i in range(0, len(samples), size)]
    budget = spec.max_token_len_for_update if for_update else spec.max_token_len_for_experience
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    if padded:
        local = padded_part_count(lengths, budget)
    else:
        local = min(len(samples), math.ceil(sum(lengths) / budget))
    k = int(all_reduce_max(torch.tensor([local], dtype=torch.long)).item())
    partition = length_sorted_partitions if padded else balanced_partitions
    parts = [p for p in partition(lengths, min(k, len(samples))) if p] if samples else []
    return parts + [[] for _ in range(k - len(parts))]


@torch.no_grad()
def compute_logprobs(model: nn.Module, samples: list[Sample], spec: UpdateSpec) -> list[torch.Tensor]:
    """Per-sample response logprobs (1-D CPU float32 tensors), micro-batched for experience (a padding
    micro-batch runs one of the rank's samples and drops the result). With a trained tower and
    `encode_once_per_pass`, `model` encodes each prompt's images once for the whole pass instead of once per
    sample: the tower's share of the pass drops by the factor n (Qwen2.5-VL-7B: a 675M-parameter tower over
    ~4 patches per image token, roughly a fifth of a geometry3k sample's forward, run once instead of 5
    times for n = 5)."""
    per_pass = spec.encode_once_per_pass and family_of(model.config).reusable_image_features
    if per_pass:
        _attach_image_features(model, samples, spec)
    out: list[torch.Tensor | None] = [None] * len(samples)
    for rows in micro_batches(samples, spec, for_update=False, padded=not _packs(model)):
        chunk = [samples[i] for i in rows] or samples[:1]
        lp, _ = model(_collate_for(model, chunk, spec), temperature=spec.temperature)
        for j, i in enumerate(rows):
            out[i] = lp[j, : len(samples[i].response_ids)].float().cpu()
    if per_pass:  # this model's features: not the next pass's, and the update must re-encode with grad
        for s in samples:
            s.image_features = None
    return out


def _dummy_image(hf_config) -> ImageBatch:
    """The smallest image the vision tower takes (2 x 2 patches, one merged token), for a rank with nothing
    left to encode while other ranks still run the tower (FSDP needs the same calls on every rank)."""
    v = hf_config.vision_config
    dim = v.in_channels * v.temporal_patch_size * v.patch_size**2
    merge = v.spatial_merge_size
    return ImageBatch(torch.zeros(merge * merge, dim), torch.tensor([[1, merge, merge]]))


@torch.no_grad()
def encode_images(model: nn.Module, samples: list[Sample], spec: UpdateSpec) -> None:
    """Run the vision tower once per prompt for the whole step and attach the features to its samples.

    Only with `spec.reuse_image_features` (a frozen vision tower) and a family whose language model takes
    only the tower's final output (not Qwen3-VL, see `Family.reusable_image_features`): the n samples of a prompt and every
    trainer pass of the step (old logprobs, reference, update) then feed the language model these features
    instead of re-encoding the pixels, which gives the same logprobs. The reference model's tower holds the
    same (frozen, initial) weights, so it takes the policy's features, cast to its own dtype. With a trained
    tower nothing is attached here: each forward-only pass encodes once per prompt with its own model
    (`UpdateSpec.encode_once_per_pass`: the reference's tower is its initial one, the policy's is fixed
    during the pass) and the update re-encodes in every forward, as the gradient needs.

    Collective: every rank runs the tower the same number of times (the MAX over ranks of its chunks of
    `experience_micro_batch_size` prompts; a rank with fewer encodes a dummy image), as FSDP requires.

    Memory: the features stay on the device for the step, [image tokens, H] per prompt in the compute dtype.
    Qwen2.5-VL-7B (H = 3584), ~1000 tokens per geometry3k image: 3584 x 1000 x 2 B = 7.2 MB per image in
    bf16, 115 MB for 16 prompts per rank; the pixels they replace are re-encoded three times or more per step
    without reuse (old, reference, each update epoch).
    """
    if spec.reuse_image_features and family_of(model.config).reusable_image_features:
        _attach_image_features(model, samples, spec)


@torch.no_grad()
def _attach_image_features(model: nn.Module, samples: list[Sample], spec: UpdateSpec) -> None:
    """`model`'s vision features of each prompt's images, encoded once (collective, see `encode_images`)
    and attached to every sample of the prompt."""
    prompts: dict[int, list[Sample]] = {}  # keyed by the pixel tensor its samples share
    for s in samples:
        if s.pixel_values is not None:
            prompts.setdefault(id(s.pixel_values), []).append(s)
    groups = list(prompts.values())
    size = spec.experience_micro_batch_size
    chunks = [groups[i : i + size] for i in range(0, len(groups), size)]
    num_calls = int(all_reduce_max(torch.tensor([float(len(chunks))])).item())
    device = next(model.parameters()).device
    for k in range(num_calls):
        if k >= len(chunks):
            model(_dummy_image(model.config).to(device))
            continue
        firsts = [g[0] for g in chunks[k]]
        images = ImageBatch(
            torch.cat([s.pixel_values for s in firsts]), torch.cat([s.image_grid_thw for s in firsts])
        )
        features = model(images.to(device))
        for group, s in zip(chunks[k], firsts, strict=True):
            mine, features = features[: len(s.image_grid_thw)], features[len(s.image_grid_thw) :]
            for sample in group:
                sample.image_features = tuple(mine)


def _add(sums: MetricSums, name: str, total: float, count: float) -> None:
    s, c = sums.get(name, (0.0, 0.0))
    sums[name] = (s + total, c + count)


def padded_correction(samples: list[Sample], spec: UpdateSpec) -> Correction | None:
    """The rollout correction of `samples`, [len(samples), longest response] on CPU; None when it is off."""
    if not spec.rollout_correction.enabled:
        return None
    width = max([len(s.response_ids) for s in samples] + [1])  # collate's response width
    old = _pad([s.old_logprobs for s in samples], width, torch.device("cpu"))
    vllm = _pad([torch.tensor(s.rollout_logprobs) for s in samples], width, torch.device("cpu"))
    mask = _pad([torch.ones(len(s.response_ids)) for s in samples], width, torch.device("cpu"))
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
) -> torch.Tensor:
    """This micro-batch's share of the global mini-batch loss; adds its metric sums to `sums`.

    `old_from_forward`: the old logprobs (and the rollout correction) come from this forward, detached.
    `padding`: a zero-weight micro-batch that only keeps the ranks' forward/backward counts equal.
    """
    device = next(policy.parameters()).device
    batch = _collate_for(policy, samples, spec)
    logprobs, entropy = policy(batch, temperature=spec.temperature, with_entropy=True)
    width = batch.response_mask.shape[1]
    if old_from_forward or padding:
        old, correction = _old_from_forward(samples, logprobs, spec, store=not padding)
    else:
        old = _pad([s.old_logprobs for s in samples], width, device)
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
        ref = _pad([s.ref_logprobs for s in samples], width, device)
        kl_agg = aggregate(kl_penalty(logprobs, ref, spec.kl_penalty), mask, spec.loss_agg_mode, **agg)
        loss = loss + spec.kl_coef * kl_agg
        _add(sums, "actor/kl_loss", kl_agg.item(), 0.0)
    # pg_loss etc. are shares of the global mini-batch value: summed over micro-batches and ranks they
    # give it; the caller adds a count of 1 per mini-batch (on rank 0) to average over mini-batches.
    _add(sums, "actor/pg_loss", pg_loss.item(), 0.0)
    _add(sums, "actor/entropy", entropy_agg.item(), 0.0)
    for name, (total, count) in pg_metrics.items():
        _add(sums, f"actor/{name}", float(total), float(count))
    return loss * 0.0 if padding else loss


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
    plan = micro_batches(samples, spec, for_update=True, padded=not _packs(policy))
    local = (
        world.world_size == 1 and world.device_type == "cpu" and hasattr(policy, "set_requires_gradient_sync")
    )
    for k, rows in enumerate(plan):
        if local:
            _accumulate_unsharded(policy, first=k == 0, last=k == len(plan) - 1)
        loss = _micro_batch_loss(
            policy,
            [samples[i] for i in rows] or samples[:1],
            spec,
            agg,
            sums if rows else {},
            _index_rows(correction, rows),
            old_from_forward=old_from_forward,
            padding=not rows,
        )
        (loss * world.world_size).backward()
    if local:
        policy.set_reshard_after_forward(True)
    sums["train/num_micro_batches"] = (float(len(plan)), 0.0)
    return sums


def _accumulate_unsharded(policy: nn.Module, *, first: bool, last: bool) -> None:
    """World of one (the shard is the whole model): gather the parameters once per mini-batch and reduce
    the gradient once, after its last micro-batch, instead of per micro-batch.

    With FSDP's defaults every micro-batch re-gathers (copies, and casts to param_dtype) the whole model in
    its forward and again in its backward, and copies its gradient out (cast to reduce_dtype) to add it
    to the sharded one: pure overhead on one rank. Here the gathered copy stays between micro-batches and
    FSDP accumulates the unsharded gradient in reduce_dtype (fp32), which it reduces once: the same sum of
    the same micro-batch gradients. Several ranks keep the per-micro-batch reduction (the unsharded
    gradient of the whole model would not fit next to the shards on large models).

    CPU only: it holds the whole model gathered through the mini-batch's backward and an unsharded fp32
    gradient beside the sharded one, +2 + 4 bytes per parameter at the peak (Qwen2.5-VL-3B: +22 GB). On one
    accelerator memory is what limits, and the per-micro-batch gather it saves is a copy at device memory
    bandwidth (a few ms per micro-batch for 3B); on the CPU, where the smoke test and the benchmarks run, the
    copies and concatenations it removes were about a tenth of the update's profiled op time
    (benchmarks/README.md)."""
    if first:
        policy.set_reshard_after_forward(False)
    policy.set_requires_gradient_sync(last)
    policy.set_reshard_after_backward(last)


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
    num_micro_batches = 0
    old_from_forward = spec.old_logprobs_in_update(len(samples))
    for _ in range(spec.ppo_epochs):
        for start in range(0, len(samples), spec.mini_batch_size):
            mini = samples[start : start + spec.mini_batch_size]
            optim.optimizer.zero_grad(set_to_none=True)
            mini_sums = mini_batch_backward(policy, mini, spec, world, old_from_forward=old_from_forward)
            num_micro_batches += int(mini_sums.pop("train/num_micro_batches")[0])
            for name, (total, count) in mini_sums.items():
                if name in ("actor/pg_loss", "actor/entropy", "actor/kl_loss") and world.rank == 0:
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
