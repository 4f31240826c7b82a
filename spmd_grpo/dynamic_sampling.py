"""DAPO dynamic sampling (Yu et al. 2025, "DAPO", sec. 3.2 "Dynamic Sampling") as SPMD.

A prompt group whose metric (e.g. accuracy) is the same for all its samples has zero advantage and only
dilutes the batch. DAPO drops such groups and keeps generating until `target` groups with spread are
collected. Under SPMD every rank must take the same branch and run the same number of forward/backward
passes, so:
  * the spread of a group and the global count of kept groups come from collectives;
  * once enough groups are kept, the first `target` groups in a global order (generation batch, prompt uid)
    are selected (the surplus is dropped, as in DAPO/verl) and their samples are laid out in that order and
    cut into equal contiguous shares, one per rank. A group may then straddle two ranks: the advantage uses
    collectives on `group_index` (0..target-1), so its statistics stay exact.
  * samples move only to the rank that needs them (`distributed.exchange_objects`).
Deviation from verl: verl keeps whole groups on the driver and then splits the batch; here the split is
done by the same global order without a driver.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .advantage import group_has_spread
from .config import FilterGroupsConfig
from .distributed import World, all_gather_objects, all_reduce_sum, exchange_objects
from .metrics import global_stats
from .rollout import Sample


def collect_groups(
    generate_batch: Callable[[int], list[Sample]],
    cfg: FilterGroupsConfig,
    rollout_batch_size: int,
    world: World,
) -> tuple[list[Sample], dict[str, float]]:
    """Call `generate_batch(gen_batch)` (one scored generation batch of `rollout_batch_size` prompts) until
    `cfg.train_batch_size` groups with spread are kept; returns the selected, rebalanced samples and metrics.

    Metrics: `train/gen_score/*` (the score of everything generated: the kept batch has spread by
    construction), `train/num_gen_batches`, `train/kept_group_frac`.
    """
    target = cfg.num_train_groups(rollout_batch_size)
    samples: list[Sample] = []
    generated_scores: list[float] = []
    num_gen_batches = 0
    while True:
        batch = generate_batch(num_gen_batches)
        generated_scores += [s.scores["overall"] for s in batch]
        num_gen_batches += 1
        samples += kept_groups(batch, cfg.metric, rollout_batch_size)
        num_kept = count_groups(samples)
        if num_kept >= target:  # every rank sees the same global count: same branch
            break
        if 0 < cfg.max_num_gen_batches <= num_gen_batches:
            raise RuntimeError(
                f"DAPO dynamic sampling: only {num_kept} of {target} groups had non-zero spread of "
                f"'{cfg.metric}' after {num_gen_batches} generation batches "
                f"(algorithm.filter_groups.max_num_gen_batches={cfg.max_num_gen_batches}); raise the limit, "
                "set it <= 0 for no limit, or check the reward"
            )
    samples = select_and_rebalance(samples, target, world)
    metrics = global_stats("train/gen_score", torch.tensor(generated_scores))
    metrics["train/num_gen_batches"] = float(num_gen_batches)
    metrics["train/kept_group_frac"] = num_kept / max(1, num_gen_batches * rollout_batch_size)
    return samples, metrics


def kept_groups(samples: list[Sample], metric: str, num_groups: int) -> list[Sample]:
    """This rank's samples whose group (prompt uid of this generation batch) has non-zero metric spread."""
    if samples and metric not in samples[0].scores:
        raise ValueError(
            f"algorithm.filter_groups.metric={metric!r} is not a key of the reward; keys: {sorted(samples[0].scores)}"
        )
    values = torch.tensor([s.scores.get(metric, 0.0) for s in samples], dtype=torch.float64)
    group_index = torch.tensor([s.prompt.uid for s in samples], dtype=torch.long)
    keep = group_has_spread(values, group_index, num_groups, all_reduce_sum)
    return [s for s in samples if bool(keep[s.prompt.uid])]


def count_groups(samples: list[Sample]) -> int:
    """Number of distinct groups over all ranks (groups are whole on their rank before rebalancing)."""
    local = len({(s.gen_batch, s.prompt.uid) for s in samples})
    return int(all_reduce_sum(torch.tensor([local], dtype=torch.long)).item())


def select_and_rebalance(samples: list[Sample], target: int, world: World) -> list[Sample]:
    """Keep the first `target` groups in global order; give every rank the same number of samples."""
    sizes: dict[tuple[int, int], int] = {}
    for s in samples:
        key = (s.gen_batch, s.prompt.uid)
        sizes[key] = sizes.get(key, 0) + 1
    everyone = sorted(kv for part in all_gather_objects(sorted(sizes.items())) for kv in part)
    selected = everyone[:target]
    total = sum(size for _, size in selected)
    if total % world.world_size:
        raise ValueError(f"{total} selected samples cannot be split evenly over {world.world_size} ranks")
    per_rank = total // world.world_size
    offset, order = {}, {}
    position = 0
    for index, (key, size) in enumerate(selected):
        offset[key], order[key] = position, index
        position += size
    per_destination: list[list[tuple[int, Sample]]] = [[] for _ in range(world.world_size)]
    for s in sorted(samples, key=lambda s: (s.gen_batch, s.prompt.uid, s.sample_index)):
        key = (s.gen_batch, s.prompt.uid)
        if key not in offset:
            continue  # surplus group: dropped
        s.group_index = order[key]
        pos = offset[key] + s.sample_index
        per_destination[pos // per_rank].append((pos, s))
    received = [item for part in exchange_objects(per_destination) for item in part]
    return [s for _, s in sorted(received, key=lambda item: item[0])]
