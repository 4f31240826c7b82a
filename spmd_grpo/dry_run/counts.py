"""What a plan is computed from: the model's HF config (a local dir, the local HF cache, or a published
architecture of `models/architectures.py` when the hub is unreachable), its parameter counts built on the
meta device (experts apart from the rest for an MoE model), and the batch arithmetic of one step.

The published Qwen3-VL-MoE rows are the values of the hub's `config.json` of Qwen/Qwen3-VL-30B-A3B-Instruct
(48 layers of 128 experts, top 8, expert MLP 768, hidden 2048) and Qwen/Qwen3-VL-235B-A22B-Instruct (94 layers,
128 experts, top 8, expert MLP 1536, hidden 4096); their counts built here are checked against the model
cards' sizes (31.1B, 236B) by the unit tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from spmd_grpo.config.schema import Config
from spmd_grpo.config.workers import LoRAConfig
from spmd_grpo.models.families import PUBLISHED, family_of
from spmd_grpo.models.lora import target_module_names

GiB = 2**30
BF16 = 2  # bytes per bf16 value
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
NO_LORA = LoRAConfig()


def model_config(model_path: str, *, trust_remote_code: bool = False):
    """The HF config from a local dir or the hub; else the published architecture of a known id. A model
    whose family is not supported is refused, naming the supported ones."""
    from transformers import AutoConfig

    # A dry run must answer in seconds: a known id never waits on the hub (local HF cache only).
    try:
        config = AutoConfig.from_pretrained(
            model_path, local_files_only=model_path in PUBLISHED, trust_remote_code=trust_remote_code
        )
        source = "loaded"
    except Exception as e:  # offline, not cached, or not a local directory
        if model_path not in PUBLISHED:
            raise ValueError(
                f"worker.actor.model.model_path={model_path!r}: config not loadable ({type(e).__name__}) and not one "
                f"of the built-in architectures {sorted(PUBLISHED)}"
            ) from None
        config, source = PUBLISHED[model_path].published_config(model_path), "built-in (offline)"
    family_of(config)
    return config, source


@dataclass(frozen=True)
class ModelCounts:
    """Parameter counts of the model built on the meta device, and its HF text config."""

    num_params: int
    num_vision: int
    layer_params: int
    """The largest decoder layer (what FSDP gathers at once)."""
    text: Any
    """The HF text config (hidden_size, num_hidden_layers, vocab_size, ...)."""
    num_adapter: int = 0
    """LoRA adapter parameters (0 without LoRA)."""
    num_adapted: int = 0
    """Linear layers that carry an adapter."""
    num_expert: int = 0
    """Routed expert parameters of all layers (the stacked `gate_up_proj` and `down_proj`; 0 for a dense
    model). Routers and a shared expert count as non-expert: they are replicated under expert parallelism."""
    layer_expert: int = 0
    """The routed expert parameters of the largest decoder layer."""

    @property
    def head_dim(self) -> int:
        """Explicit in Qwen3-VL's config (128 for 32B, where hidden / heads is 80); else hidden / heads."""
        return getattr(self.text, "head_dim", None) or self.text.hidden_size // self.text.num_attention_heads

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (0 for a dense model)."""
        return getattr(self.text, "num_experts", 0) if self.num_expert else 0

    @property
    def top_k(self) -> int:
        """Experts per token (0 for a dense model)."""
        return getattr(self.text, "num_experts_per_tok", 0) if self.num_expert else 0


@dataclass(frozen=True)
class Batches:
    """The batch arithmetic of one training step on `world` ranks."""

    world: int
    tp: int
    prompts_per_rank: int
    samples_per_rank: int
    mini_per_rank: int
    num_mini: int
    micro_per_mini: int
    seq: int
    """Longest sequence: prompt plus response."""


_COUNTED: dict[str, ModelCounts] = {}
"""count_parameters' results by the config's JSON: a meta build takes about 0.2 s (2 s for 235B), and a
process that plans several jobs (the node search, the test suite) asks again for the same architectures."""


def count_parameters(hf_config, lora: LoRAConfig = NO_LORA) -> ModelCounts:
    """The counts of `hf_config`'s model with `lora`'s adapters, built once per process on the meta device."""
    key = hf_config.to_json_string() + repr(lora)
    if key not in _COUNTED:
        _COUNTED[key] = _build_and_count(hf_config, lora)
    return _COUNTED[key]


def _build_and_count(hf_config, lora: LoRAConfig) -> ModelCounts:
    family = family_of(hf_config)
    with torch.device("meta"):
        model = family.model_cls()(hf_config)
    num_params = sum(p.numel() for p in model.parameters())
    num_vision = sum(p.numel() for p in family.vision_tower(model).parameters())

    def expert(name: str) -> bool:
        return family.moe is not None and family.moe.is_fused_expert("." + name)

    layers = [
        (
            sum(p.numel() for p in layer.parameters()),
            sum(p.numel() for n, p in layer.named_parameters() if expert(n)),
        )
        for layer in family.decoder_layers(model)
    ]
    layer_params, layer_expert = max(layers)
    adapted = target_module_names(model, lora) if lora.enabled else []
    modules = dict(model.named_modules())
    num_adapter = sum(lora.rank * (modules[n].in_features + modules[n].out_features) for n in adapted)
    num_expert = sum(p.numel() for n, p in model.named_parameters() if expert(n))
    return ModelCounts(
        num_params,
        num_vision,
        layer_params,
        hf_config.text_config,
        num_adapter,
        len(adapted),
        num_expert=num_expert,
        layer_expert=layer_expert,
    )


def batches(cfg: Config, world: int) -> Batches:
    """The step's batch arithmetic for `cfg` on `world` ranks (the config is valid for that world)."""
    d, a, r = cfg.data, cfg.worker.actor, cfg.worker.rollout
    prompts_per_rank = d.rollout_batch_size // world
    samples_per_rank = prompts_per_rank * r.n
    mini_per_rank = a.global_batch_size // world
    return Batches(
        world=world,
        tp=r.tensor_parallel_size,
        prompts_per_rank=prompts_per_rank,
        samples_per_rank=samples_per_rank,
        mini_per_rank=mini_per_rank,
        num_mini=samples_per_rank // mini_per_rank,
        micro_per_mini=mini_per_rank // a.micro_batch_size_per_device_for_update,
        seq=cfg.max_model_len,
    )


def reference_dtype(cfg: Config) -> str:
    """The reference's dtype on the planned accelerators: worker.ref.dtype, auto = the actor's param_dtype
    (itself auto = bfloat16 on accelerators)."""
    name = cfg.worker.ref.dtype
    if name == "auto":
        name = cfg.worker.actor.fsdp.param_dtype
    return "bfloat16" if name == "auto" else name


def param_dtype(cfg: Config) -> str:
    """The actor's compute dtype on accelerators (fsdp.param_dtype, auto = bf16): a LoRA policy's frozen base
    is held in it, and the all-to-all of expert parallelism moves rows in it."""
    name = cfg.worker.actor.fsdp.param_dtype
    return "bfloat16" if name == "auto" else name


def shares_prompt(cfg: Config) -> bool:
    """Whether the planned accelerators hold each group's prompt once: `worker.actor.shared_prompt` true, or
    auto on GPUs (not with `trainer.device=npu`), with packed batches (`padding_free` not false)."""
    a = cfg.worker.actor
    on = a.shared_prompt is True or (a.shared_prompt == "auto" and cfg.trainer.device != "npu")
    return on and a.padding_free is not False


def micro_tokens(cfg: Config, b: Batches) -> int:
    """Most prompt + response tokens in one update micro-batch. A fixed-count micro-batch is padded to
    micro x the longest sequence. A token-budget one (`dynamic_batching`) holds about the budget: its parts
    are balanced but, as verl's, not capped, so one part can exceed the budget by up to one sequence, and
    none holds more than the rank's mini-batch. With shared prompts a fixed-count micro-batch holds each of
    its groups' prompt once."""
    a = cfg.worker.actor
    if not a.dynamic_batching:
        micro = a.micro_batch_size_per_device_for_update
        if shares_prompt(cfg):  # `micro` consecutive samples span at most this many groups
            groups = min(micro, 1 + math.ceil((micro - 1) / cfg.worker.rollout.n))
            return groups * cfg.data.max_prompt_length + micro * cfg.data.max_response_length
        return micro * b.seq
    return min(b.mini_per_rank * b.seq, a.max_token_len_per_device_for_update + b.seq)


def experience_tokens(cfg: Config, b: Batches) -> int:
    """Most tokens in one forward-only micro-batch (old and reference logprobs): the experience budget plus
    one sequence with `dynamic_batching`, else micro_batch_size_per_device_for_experience padded sequences."""
    a = cfg.worker.actor
    if not a.dynamic_batching:
        return a.micro_batch_size_per_device_for_experience * b.seq
    return min(b.samples_per_rank * b.seq, a.max_token_len_per_device_for_experience + b.seq)
