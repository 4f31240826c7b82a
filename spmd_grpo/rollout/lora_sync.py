"""Adapter-only weight sync (`worker.rollout.lora_sync: adapter`): vLLM serves the policy's LoRA adapters
itself (`enable_lora`) and each push moves only the adapter tensors.

The first push after the engine holds no weights sends the base (every non-adapter weight, unmerged) through
the ordinary weight stream; every push then gathers the adapters whole (fp32) on every rank, writes them as a
PEFT adapter directory (`adapter_model.safetensors` + `adapter_config.json`, the format vLLM's LoRA loader
reads) in a private temporary directory of this rank, and registers it under a NEW integer LoRA id:
vLLM caches adapters by id, and an adapter pushed again under the same id is not re-read (the engine would
keep sampling from the stale one). The previous id is removed from the engine and its directory deleted.
Every generate request then carries the current `LoRARequest`.

vLLM applies adapters to the language model only unless `enable_tower_connector_lora` is on; it is turned on
when `exclude_modules` leaves any of the vision tower adaptable (the default excludes it whole), else vLLM
drops the tower's adapters without a word (Qwen2.5-VL and Qwen3-VL, 2 CPU ranks, fp32: vLLM vs trainer
logprobs 0.12-0.86 apart after an update; 9.5e-7 with it on). vLLM calls its tower LoRA experimental.

Cost: the adapters of Qwen2.5-VL-7B at rank 16 on every language-model linear layer are 40M parameters
(162 MB fp32) against 16.6 GB of bf16 weights per merged push; vLLM runs its LoRA kernels in every forward
instead (measured cost in the README). The output head cannot carry an adapter in this mode (vLLM does not
serve one).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from spmd_grpo.config.workers import LoRAConfig
from spmd_grpo.models.lora import ADAPTER, lora_layers, write_peft_adapter

VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `max_lora_rank` values vLLM 0.32 accepts."""


VISION_TOWER = "model.visual"
"""Where every supported family's vision tower (blocks and mergers) sits in transformers 5.x."""


def adapts_vision_tower(lora: LoRAConfig) -> bool:
    """Whether adapters may reach the vision tower: no `exclude_modules` prefix covers all of it."""
    return not any(p == VISION_TOWER or VISION_TOWER.startswith(p + ".") for p in lora.exclude_modules)


def vllm_lora_kwargs(lora: LoRAConfig) -> dict:
    """`LLM(...)` arguments that let vLLM serve one adapter of this rank (its tower's adapters too)."""
    max_rank = next((r for r in VLLM_MAX_LORA_RANKS if r >= lora.rank), None)
    if max_rank is None:
        raise ValueError(f"worker.actor.model.lora.rank {lora.rank} is above vLLM's largest max_lora_rank")
    kwargs = {"enable_lora": True, "max_lora_rank": max_rank, "max_loras": 1}
    if adapts_vision_tower(lora):
        kwargs["enable_tower_connector_lora"] = True
    return kwargs


def adapter_tensors(policy: nn.Module) -> dict[str, torch.Tensor]:
    """{PEFT key: full fp32 tensor} of every adapter; collective (each sharded adapter is gathered whole)."""
    from spmd_grpo.models.weights import hf_name

    out = {}
    for name, layer in lora_layers(policy):
        module = hf_name(name)
        for part in ("lora_A", "lora_B"):
            weight = getattr(layer, part)[ADAPTER].weight
            full = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
            out[f"base_model.model.{module}.{part}.weight"] = full.detach().float().contiguous()
    return out


class AdapterSync:
    """This rank's adapter pushes into one vLLM engine: the directory, the live LoRA id, its request."""

    def __init__(self, lora: LoRAConfig) -> None:
        self.lora = lora
        self.root = Path(tempfile.mkdtemp(prefix="spmd_grpo_lora_"))
        self.request = None
        self._next_id = 1

    def push(self, llm, policy: nn.Module, version: int) -> int:
        """Gather the adapters, hand them to vLLM under a new id, drop the old one; returns bytes moved."""
        from vllm.lora.request import LoRARequest

        tensors = adapter_tensors(policy)
        path = self.root / f"v{version}_{self._next_id}"
        write_peft_adapter(tensors, path, rank=self.lora.rank, alpha=self.lora.alpha)
        old = self.request
        self.request = LoRARequest(f"policy_v{version}", self._next_id, str(path))
        self._next_id += 1
        if old is not None:
            llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
