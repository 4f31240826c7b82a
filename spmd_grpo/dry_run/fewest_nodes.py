"""The fewest nodes that hold a job: the `--dry-run` memory plan searched over node counts, expert-parallel
sizes and rollout TP sizes.

    python -m spmd_grpo.dry_run.fewest_nodes cfg.yaml [key=value ...] [--nproc-per-node 8]
        [--device-memory-gb 80] [--max-nodes 32]

For each node count from 1, every candidate is planned (`memory.py`, whose docstring states what the figures
assume): `worker.actor.fsdp.expert_parallel_size` in the divisors of the model's experts that divide the world
(1 for a dense model), and `worker.rollout.tensor_parallel_size` from the config's up by powers of 2 while it
divides the world, the language model's attention heads and the vision tower's (vLLM splits both by TP).
A candidate fits when every phase does: the load (shards + vLLM's reservation within the device), training
(within 90 % of it), the rollout (the trainer's resident state + the reservation), and vLLM (its weights leave
room for one max-length sequence of KV cache). Everything else is the config's: gpu_memory_utilization,
offloads, token budgets, LoRA. The step's batch is scaled to the world so that every rank has work and the
config's number of optimizer steps per step is kept: p prompts per rank, the least p >= rollout_batch_size /
world for which the mini-batch per rank (p x n / that number) is a whole multiple of the update micro-batch.

Printed: each node count's best candidate (the least worst phase, as a fraction of what the phase may use)
with what does not fit, then for the fewest nodes that fit: the candidates that fit, the arithmetic
(parameters, bytes per parameter, per-rank totals) and the full plan with its command.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from spmd_grpo.config.checks import ConfigError
from spmd_grpo.config.loader import last_wins, load_config
from spmd_grpo.config.schema import Config
from spmd_grpo.config.validate import validate
from spmd_grpo.dry_run.counts import (
    BYTES,
    GiB,
    ModelCounts,
    batches,
    count_parameters,
    model_config,
    param_dtype,
)
from spmd_grpo.dry_run.memory import TRAIN_HEADROOM, MemoryPlan, memory_plan
from spmd_grpo.dry_run.plan import check_expert_parallel, dry_run


@dataclass(frozen=True)
class Candidate:
    """One planned layout: its overrides, its memory plan, and the worst phase's use of what it may use."""

    nodes: int
    ep: int
    tp: int
    overrides: tuple[str, ...]
    plan: MemoryPlan

    @property
    def use(self) -> dict[str, float]:
        """Each phase's bytes over what it may use (> 1: does not fit)."""
        p = self.plan
        one_sequence = p.seq * p.kv_per_token
        return {
            "load": (p.load + p.budget) / p.device,
            "train": p.train_peak / (TRAIN_HEADROOM * p.device),
            "rollout": (p.resident + p.budget) / p.device,
            "vLLM": one_sequence / p.kv_capacity if p.kv_capacity else float("inf"),
        }

    @property
    def worst(self) -> float:
        return max(self.use.values())


def scaled_batch(cfg: Config, world: int) -> tuple[int, int]:
    """(rollout_batch_size, global_batch_size) giving every rank the same share of a step of at least the
    config's prompts, with the config's optimizer steps per step and a mini-batch per rank that the update
    micro-batch divides."""
    d, a, n = cfg.data, cfg.worker.actor, cfg.worker.rollout.n
    num_mini = max(1, d.rollout_batch_size * n // a.global_batch_size)
    p = -(-d.rollout_batch_size // world)
    while (p * n) % num_mini or (p * n // num_mini) % a.micro_batch_size_per_device_for_update:
        p += 1
    return p * world, p * n // num_mini * world


def _layout(cfg: Config, world: int, ep: int, tp: int) -> tuple[Config, tuple[str, ...]]:
    """`cfg` with the step scaled to `world`, EP `ep` and rollout TP `tp`, and the overrides that say so."""
    prompts, global_batch = scaled_batch(cfg, world)
    a, r = cfg.worker.actor, cfg.worker.rollout
    actor = replace(a, global_batch_size=global_batch, fsdp=replace(a.fsdp, expert_parallel_size=ep))
    worker = replace(cfg.worker, actor=actor, rollout=replace(r, tensor_parallel_size=tp))
    overrides = (
        f"data.rollout_batch_size={prompts}",
        f"worker.actor.global_batch_size={global_batch}",
        f"worker.actor.fsdp.expert_parallel_size={ep}",
        f"worker.rollout.tensor_parallel_size={tp}",
    )
    return replace(cfg, data=replace(cfg.data, rollout_batch_size=prompts), worker=worker), overrides


def _sizes(cfg: Config, model: ModelCounts, hf_config, world: int) -> list[tuple[int, int]]:
    """The (EP, TP) pairs searched on `world` ranks."""
    eps = [e for e in range(1, model.num_experts + 1) if model.num_experts % e == 0 and world % e == 0] or [1]
    heads = (model.text.num_attention_heads, getattr(hf_config.vision_config, "num_heads", 1))
    tps, tp = [], cfg.worker.rollout.tensor_parallel_size
    while tp <= world:
        if world % tp == 0 and all(h % tp == 0 for h in heads):
            tps.append(tp)
        tp *= 2
    return [(ep, tp) for ep in eps for tp in tps]


def candidates(path: str, overrides: list[str], nodes: int, nproc: int, device_gb: float) -> list[Candidate]:
    """Every (EP, TP) layout of `path` + `overrides` on `nodes` x `nproc` devices that the config accepts."""
    base = load_config(path, overrides)
    world = nodes * nproc
    hf_config, _ = model_config(base.worker.actor.model.model_path)
    model = count_parameters(hf_config, base.worker.actor.model.lora)
    out = []
    for ep, tp in _sizes(base, model, hf_config, world):
        cfg, layout = _layout(base, world, ep, tp)
        try:
            validate(cfg, world)
            check_expert_parallel(cfg, model)
        except ConfigError:
            continue
        plan = memory_plan(cfg, model, batches(cfg, world), device_gb)
        out.append(Candidate(nodes, ep, tp, tuple(last_wins([*overrides, *layout])), plan))
    return out


def _failing(c: Candidate) -> str:
    p, use = c.plan, c.use
    why = {
        "load": f"load {(p.load + p.budget) / GiB:.1f} GiB > {p.device / GiB:.0f}",
        "train": f"training {p.train_peak / GiB:.1f} GiB > {TRAIN_HEADROOM * p.device / GiB:.1f}",
        "rollout": f"rollout {(p.resident + p.budget) / GiB:.1f} GiB > {p.device / GiB:.0f}",
        "vLLM": f"vLLM weights {p.vllm_weights / GiB:.1f} GiB leave no KV room in its {p.budget / GiB:.1f} GiB",
    }
    return "; ".join(why[k] for k, u in use.items() if u > 1) or "fits"


def arithmetic(cfg: Config, model: ModelCounts, c: Candidate, world: int) -> list[str]:
    """Parameters, bytes per parameter and the per-rank totals of the chosen candidate."""
    p, lora = c.plan, cfg.worker.actor.model.lora.enabled
    n, experts = model.num_params, model.num_expert
    if lora:
        base = BYTES[param_dtype(cfg)]
        state = (
            f"frozen base {base} B/parameter x {n / 1e9:.2f}B / {world} = {base * n / world / GiB:.2f} GiB; adapters "
            f"16 B/parameter (fp32 weight 4 + gradient 4 + AdamW 8) x {model.num_adapter / 1e6:.1f}M / {world} = "
            f"{16 * model.num_adapter / world / GiB:.3f} GiB"
        )
    else:
        state = (
            f"16 B/parameter (fp32 master 4 + gradient 4 + AdamW 8) x {n / 1e9:.2f}B / {world} = "
            f"{16 * n / world / GiB:.2f} GiB (experts {16 * experts / world / GiB:.2f} at any EP, the rest "
            f"{16 * (n - experts) / world / GiB:.2f})"
        )
    return [
        f"parameters: {n / 1e9:.2f}B = routed experts {experts / 1e9:.2f}B + the rest {(n - experts) / 1e9:.2f}B "
        f"(vision {model.num_vision / 1e9:.2f}B)",
        f"state per rank: {state}",
        f"per rank: load {(p.load + p.budget) / GiB:.1f} GiB (<= {p.device / GiB:.0f}), training peak "
        f"{p.train_peak / GiB:.1f} GiB (<= {TRAIN_HEADROOM * p.device / GiB:.1f}), rollout "
        f"{(p.resident + p.budget) / GiB:.1f} GiB (<= {p.device / GiB:.0f}); vLLM weights {p.vllm_weights / GiB:.1f} "
        f"GiB (bf16 {2 * n / 1e9:.0f} GB / TP {c.tp}) in a {p.budget / GiB:.1f} GiB reservation",
    ]


def fewest_nodes(
    path: str, overrides: list[str], nproc: int = 8, device_gb: float = 80.0, max_nodes: int = 32
):
    """(the fewest nodes' fitting candidates, printable lines); no candidate up to `max_nodes`: ([], lines)."""
    lines = []
    for nodes in range(1, max_nodes + 1):
        found = candidates(path, overrides, nodes, nproc, device_gb)
        if not found:
            lines.append(f"nodes {nodes} (world {nodes * nproc}): no layout the config accepts")
            continue
        best = min(
            found, key=lambda c: (c.worst, sum(u > 1 for u in c.use.values()), c.tp, c.plan.train_peak)
        )
        lines.append(
            f"nodes {nodes} (world {nodes * nproc}): best EP {best.ep}, TP {best.tp} -> "
            + ("fits" if best.worst <= 1 else f"DOES NOT FIT: {_failing(best)}")
        )
        fitting = sorted((c for c in found if c.worst <= 1), key=lambda c: (c.tp, c.plan.train_peak, c.ep))
        if fitting:
            return fitting, lines
    return [], lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    p.add_argument("--nproc-per-node", type=int, default=8)
    p.add_argument("--device-memory-gb", type=float, default=80.0)
    p.add_argument("--max-nodes", type=int, default=32)
    args = p.parse_args(argv)
    fitting, lines = fewest_nodes(
        args.config, args.overrides, args.nproc_per_node, args.device_memory_gb, args.max_nodes
    )
    print("\n".join(lines))
    if not fitting:
        sys.exit(f"no layout fits up to {args.max_nodes} nodes")
    chosen = fitting[0]
    world = chosen.nodes * args.nproc_per_node
    cfg = load_config(args.config, list(chosen.overrides))
    model = count_parameters(model_config(cfg.worker.actor.model.model_path)[0], cfg.worker.actor.model.lora)
    print(
        f"fewest: {chosen.nodes} node(s) of {args.nproc_per_node} x {args.device_memory_gb:g} GiB; chosen EP {chosen.ep}, "
        f"TP {chosen.tp} (smallest TP, then lowest training peak; all that fit: "
        + ", ".join(f"EP {c.ep} TP {c.tp}" for c in fitting)
        + ")"
    )
    print("\n".join(arithmetic(cfg, model, chosen, world)))
    print(
        f"$ python -m spmd_grpo.train {Path(args.config)} {' '.join(chosen.overrides)} --dry-run --nnodes "
        f"{chosen.nodes} --nproc-per-node {args.nproc_per_node} --device-memory-gb {args.device_memory_gb:g}"
    )
    print(dry_run(cfg, chosen.nodes, args.nproc_per_node, args.device_memory_gb))


if __name__ == "__main__":
    main()
