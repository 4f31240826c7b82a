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
  * samples move only to the rank that needs them, as raw bytes (`exchange_samples`).
Deviation from verl: verl keeps whole groups on the driver and then splits the batch; here the split is
done by the same global order without a driver.

How samples move. Each destination gets one segment of one uint8 `all_to_all_single`: a small pickled
header (structure, offsets, strings, per-sample scalars and scores) and then every numeric field as raw
bytes: token ids (int64), vLLM's logprobs (float64, exactly the Python floats), each prompt's images (PIL
pixel bytes; mode, size, palette and info in the header) and any tensor (pixel values, grids, features,
logprobs), each prompt and each shared tensor once per destination, viewed in place on arrival (16-byte
aligned). The result equals what pickling the samples gave, field by field and bit by bit, with the same
sharing (a prompt's samples on a rank share one Prompt and one pixel tensor). The trainer attaches pixel
values only after rebalancing, so only the images travel (float32 pixel values are 8x the image's bytes:
2 frames x 4 bytes per channel value) and groups that are dropped never reach the image processor.

Arithmetic for 64 ranks, 512 prompts x 8 samples per generation batch, 512 groups kept (4,096 samples, 64
per rank from 8-9 prompts), geometry3k's ~500 x 500 image made 532 x 532 by min_pixels 512 x 512 (1,444
patches, 361 image tokens, prompt ~460 tokens), responses of 1,024 tokens on average (2,048 at most):
  * before (pickled `Sample`s, pixel values attached before filtering): per prompt 6.79 MB of float32 pixel
    values (1,444 x 1,176 x 4 B) + 0.85 MB of image, per sample ~21 KB of pickled ids, floats and text:
    ~70 MB per rank through pickle.dumps and pickle.loads (its own share too), 4 collectives (an
    all_gather_object of every rank's group sizes: 2, then 2 all_to_all). Every generated prompt of a rank
    went through the image processor (8 per generation batch, kept or not: 16+ when half the groups are kept).
  * now: per prompt 0.85 MB of image bytes, per sample ~24 KB ((460 + 1,024) int64 ids, 1,024 float64
    logprobs, ~4 KB of header and text): ~9 MB per rank, nothing large pickled, 3 collectives (one
    all_reduce of the [generation batches, 512] group-size table, 2 all_to_all_single); the image processor
    runs on the 8-9 prompts a rank trains on. Measured on 4 and 8 CPU ranks: benchmarks/dapo_rebalance.py.
The collectives run on the world's device (nccl and hccl take no cpu tensors).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from spmd_grpo.algorithm.advantage import group_has_spread
from spmd_grpo.config.schema import FilterGroupsConfig
from spmd_grpo.data.samples import Sample
from spmd_grpo.parallel.collectives import World, all_reduce_sum
from spmd_grpo.rollout.sample_exchange import exchange_samples
from spmd_grpo.telemetry.metrics import Timer, global_stats


def collect_groups(
    generate_batch: Callable[[int], list[Sample]],
    cfg: FilterGroupsConfig,
    rollout_batch_size: int,
    target: int,
    world: World,
    timer: Timer,
) -> tuple[list[Sample], dict[str, float]]:
    """Call `generate_batch(gen_batch)` (one scored generation batch of `rollout_batch_size` prompts) until
    `target` groups with spread are kept (`Config.num_train_groups`); returns the selected, rebalanced
    samples and metrics.

    Metrics: `train/gen_score/*` (the score of everything generated: the kept batch has spread by
    construction), `train/num_gen_batches`, `train/kept_group_frac`; `timer` times the rebalancing
    (`timing_s/rebalance`).
    """
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
    with timer("rebalance"):
        samples = select_and_rebalance(samples, target, world, num_gen_batches, rollout_batch_size)
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


def select_and_rebalance(
    samples: list[Sample], target: int, world: World, num_gen_batches: int, num_prompts: int
) -> list[Sample]:
    """Keep the first `target` groups in global order (generation batch, prompt uid); give every rank the
    same number of samples, in that order. `num_prompts` is the uid range of a generation batch.

    The group sizes come from one all_reduce of a [num_gen_batches, num_prompts] table (every group is whole
    on one rank here); the samples move with `exchange_samples`.
    """
    sizes = torch.zeros(num_gen_batches, num_prompts, dtype=torch.long)
    for s in samples:
        sizes[s.gen_batch, s.prompt.uid] += 1
    sizes = all_reduce_sum(sizes.to(world.device)).cpu().flatten()
    selected = sizes.nonzero().flatten()[:target]  # flat keys gen_batch * num_prompts + uid, in global order
    counts = sizes[selected]
    total = int(counts.sum())
    if total % world.world_size:
        raise ValueError(f"{total} selected samples cannot be split evenly over {world.world_size} ranks")
    per_rank = total // world.world_size
    starts = (torch.cumsum(counts, 0) - counts).tolist()
    order = {key: index for index, key in enumerate(selected.tolist())}
    per_destination: list[list[tuple[int, Sample]]] = [[] for _ in range(world.world_size)]
    for s in sorted(samples, key=lambda s: (s.gen_batch, s.prompt.uid, s.sample_index)):
        index = order.get(s.gen_batch * num_prompts + s.prompt.uid)
        if index is None:
            continue  # surplus group: dropped
        s.group_index = index
        pos = starts[index] + s.sample_index
        per_destination[pos // per_rank].append((pos, s))
    received = exchange_samples(per_destination, world)
    return [s for _, s in sorted(received, key=lambda item: item[0])]
