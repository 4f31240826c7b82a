"""Step metrics: timers, global reductions across ranks, and the run directory's `metrics.jsonl`.

Names follow verl (`timing_s/gen`, `actor/pg_loss`, `critic/score/mean`, `response_length/mean`,
`perf/throughput`, ...). Every figure is a reduction over ALL ranks (sum/count for means, max, min), so
rank 0 prints and writes global values, not its own shard's; the console line and every logger get the
same dict.

Samples (`sample_metrics`): the step's trained samples, i.e. after DAPO's filtering and rebalancing, as
verl's `compute_data_metrics` (the score of everything generated is `train/gen_score/*`, dynamic_sampling.py):
    critic/score/*            per sample: the reward's `overall`, DAPO's overlong penalty included (as verl's
                              DAPO reward manager adds it to the token scores)
    critic/rewards/*          the same values: verl subtracts its KL-in-reward penalty here, not provided
    critic/advantages/*       per response token (a sample counts once per token), as verl's masked_select;
                              tokens dropped by the rollout correction's rejection still count (verl's
                              rejection mask removes them)
    response_length/*, prompt_length/*  per sample; prompt = vLLM's expanded ids (image pads included)
    response_length/clip_ratio  fraction of responses of max_response_length tokens; p50/p90: ours
    reward/<key>              per-sample mean of each reward key but `overall` (EasyR1 also logs
                              `reward/overall`: here `critic/score/mean`, equal when the overlong penalty is off)
    rollout/logprob_diff_*    |trainer old logprob - vLLM logprob| per response token: token-mean and max
                              (ours; verl's `training/rollout_probs_diff_*` compare probabilities instead).
                              With top_p < 1 or top_k > 0 it also holds the log of the probability mass
                              vLLM's sampler kept (its logprobs are renormalised after truncation)
    perf/total_num_tokens     prompt + response tokens of the trained samples (verl's `global_token_num`)
Not logged although verl's `compute_data_metrics` and `compute_timing_metrics` have them:
`critic/returns/*` (for GRPO the same values as `critic/advantages/*`), `prompt_length/clip_ratio` (no
prompt is truncated: a longer one is dropped at load) and
`timing_per_token_ms/*` (derive them from `timing_s/*` and the lengths).
Timings (`Timer`): wall seconds per phase with the device synchronised at both edges, summed over the
calls of the step (DAPO's generation batches), then the max over ranks (the slowest rank sets the pace,
as verl's driver sees it):
    timing_s/step             rollout (every generation batch) through the optimizer steps, as verl's: the
                              validation (`timing_s/testing`), the checkpoint (`timing_s/save_checkpoint`)
                              and the metric reductions and logging come after it and are not inside it
    timing_s/gen              wake, weight push, generation and sleep of each generation batch
    timing_s/update_weights   the weight push alone: INSIDE `timing_s/gen` (or `timing_s/testing`), never
                              beside it. The update of step k is pushed at the next rollout_mode: step k+1's
                              generation, or step k's validation (then a step's value holds two pushes).
                              verl pushes right after `update_actor`, beside it, and its `timing_s/gen`
                              holds no push: compare our gen minus update_weights with verl's gen
    timing_s/reward, rebalance (DAPO), pixel_values, adv, old_log_prob (with image features), ref,
    update_actor              the other phases, in step order
Each phase is a max over ranks, so the phases need not add up to `timing_s/step` (nor do they hold the
untimed glue between them).
Throughput and memory (`perf_metrics`, training steps only):
    perf/time_per_step        timing_s/step
    perf/throughput           total_num_tokens / (timing_s/step x world size): verl's tokens per second per
                              device. The tokens are the batch's, not the ones computed: every sample's
                              prompt counts, also where `worker.actor.shared_prompt` computes a group's
                              prompt once (`perf/shared_prompt_tokens_saved`), and samples DAPO generated
                              and dropped do not count although their generation is in the step time (both
                              as verl)
    perf/max_memory_allocated_gb  the device allocator's peak since the process started (never reset),
                              max over ranks, both as verl (EasyR1 subtracts what vLLM's sleep freed); on
                              CPU the process's peak resident set
    perf/cpu_memory_used_gb   resident set of the process at the end of the step, max over ranks. verl
                              and EasyR1 log the NODE's used memory (psutil.virtual_memory().used) under
                              this name: ours is one rank's process, so it stays comparable across node
                              sizes and shows a leak of one rank
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from spmd_grpo.parallel.collectives import all_gather_objects, all_reduce_max, all_reduce_min, all_reduce_sum
from spmd_grpo.parallel.devices import cpu_memory_used_gb, max_memory_allocated_gb, synchronize
from spmd_grpo.parallel.signals import note_phase

if TYPE_CHECKING:
    from spmd_grpo.data.samples import Sample


class Timer:
    """Accumulates wall time per phase name (`timing_s/<name>`), synchronising the device at the edges."""

    def __init__(self, device_type: str, step: int = 0) -> None:
        self.device_type, self.step = device_type, step
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        note_phase(f"step {self.step}: {name}")  # what a failed collective's log names per rank
        synchronize(self.device_type)
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device_type)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """Max over ranks: a phase takes as long as its slowest rank."""
        names = sorted(self.seconds)
        values = all_reduce_max(torch.tensor([self.seconds[n] for n in names], dtype=torch.float64))
        return {f"timing_s/{n}": float(v) for n, v in zip(names, values, strict=True)}


def global_stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """`{prefix}/mean|max|min` of a 1-D tensor whose entries are spread over all ranks; all three 0 when no
    rank holds an entry (a JSON line holds no infinity)."""
    values = values.detach().double().flatten()
    total = all_reduce_sum(torch.tensor([values.sum().item(), float(values.numel())], dtype=torch.float64))
    inf = float("inf")
    vmax = all_reduce_max(
        torch.tensor([values.max().item() if values.numel() else -inf], dtype=torch.float64)
    )
    vmin = all_reduce_min(torch.tensor([values.min().item() if values.numel() else inf], dtype=torch.float64))
    return {
        f"{prefix}/mean": float(total[0] / total[1]) if total[1] > 0 else 0.0,
        f"{prefix}/max": float(vmax) if total[1] > 0 else 0.0,
        f"{prefix}/min": float(vmin) if total[1] > 0 else 0.0,
    }


def global_means(sums: dict[str, tuple[float, float]]) -> dict[str, float]:
    """{name: (local sum, local count)} -> {name: global sum / global count} in one all-reduce."""
    names = sorted(sums)
    if not names:
        return {}
    packed = all_reduce_sum(torch.tensor([[sums[n][0], sums[n][1]] for n in names], dtype=torch.float64))
    return {n: float(s / c) if c > 0 else 0.0 for n, (s, c) in zip(names, packed.tolist(), strict=True)}


def json_line(row: dict[str, object]) -> str:
    """`row` as one line of strict JSON: a non-finite float (the NaN grad norm of a skipped optimizer step)
    is written as `null`, as Python's `NaN`/`Infinity` are not JSON and strict readers (jq, JavaScript,
    Go, serde) reject the whole line."""
    finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
    return json.dumps(finite, allow_nan=False)


class MetricsWriter:
    """Rank 0 appends one JSON line per step to `<run_dir>/metrics.jsonl` (flushed: a crash loses nothing);
    a non-finite value is `null` (`json_line`)."""

    def __init__(self, run_dir: Path, enabled: bool) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json_line({"step": step, **metrics}) + "\n")
            f.flush()


def console_line(step: int, total: int, m: dict[str, float]) -> str:
    """The console's line for `step`: a few of `m`'s values, named after their metrics. With DAPO dynamic
    sampling `score` is the trained (filtered) groups' and `gen_score` everything generated. The KL is
    printed in exponent notation: it starts near 0 (the policy is the reference) and a fixed-point figure
    would print a real 3e-6 as 0."""
    parts = [f"step {step}/{total}"]
    for key, label, fmt in [
        ("critic/score/mean", "score", ".3f"),
        ("train/gen_score/mean", "gen_score", ".3f"),
        ("reward/accuracy", "acc", ".3f"),
        ("actor/pg_loss", "pg_loss", "+.4f"),
        ("actor/kl_loss", "kl", ".2e"),
        ("actor/entropy", "ent", ".3f"),
        ("actor/grad_norm", "gnorm", ".3f"),
        ("response_length/mean", "resp_len", ".1f"),
        ("rollout/logprob_diff_max", "lp_diff_max", ".1e"),
        ("timing_s/step", "s/step", ".2f"),
    ]:
        if key in m:
            parts.append(f"{label} {m[key]:{fmt}}")
    parts += [
        f"{k.removeprefix('val-core/')} {v:.3f}" for k, v in sorted(m.items()) if k.startswith("val-core/")
    ]
    return " | ".join(parts)


def sample_metrics(samples: list[Sample], max_response_length: int) -> dict[str, float]:
    """verl's per-step sample statistics, global over ranks: scores, advantages, reward terms, lengths,
    and the trainer-vs-vLLM logprob gap (`rollout/logprob_diff_*`, needs `old_logprobs`)."""
    scores = torch.tensor([s.scores["overall"] for s in samples])
    m = global_stats("critic/score", scores)
    m.update(global_stats("critic/rewards", scores))
    # verl's advantage statistics are over response tokens (a sample counts once per token); its scores
    # and rewards are per sample.
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.long)
    token_advantages = torch.tensor([s.advantage for s in samples]).repeat_interleave(lengths)
    m.update(global_stats("critic/advantages", token_advantages))
    keys = [k for k in samples[0].scores if k != "overall"] if samples else []
    terms = {k: torch.tensor([s.scores[k] for s in samples]) for k in keys}  # float32, as the reward returns
    m.update(global_means({f"reward/{k}": (float(v.sum()), v.numel()) for k, v in terms.items()}))
    response_lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
    prompt_lengths = torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.float64)
    m.update(global_stats("response_length", response_lengths))
    m.update(length_quantiles(response_lengths))
    m.update(global_stats("prompt_length", prompt_lengths))
    clipped = sum(len(s.response_ids) >= max_response_length for s in samples)
    diffs = [
        abs(a - b) for s in samples for a, b in zip(s.rollout_logprobs, s.old_logprobs.tolist(), strict=True)
    ]
    m.update(
        global_means(
            {
                "response_length/clip_ratio": (clipped, len(samples)),
                "rollout/logprob_diff_mean": (sum(diffs), len(diffs)),
            }
        )
    )
    m["rollout/logprob_diff_max"] = float(all_reduce_max(torch.tensor([max(diffs, default=0.0)])))
    local_tokens = float(response_lengths.sum() + prompt_lengths.sum())
    m["perf/total_num_tokens"] = float(all_reduce_sum(torch.tensor([local_tokens], dtype=torch.float64)))
    return m


def length_quantiles(lengths: torch.Tensor) -> dict[str, float]:
    """`response_length/p50|p90` over every rank's samples (all-gathered: one number per sample), to show
    how long-tailed the lengths are; 0 when no rank has a sample."""
    everything = [x for part in all_gather_objects(lengths.tolist()) for x in part]
    if not everything:
        return {"response_length/p50": 0.0, "response_length/p90": 0.0}
    q = torch.quantile(
        torch.tensor(everything, dtype=torch.float64), torch.tensor([0.5, 0.9], dtype=torch.float64)
    )
    return {"response_length/p50": float(q[0]), "response_length/p90": float(q[1])}


def perf_metrics(m: dict[str, float], device_type: str, world_size: int) -> dict[str, float]:
    """`perf/*` from the step's timings and token count (throughput = tokens / (step time x devices)) and
    the peak memory over ranks."""
    return {
        "perf/time_per_step": m["timing_s/step"],
        "perf/throughput": m["perf/total_num_tokens"] / (m["timing_s/step"] * world_size),
        "perf/max_memory_allocated_gb": float(
            all_reduce_max(torch.tensor([max_memory_allocated_gb(device_type)]))
        ),
        "perf/cpu_memory_used_gb": float(all_reduce_max(torch.tensor([cpu_memory_used_gb()]))),
    }
