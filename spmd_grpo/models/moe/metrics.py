"""A step's MoE metrics from the models' routing counts, summed over ranks.

    moe/load/max_over_mean       tokens of the busiest expert over the mean tokens per expert, averaged
                                 over MoE layers (1 = perfectly balanced; E / K when every token of a
                                 layer goes to the same K experts)
    moe/load/max_over_mean_max   the same for the worst layer
    moe/route_diff/<pass>        fraction of the router's own top-k decisions (token, layer, slot) that
                                 differ from the sample's reference routes in that pass (old: trainer vs
                                 vLLM with routing_replay=rollout; ref, update: vs the old pass's or vLLM's)

Load counts cover every trainer pass of the step (old, reference, update), valid tokens only; a padding
micro-batch (a rank with fewer micro-batches than the others) counts nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from spmd_grpo.models.moe.routing import MoEState

PASSES = ("old", "ref", "update")


def moe_metrics(models: list, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
    """The step's metrics from the routing counts of `models` (the policy, the reference, or None), which
    are then reset. Collective where a model is MoE (every rank holds the same models); dense: {}."""
    states: list[MoEState] = [m.moe for m in models if getattr(m, "moe", None) is not None]
    if not states:
        return {}
    load, diff = None, torch.zeros(len(PASSES), 2, dtype=torch.float64)
    for state in states:
        taken = state.take_metrics()
        part = taken.get("load", torch.zeros(state.num_layers, state.num_experts, dtype=torch.float64))
        load = part if load is None else load + part
        for i, name in enumerate(PASSES):
            if f"diff/{name}" in taken:
                diff[i] += taken[f"diff/{name}"]
    total = all_reduce_sum(torch.cat([load.reshape(-1), diff.reshape(-1)]))
    load, diff = total[: load.numel()].view_as(load), total[load.numel() :].view_as(diff)
    metrics = {}
    used = load[load.sum(-1) > 0]  # MoE layers that saw tokens
    if used.numel():
        ratio = used.max(-1).values / used.mean(-1)
        metrics["moe/load/max_over_mean"] = ratio.mean().item()
        metrics["moe/load/max_over_mean_max"] = ratio.max().item()
    for (differing, compared), name in zip(diff.tolist(), PASSES, strict=True):
        if compared > 0:
            metrics[f"moe/route_diff/{name}"] = differing / compared
    return metrics
