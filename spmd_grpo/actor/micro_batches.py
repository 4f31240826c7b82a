"""Micro-batches for the forward and backward passes: by count, or by a token budget, padded or packed.

With a token budget (`dynamic_batching`), padded micro-batches are runs of the length-sorted samples whose
count x longest fits the budget; packed ones balance token sums (Karmarkar-Karp). Every rank must make
the same number of FSDP forward/backward calls, so the micro-batch count is all-reduced with MAX and a rank
with fewer pads with empty micro-batches (zero weight). The loss is normalised on global counts (update.py),
so the split changes no gradient.

Shared prompts (`PolicyModule.shared_prompt`, `worker.actor.shared_prompt`): a micro-batch holds each of its
groups' prompt once (`inputs.collate`), so its samples are ordered group by group. Fixed counts keep the
samples' order and count (a group may span micro-batches: each part then carries the prompt once, the
result is the same). A token budget counts a group's prompt once: its unit is a group, cost P + sum of its
responses; a group over the budget is cut into runs of consecutive responses that each fit with the
prompt (a prompt + one response over the budget runs alone, as an unshared sequence over the budget
does); the units are balanced as samples are without sharing. No split changes a logprob or a gradient.
"""

from __future__ import annotations

import heapq
import itertools
import math

import torch
from torch import nn

from spmd_grpo.actor.routes import attach_routes
from spmd_grpo.actor.spec import UpdateSpec
from spmd_grpo.data.samples import Sample
from spmd_grpo.models.inputs import SequenceBatch, collate
from spmd_grpo.parallel.collectives import all_reduce_max


def collate_samples(
    samples: list[Sample],
    pad_id: int,
    device: torch.device | str = "cpu",
    *,
    packed: bool = False,
    tower_in_forward: bool = True,
    video_in_forward: bool = False,
    shared_prompt: bool = False,
    by_routes: bool = False,
) -> SequenceBatch:
    """Prompt+response batch of rollout samples on `device`, right-padded or packed (padding-free), with
    their images: the precomputed features where `encode_images` attached them, else the pixels. With
    `shared_prompt` (packed only), consecutive samples of one prompt (`prompt_groups`, `by_routes`) hold
    it once."""
    groups = None
    if shared_prompt:
        groups = [0] * len(samples)
        for g, rows in enumerate(prompt_groups(samples, by_routes=by_routes)):
            for i in rows:
                groups[i] = g
    return collate(
        [s.prompt_ids for s in samples],
        [s.response_ids for s in samples],
        [s.pixel_values for s in samples],
        [s.image_grid_thw for s in samples],
        pad_id,
        packed=packed,
        image_features=[s.image_features for s in samples],
        tower_in_forward=tower_in_forward,
        video_inputs=[s.video_inputs for s in samples],
        video_in_forward=video_in_forward,
        prompt_groups=groups,
    ).to(device)


def prompt_key(sample: Sample) -> tuple:
    """Samples with equal keys have the same prompt ids, images and videos: those of one `Prompt` record
    (a prompt's samples share it, and its pixel values, `rollout.generate.attach_pixel_values`)."""
    return id(sample.prompt), tuple(sample.prompt_ids)


def prompt_groups(samples: list[Sample], *, by_routes: bool = False) -> list[list[int]]:
    """Indices of `samples` by prompt (`prompt_key`), groups in the order of their first sample. `by_routes`
    (MoE routes replayed): a prompt's samples whose routes over the prompt differ are further apart, one
    group per distinct prompt routing (actor/routes.py: a shared copy is routed one way)."""
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(samples):
        key = prompt_key(s)
        if by_routes:
            key = (*key, _prompt_routing(samples, groups, key, s))
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _prompt_routing(samples: list[Sample], groups: dict, key: tuple, sample: Sample) -> int:
    """Which routing of `key`'s prompt `sample` has: the index of the first group of that prompt whose
    first sample routes the prompt the same way (no routes: equal to no routes only), or a new index."""
    p = len(sample.prompt_ids)
    mine = None if sample.routes is None else sample.routes[:p]
    seen = [k for k in groups if k[:-1] == key]
    for k in seen:
        other = samples[groups[k][0]].routes
        theirs = None if other is None else other[:p]
        if (mine is None and theirs is None) or (
            mine is not None and theirs is not None and torch.equal(mine, theirs)
        ):
            return k[-1]
    return len(seen)


def uses_shared_prompt(model: nn.Module) -> bool:
    """Whether `model`'s passes hold each group's prompt once (`worker.actor.shared_prompt`, resolved at
    build; packed batches only)."""
    return bool(getattr(model, "shared_prompt", False)) and uses_packing(model)


def uses_packing(model: nn.Module) -> bool:
    """Whether `model` takes packed (padding-free) micro-batches (its attention has a varlen path)."""
    return bool(getattr(model, "padding_free", False))


def collate_for(
    model: nn.Module,
    samples: list[Sample],
    spec: UpdateSpec,
    *,
    for_update: bool,
    route_pass: str = "update",
    padding: bool = False,
) -> SequenceBatch:
    """`samples` in the layout `model` was built for (packed when its attention has a varlen path), marked
    with whether the pass's forwards run the vision tower (`UpdateSpec.tower_in_forward`) and on video
    input (`UpdateSpec.videos`: in a run that allows videos, every forward does); each prompt held once
    where the model was built for shared prompts (`uses_shared_prompt`); for an MoE model, with the routes
    `route_pass` (old, ref, update) compares with or replays (actor/routes.py). `padding`: a zero-weight
    micro-batch (`micro_batches`' empty parts), whose routing the MoE counts leave out."""
    device = model.compute_device
    flags = {
        "tower_in_forward": spec.tower_in_forward(for_update=for_update),
        "video_in_forward": spec.videos,
        "shared_prompt": uses_shared_prompt(model),
        "by_routes": replays_routes(spec),
    }
    batch = collate_samples(samples, spec.pad_token_id, device, packed=uses_packing(model), **flags)
    batch.route_counted = not padding
    moe = getattr(model, "moe", None)
    if moe is not None:
        attach_routes(batch, samples, moe, mode=spec.routing_replay, route_pass=route_pass)
    return batch


def replays_routes(spec: UpdateSpec) -> bool:
    """Whether some pass replays the samples' MoE routes (`worker.actor.moe.routing_replay` old or rollout):
    then a prompt's samples share one copy only where their prompt routes agree (`prompt_groups`)."""
    return spec.routing_replay != "none"


def shared_prompt_units(
    samples: list[Sample], budget: int, *, by_routes: bool = False
) -> tuple[list[list[int]], list[int]]:
    """(units, their token costs) for a token budget with shared prompts: each group's samples, cut into runs
    whose prompt + responses fit `budget` (see the module docstring), the prompt counted once per run."""
    units, costs = [], []
    for group in prompt_groups(samples, by_routes=by_routes):
        prompt = len(samples[group[0]].prompt_ids)
        unit, cost = [], prompt
        for i in group:
            r = len(samples[i].response_ids)
            if unit and cost + r > budget:
                units.append(unit)
                costs.append(cost)
                unit, cost = [], prompt
            unit.append(i)
            cost += r
        units.append(unit)
        costs.append(cost)
    return units, costs


def pad_rows(rows: list[torch.Tensor], width: int, device: torch.device) -> torch.Tensor:
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
    samples: list[Sample], spec: UpdateSpec, *, for_update: bool, padded: bool = False, shared: bool = False
) -> list[list[int]]:
    """Index lists of `samples`, one per forward; the same count on every rank (collective with dynamic
    batching). An empty list is a padding micro-batch (zero weight). With dynamic batching the parts
    balance token sums (packed layout: cost ~ tokens; ceil(tokens / budget) parts) or, `padded`, are runs
    of similar lengths, as few as keep every part's count x longest within the budget. `shared`: shared
    prompts (the module docstring): each part lists its samples group by group."""
    if not spec.dynamic_batching:
        size = spec.micro_batch_size if for_update else spec.experience_micro_batch_size
        parts = [list(range(i, min(i + size, len(samples)))) for i in range(0, len(samples), size)]
        return [_by_group(samples, p, spec) for p in parts] if shared else parts
    budget = spec.max_token_len_for_update if for_update else spec.max_token_len_for_experience
    if shared:
        units, lengths = shared_prompt_units(samples, budget, by_routes=replays_routes(spec))
    else:
        units, lengths = (
            [[i] for i in range(len(samples))],
            [len(s.prompt_ids) + len(s.response_ids) for s in samples],
        )
    if padded:
        local = padded_part_count(lengths, budget)
    else:
        local = min(len(units), math.ceil(sum(lengths) / budget))
    k = int(all_reduce_max(torch.tensor([local], dtype=torch.long)).item())
    partition = length_sorted_partitions if padded else balanced_partitions
    parts = [p for p in partition(lengths, min(k, len(units))) if p] if units else []
    parts = [[i for u in p for i in units[u]] for p in parts]
    parts = [_by_group(samples, p, spec) for p in parts] if shared else parts
    return parts + [[] for _ in range(k - len(parts))]


def _by_group(samples: list[Sample], rows: list[int], spec: UpdateSpec) -> list[int]:
    """`rows` reordered so that each prompt's samples are consecutive (groups in order of first appearance)."""
    groups = prompt_groups([samples[r] for r in rows], by_routes=replays_routes(spec))
    return [rows[i] for g in groups for i in g]
