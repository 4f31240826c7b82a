"""Policy and reference models: load Qwen2.5-VL, shard with FSDP2, optimizer and LR schedule.

`fully_shard` is applied per vision block and per language decoder layer, then to the root (torchtitan's
`parallelize` order: activation checkpointing -> fully_shard per block -> root). The policy is loaded in
fp32 on every device (fp32 master weights for AdamW, as verl); FSDP2's MixedPrecisionPolicy gathers bf16
copies on accelerators and reduces gradients in fp32 (fp32 throughout on CPU by default). The frozen
reference model is cast to its compute dtype BEFORE `fully_shard` on NPU (torch_npu cannot cast sharded
DTensors; verl also builds the reference in bf16).

Gradient clipping uses the true global norm: `clip_grad_norm_` over DTensor gradients reduces the
per-shard norms across ranks (FSDP2 semantics), so every rank gets the same norm.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from .config import ActorConfig, FSDPConfig, OptimConfig
from .distributed import World, cast_before_shard
from .logprobs import PolicyModule, unsamplable_token_ids

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(name: str, device_type: str) -> torch.dtype:
    """`auto` is bfloat16 on accelerators and float32 on CPU."""
    if name == "auto":
        return torch.float32 if device_type == "cpu" else torch.bfloat16
    return DTYPES[name]


def load_hf_model(model_path: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> nn.Module:
    """Qwen2.5-VL (or another image-text-to-text model) from a local directory or a hub id."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(
        model_path, dtype=dtype, attn_implementation="sdpa", device_map=None
    ).to(device)


def decoder_layers(hf_model: nn.Module) -> list[nn.Module]:
    return list(hf_model.model.language_model.layers)


def vision_blocks(hf_model: nn.Module) -> list[nn.Module]:
    return list(hf_model.model.visual.blocks)


def shard_model(model: PolicyModule, fsdp: FSDPConfig, world: World, *, training: bool) -> PolicyModule:
    """`fully_shard` each vision block and decoder layer, then the root. In place; returns the model."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    param_dtype = resolve_dtype(fsdp.param_dtype, world.device_type)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=DTYPES[fsdp.reduce_dtype])
    kwargs = {"mp_policy": mp}
    if fsdp.offload_params:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in vision_blocks(model.hf) + decoder_layers(model.hf):
        # Forward-only models never reshard between forward and backward; keep prefetching simple.
        fully_shard(block, reshard_after_forward=True, **kwargs)
    fully_shard(model, reshard_after_forward=training, **kwargs)
    return model


def build_policy(cfg: ActorConfig, world: World) -> PolicyModule:
    """The trainable policy, fp32 master weights on every device (NPU included), gathered in param_dtype."""
    hf = load_hf_model(cfg.model.model_path, torch.float32, world.device)
    if cfg.model.freeze_vision_tower:
        hf.model.visual.requires_grad_(False)
    if cfg.model.enable_gradient_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        layers = hf.model.language_model.layers
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer)
    model = PolicyModule(hf, unsamplable_token_ids(hf.config), cfg.logprob_chunk_size)
    shard_model(model, cfg.fsdp, world, training=True)
    model.train()
    return model


def build_reference(cfg: ActorConfig, offload: bool, world: World) -> PolicyModule:
    """Frozen FSDP2 copy for forward-only reference logprobs (all ranks run it together).

    On NPU it is loaded in its compute dtype (`fsdp.param_dtype`), i.e. cast BEFORE `fully_shard`
    (torch_npu cannot cast sharded DTensors; verl also keeps its reference in bf16). Elsewhere it is loaded
    in fp32 and cast by FSDP2's all-gather: the same numbers, since the compute dtype is what runs either
    way. The policy is never cast before sharding: its fp32 parameters are the optimizer's master weights.
    """
    load_dtype = torch.float32
    if cast_before_shard(world.device_type):
        load_dtype = resolve_dtype(cfg.fsdp.param_dtype, world.device_type)
    hf = load_hf_model(cfg.model.model_path, load_dtype, world.device)
    model = PolicyModule(hf, unsamplable_token_ids(hf.config), cfg.logprob_chunk_size)
    model.requires_grad_(False)
    fsdp = FSDPConfig(cfg.fsdp.param_dtype, cfg.fsdp.reduce_dtype, offload_params=offload)
    shard_model(model, fsdp, world, training=False)
    model.eval()
    return model


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
