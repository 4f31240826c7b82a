"""Validation: generate on the held-out set with the current policy, score, and report verl-named metrics.

Metrics (global over ranks), N = `worker.rollout.val_override.n` samples per prompt:
  val-core/<data_source>/acc/mean@N     mean `accuracy` of the source's samples, when the reward returns it
  val-core/<data_source>/reward/mean@N  mean `overall` of the source's samples, when it returns no `accuracy`
  val/reward/<key>                      mean of every key the reward returns (overall included), all sources
  timing_s/testing                      added by the caller (it also holds the weight push before generating)
verl's names and values: its core variable is `acc` when the reward returns one and `reward` (the summed
token scores) otherwise, as here; its mean@N is the mean over prompts of each prompt's mean over its N
samples, which equals the mean over samples here because every prompt has exactly N. verl picks the core
variable per data source; here one for the whole set (every source gets the same reward keys). verl also logs
`std@N`, `best@k`, `worst@k` and `maj@k` (bootstrapped) and a `val-aux/` copy of every other reward key per
source; those are not computed (`val/reward/<key>` is this trainer's own name, over all sources: EasyR1
calls it `val/<key>_reward`, and its `val/reward_score` is `val/reward/overall`).
Sampling uses `worker.rollout.val_override` (verl: temperature 0.6, top_p 0.95, n 1 in the geo3k recipes)
with its own per-request seeds (`VAL_SEED_OFFSET`), so validation never consumes or shifts the training
samples' randomness. Each rank validates a strided share of the set (rank r takes examples r, r + world,
...), in generation batches of `batch_size` prompts over all ranks (`data.val_batch_size`; -1: one batch;
a rank takes ceil(batch_size / world) of them, so a batch_size that the world does not divide is rounded up),
every rank running the same number of batches (the ranks of a TP group gather each batch together). The
first `num_logged` generations of the set (example, then sample: the same at any world size) go to
`log_generations(step, rows)` on rank 0 (the loggers' tables: val_generations.jsonl, wandb, ...). The
caller holds the engine in `rollout_mode` around `validate`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from spmd_grpo.algorithm.reward import score_samples
from spmd_grpo.data.dataset import Example
from spmd_grpo.data.samples import Prompt, Sample
from spmd_grpo.parallel.collectives import World, all_gather_objects
from spmd_grpo.rollout.generate import SamplingConfig, generate
from spmd_grpo.telemetry.metrics import global_means

VAL_SEED_OFFSET = 7919  # validation request seeds never coincide with training ones


def validate(
    engine,
    examples: list[Example],
    reward_fn,
    *,
    step: int,
    sampling: SamplingConfig,
    world: World,
    tp_group=None,
    log_generations: Callable[[int, list[dict[str, Any]]], None],
    num_logged: int,
    batch_size: int = -1,
) -> dict[str, float]:
    """Generate and score this rank's share of `examples`; returns the global metrics (collective). Images
    and video frames are decoded one generation batch at a time and dropped after it."""
    mine = list(range(world.rank, len(examples), world.world_size))
    samples = []
    for batch in _batches(mine, len(examples), world.world_size, batch_size):
        prompts = [_prompt(i, examples[i]) for i in batch]
        samples += generate(engine, prompts, sampling, step=step, tp_group=tp_group)
        for p in prompts:  # the samples keep their prompt: not its pixels
            p.images, p.videos = [], []
    rewards = score_samples(
        reward_fn,
        [s.reward_input() for s in samples],
        batch_name=f"validation at step {step}, rank {world.rank}",
    )
    metrics = _metrics(samples, rewards, sampling.n)
    rows = _generations(samples, rewards, num_logged)
    if world.is_main and rows:
        log_generations(step, rows)
    return metrics


def _prompt(index: int, ex: Example) -> Prompt:
    extra = {"data_source": ex.data_source, "problem": ex.problem}
    return Prompt(index, ex.prompt_token_ids, ex.images, ex.answer, extra, ex.videos)


def _batches(indexes: list[int], num_examples: int, world_size: int, batch_size: int) -> list[list[int]]:
    """This rank's example `indexes` in generation batches of `batch_size` prompts over all ranks (<= 0: one batch). The
    number of batches depends only on the set size and the world, so it is the same on every rank."""
    if batch_size <= 0:
        return [indexes]
    per_rank = math.ceil(batch_size / world_size)
    num_batches = max(1, math.ceil(math.ceil(num_examples / world_size) / per_rank))
    return [indexes[i * per_rank : (i + 1) * per_rank] for i in range(num_batches)]


def _metrics(samples: list[Sample], rewards: dict[str, torch.Tensor], n: int) -> dict[str, float]:
    # Every rank must reduce the same metric names (a rank may have no samples): agree on them first.
    parts = all_gather_objects(({s.prompt.extra["data_source"] for s in samples}, set(rewards)))
    sources = sorted(set().union(*(p[0] for p in parts)))
    keys = sorted(set().union(*(p[1] for p in parts)))
    empty = torch.zeros(0)
    # verl's core variable: the accuracy when the reward has one, else the reward itself, each under its name.
    core, core_key = ("acc", "accuracy") if "accuracy" in keys else ("reward", "overall")
    core_values = rewards.get(core_key, empty)
    sums: dict[str, tuple[float, float]] = {}
    for src in sources:
        picked = torch.tensor([s.prompt.extra["data_source"] == src for s in samples], dtype=torch.bool)
        sums[f"val-core/{src}/{core}/mean@{n}"] = (
            float(core_values[picked].sum()) if picked.any() else 0.0,
            float(picked.sum()),
        )
    for key in keys:
        values = rewards.get(key, empty)
        sums[f"val/reward/{key}"] = (float(values.sum()), float(values.numel()))
    return global_means(sums)


def _generations(samples: list[Sample], rewards: dict[str, torch.Tensor], num: int) -> list[dict[str, Any]]:
    """The first `num` generations in the set's order (example, then sample), the same whatever the world size
    and on every rank (collective): each rank sends its own first `num`, and the first `num` of those are
    kept. Taking them in rank order instead logged other examples after a resume at another world size
    (the strided shares: examples 0, 2, 4, 6 at 2 ranks, 0, 1, 2, 3 at 1)."""

    def row(i: int, s: Sample) -> tuple[tuple[int, int], dict[str, Any]]:
        return (s.prompt.uid, s.sample_index), {
            "data_source": s.prompt.extra["data_source"],
            "problem": s.prompt.extra["problem"],
            "response": s.response_text,
            "ground_truth": s.prompt.ground_truth,
            "score": float(rewards["overall"][i]),
        }

    num = max(num, 0)
    mine = sorted((row(i, s) for i, s in enumerate(samples)), key=lambda r: r[0])[:num]
    merged = sorted((r for part in all_gather_objects(mine) for r in part), key=lambda r: r[0])
    return [fields for _, fields in merged[:num]]
