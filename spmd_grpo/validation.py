"""Validation: generate on the held-out set with the current policy, score, and report verl-named metrics.

Metrics (global over ranks), N = `worker.rollout.val_override.n` samples per prompt:
  val-core/<data_source>/acc/mean@N   mean `accuracy` of the reward (or `overall` when the reward has none)
  val/reward/<key>                    mean of every key the reward function returns (overall included)
  timing_s/testing                    added by the caller
Sampling uses `worker.rollout.val_override` (verl: temperature 0.6, top_p 0.95, n 1 in the geo3k recipes)
with its own per-request seeds (`VAL_SEED_OFFSET`), so validation never consumes or shifts the training
samples' randomness. Each rank validates a strided share of the set (rank r takes examples r, r + world,
...). A few generations are appended to `<run_dir>/val_generations.jsonl` by rank 0. The caller holds the
engine in `rollout_mode` around `validate`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .data import Example
from .distributed import World, all_gather_objects
from .metrics import global_means
from .reward import score_samples
from .rollout import Prompt, Sample, SamplingConfig, generate

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
    run_dir: Path,
    num_logged: int,
) -> dict[str, float]:
    """Generate and score this rank's share of `examples`; returns the global metrics (collective)."""
    prompts = [
        Prompt(
            i,
            ex.prompt_token_ids,
            ex.images,
            ex.answer,
            {"data_source": ex.data_source, "problem": ex.problem},
        )
        for i in range(world.rank, len(examples), world.world_size)
        for ex in [examples[i]]
    ]
    samples = generate(engine, prompts, sampling, step=step, tp_group=tp_group)
    rewards = score_samples(
        reward_fn,
        [s.reward_input() for s in samples],
        batch_name=f"validation at step {step}, rank {world.rank}",
    )
    metrics = _metrics(samples, rewards, sampling.n)
    _log_generations(
        samples, rewards, step=step, world=world, path=run_dir / "val_generations.jsonl", num=num_logged
    )
    return metrics


def _metrics(samples: list[Sample], rewards: dict[str, torch.Tensor], n: int) -> dict[str, float]:
    # Every rank must reduce the same metric names (a rank may have no samples): agree on them first.
    parts = all_gather_objects(({s.prompt.extra["data_source"] for s in samples}, set(rewards)))
    sources = sorted(set().union(*(p[0] for p in parts)))
    keys = sorted(set().union(*(p[1] for p in parts)))
    empty = torch.zeros(0)
    acc = (
        rewards.get("accuracy", rewards.get("overall", empty))
        if "accuracy" in keys
        else rewards.get("overall", empty)
    )
    sums: dict[str, tuple[float, float]] = {}
    for src in sources:
        picked = torch.tensor([s.prompt.extra["data_source"] == src for s in samples], dtype=torch.bool)
        sums[f"val-core/{src}/acc/mean@{n}"] = (
            float(acc[picked].sum()) if picked.any() else 0.0,
            float(picked.sum()),
        )
    for key in keys:
        values = rewards.get(key, empty)
        sums[f"val/reward/{key}"] = (float(values.sum()), float(values.numel()))
    return global_means(sums)


def _log_generations(
    samples: list[Sample], rewards: dict[str, torch.Tensor], *, step: int, world: World, path: Path, num: int
) -> None:
    """Rank 0 appends the first `num` generations (over ranks, in rank order) to `path`; collective."""
    logged = all_gather_objects(
        [
            {
                "step": step,
                "data_source": s.prompt.extra["data_source"],
                "problem": s.prompt.extra["problem"],
                "response": s.response_text,
                "ground_truth": s.prompt.ground_truth,
                "score": float(rewards["overall"][i]),
            }
            for i, s in enumerate(samples[:num])
        ]
    )
    if world.is_main and num > 0:
        rows = [row for part in logged for row in part][:num]
        with path.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
