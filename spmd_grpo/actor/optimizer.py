"""The actor's optimizer: AdamW over the trainable parameters, the LR schedule (linear warm-up, then constant
or cosine), and gradient-norm clipping over the sharded parameters (the norm is a global one, returned for
`actor/grad_norm`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from spmd_grpo.config.workers import OptimConfig


@dataclass
class OptimizerBundle:
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR


def build_optimizer(model: nn.Module, cfg: OptimConfig, total_steps: int) -> OptimizerBundle:
    """AdamW over trainable parameters only; linear warmup then constant or cosine to min_lr_ratio."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, foreach=False
    )

    def lr_lambda(step: int) -> float:
        if cfg.lr_warmup_steps > 0 and step < cfg.lr_warmup_steps:
            return (step + 1) / cfg.lr_warmup_steps
        if cfg.lr_scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.lr_warmup_steps) / max(1, total_steps - cfg.lr_warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return OptimizerBundle(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda))


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip by the global norm over all shards; returns the pre-clip norm (same on every rank).

    The norm is taken per group of gradients sharded alike (one device mesh and placement: the dense
    weights, and with expert parallelism the experts on their own 2-D mesh), each reduced over its ranks,
    then combined: `clip_grad_norm_` stacks every norm into one tensor, which DTensors on different meshes
    cannot share."""
    params = [p for p in model.parameters() if p.grad is not None]
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        key = (p.grad.device_mesh, p.grad.placements) if hasattr(p.grad, "device_mesh") else None
        groups.setdefault(key, []).append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.tensor(0.0)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=False)
    return float(total)
