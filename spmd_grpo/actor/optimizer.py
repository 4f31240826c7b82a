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
    """Clip by the global norm over all shards; returns the pre-clip norm (same on every rank)."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm, foreach=False)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
