"""Put the grouped experts and the replay-aware router into a Hugging Face MoE model, from outside.

At model build (`models.build.build_sharded`, before sharding, on the meta device), every sparse MoE block
of the language model (a module with a `gate` router and stacked `experts`, found by shape, not by class
name, so Qwen3-VL-MoE and Qwen3.5-MoE both qualify) gets its experts' forward swapped for the grouped GEMM
(`experts.grouped_experts_forward`) and its router's for `routing.routed_forward`. Only those two
instances' forwards change: parameters, names, the checkpoint layout and every module boundary FSDP2 and
activation checkpointing see stay as transformers made them, and every pass of that model (old, reference,
update) runs them. A dense model has no such block and is left alone (`install_moe` returns None).
"""

from __future__ import annotations

import re

from torch import nn

from spmd_grpo.models.moe.experts import is_stacked_experts, use_grouped_experts
from spmd_grpo.models.moe.routing import MoEState, use_routing

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def moe_blocks(hf_model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(decoder layer index, block) of every sparse MoE block in `hf_model`, in layer order."""
    found = []
    for name, module in hf_model.named_modules():
        experts, gate = getattr(module, "experts", None), getattr(module, "gate", None)
        if isinstance(experts, nn.Module) and isinstance(gate, nn.Module) and is_stacked_experts(experts):
            match = _LAYER.search(name + ".")
            if match is None:
                raise NotImplementedError(f"MoE block {name} is not inside a numbered decoder layer")
            found.append((int(match.group(1)), module))
    return sorted(found, key=lambda pair: pair[0])


def router_aux_loss_coef(configured: float | None, hf_config) -> float:
    """`worker.actor.moe.router_aux_loss_coef`, or with None the model's own: its `router_aux_loss_coef`
    where its `output_router_logits` is true (transformers adds the loss only then), else 0.

    Off by default, as the RL trainers users compare with: verl's FSDP actor's loss is the policy loss
    with its entropy and KL terms only, and its Megatron path builds Qwen MoE models with
    `moe_router_load_balancing_type="none"` (mbridge: "default None for RL"); NeMo-RL's Megatron GRPO
    configs for MoE models set `moe_router_load_balancing_type: none` too (several also freeze the router,
    `freeze_moe_router: true`, which is not offered here)."""
    if configured is not None:
        return configured
    text = hf_config.get_text_config()
    return (
        float(getattr(text, "router_aux_loss_coef", 0.0))
        if getattr(text, "output_router_logits", False)
        else 0.0
    )


def install_moe(hf_model: nn.Module, *, aux_loss_coef: float = 0.0) -> MoEState | None:
    """Grouped experts and replay-aware routers in every MoE block; the model's `MoEState` (None: dense).
    `aux_loss_coef` > 0: the routers accumulate the load-balancing loss terms in forwards with gradients."""
    blocks = moe_blocks(hf_model)
    if not blocks:
        return None
    text = hf_model.config.get_text_config()
    state = MoEState(
        num_layers=text.num_hidden_layers,
        num_experts=text.num_experts,
        top_k=text.num_experts_per_tok,
        aux_loss_coef=aux_loss_coef,
    )
    for layer, block in blocks:
        use_grouped_experts(block.experts)
        use_routing(block.gate, state, layer)
    return state
