"""`--dry-run`: the plan of a job for a production world size, computed on one CPU process in seconds.

    python -m spmd_grpo.train cfg.yaml --dry-run --nnodes 4 --nproc-per-node 8 [key=value ...]

Validates the config for that world size, builds the model on the meta device (no weights, no download when
the model id is one of the published architectures of `models/families.py` -- Qwen2-VL 2B/7B, Qwen2.5-VL 3B/7B/32B,
Qwen3-VL 2B/4B/8B/32B -- and the hub is unreachable), and prints: the mesh layout
(TP groups, which rank owns which prompts), batch arithmetic, the first batch's tensor shapes, and a
per-rank memory estimate. The memory figures are ARITHMETIC from parameter counts and config, not
measurements: activations in particular are an order-of-magnitude estimate.

With LoRA (`worker.actor.model.lora.rank` > 0) the table shows the frozen base in the compute dtype
(bf16 on accelerators; on the host with `fsdp.offload_params`), the fp32 adapters, gradients and AdamW
states of the adapters only, and no reference model (the policy with its adapters disabled).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from spmd_grpo.config.schema import Config
from spmd_grpo.config.validate import validate
from spmd_grpo.config.workers import LoRAConfig
from spmd_grpo.models.families import PUBLISHED, family_of
from spmd_grpo.models.lora import target_module_names

GiB = 2**30
BF16 = 2  # bytes per bf16 value
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
NO_LORA = LoRAConfig()


def _reference_dtype(cfg: Config) -> str:
    """The reference's dtype on the planned accelerators: worker.ref.dtype, auto = the actor's param_dtype
    (itself auto = bfloat16 on accelerators)."""
    name = cfg.worker.ref.dtype
    if name == "auto":
        name = cfg.worker.actor.fsdp.param_dtype
    return "bfloat16" if name == "auto" else name


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
class _Model:
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

    @property
    def head_dim(self) -> int:
        """Explicit in Qwen3-VL's config (128 for 32B, where hidden / heads is 80); else hidden / heads."""
        return getattr(self.text, "head_dim", None) or self.text.hidden_size // self.text.num_attention_heads


@dataclass(frozen=True)
class _Batches:
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


_COUNTED: dict[str, _Model] = {}
"""_count_parameters' results by the config's JSON: a meta build takes about 0.2 s, and a process that plans
several jobs (the test suite) asks again for the same architectures."""


def _count_parameters(hf_config, lora: LoRAConfig = NO_LORA) -> _Model:
    key = hf_config.to_json_string() + repr(lora)
    if key not in _COUNTED:
        _COUNTED[key] = _build_and_count(hf_config, lora)
    return _COUNTED[key]


def _build_and_count(hf_config, lora: LoRAConfig) -> _Model:
    family = family_of(hf_config)
    with torch.device("meta"):
        model = family.model_cls()(hf_config)
    num_params = sum(p.numel() for p in model.parameters())
    num_vision = sum(p.numel() for p in family.vision_tower(model).parameters())
    layer_params = max(sum(p.numel() for p in layer.parameters()) for layer in family.decoder_layers(model))
    adapted = target_module_names(model, lora) if lora.enabled else []
    modules = dict(model.named_modules())
    num_adapter = sum(lora.rank * (modules[n].in_features + modules[n].out_features) for n in adapted)
    return _Model(num_params, num_vision, layer_params, hf_config.text_config, num_adapter, len(adapted))


def _batches(cfg: Config, world: int) -> _Batches:
    d, a, r = cfg.data, cfg.worker.actor, cfg.worker.rollout
    prompts_per_rank = d.rollout_batch_size // world
    samples_per_rank = prompts_per_rank * r.n
    mini_per_rank = a.global_batch_size // world
    return _Batches(
        world=world,
        tp=r.tensor_parallel_size,
        prompts_per_rank=prompts_per_rank,
        samples_per_rank=samples_per_rank,
        mini_per_rank=mini_per_rank,
        num_mini=samples_per_rank // mini_per_rank,
        micro_per_mini=mini_per_rank // a.micro_batch_size_per_device_for_update,
        seq=cfg.max_model_len,
    )


def dry_run(cfg: Config, nnodes: int, nproc_per_node: int, device_memory_gb: float = 80.0) -> str:
    """The plan of `cfg` on nnodes x nproc_per_node devices of device_memory_gb each, as printable lines."""
    world = nnodes * nproc_per_node
    validate(cfg, world)  # planned for another machine: its files are not checked (run/preflight.py)
    a = cfg.worker.actor
    hf_config, source = model_config(a.model.model_path, trust_remote_code=a.model.trust_remote_code)
    model = _count_parameters(hf_config, a.model.lora)
    b = _batches(cfg, world)
    lines = [
        f"plan: {nnodes} nodes x {nproc_per_node} devices = world {world}; config valid for this world size",
        f"model: {a.model.model_path} ({source} config): {model.num_params / 1e9:.2f}B parameters "
        f"(vision {model.num_vision / 1e6:.0f}M, largest decoder layer {model.layer_params / 1e6:.0f}M), "
        f"tie_word_embeddings={hf_config.tie_word_embeddings}",
        *_lora_lines(cfg, model, b),
        *_layout_lines(cfg, b),
        _shared_prompt_line(cfg, b),
        _shapes_line(cfg, b.seq, family_of(hf_config).patch_size),
        *_memory_lines(cfg, model, b, device_memory_gb),
    ]
    return "\n".join(lines)


def _layout_lines(cfg: Config, b: _Batches) -> list[str]:
    """TP groups, which rank owns which prompts, and the update's mini/micro-batches."""
    d, a, r = cfg.data, cfg.worker.actor, cfg.worker.rollout
    world, tp, prompts_per_rank = b.world, b.tp, b.prompts_per_rank
    groups = [list(range(g * tp, (g + 1) * tp)) for g in range(world // tp)]
    shown = groups[:2] + ([["..."]] if len(groups) > 3 else []) + groups[-1:] if len(groups) > 3 else groups
    owners = [
        f"rank {k}: prompts {k * prompts_per_rank}..{(k + 1) * prompts_per_rank - 1}"
        for k in (0, 1, world - 1)
    ]
    return [
        f"rollout TP groups ({len(groups)} x TP {tp}, consecutive ranks): {shown}",
        f"prompts per step {d.rollout_batch_size}: {prompts_per_rank} per rank, each with all {r.n} samples "
        f"({'; '.join(owners)}); a TP group generates its {prompts_per_rank * tp} prompts together",
        f"update: {b.samples_per_rank} samples per rank -> {b.num_mini} mini-batch(es) of {b.mini_per_rank} "
        f"per rank (global {a.global_batch_size}) x "
        + (
            f"micro-batches of ~{a.max_token_len_per_device_for_update} tokens (token budget; their count is "
            "set each step from the lengths, the same on every rank)"
            if a.dynamic_batching
            else f"{b.micro_per_mini} micro-batches of {a.micro_batch_size_per_device_for_update}"
        )
        + f" x {a.ppo_epochs} epoch(s) = "
        f"{b.num_mini * a.ppo_epochs} optimizer steps per training step",
    ]


def _shares_prompt(cfg: Config) -> bool:
    """Whether the planned accelerators hold each group's prompt once: `worker.actor.shared_prompt=true` with
    packed batches (auto shares on the CPU only: flash attention's varlen kernel cannot share a prefix, and the
    flex-attention kernel true selects on CUDA is not yet checked on a GPU)."""
    a = cfg.worker.actor
    return a.shared_prompt is True and a.padding_free is not False


def _shared_prompt_line(cfg: Config, b: _Batches) -> str:
    """The shared-prompt layout's tokens per group at the longest prompt and response, and whether it is on."""
    d, n = cfg.data, cfg.worker.rollout.n
    p, r = d.max_prompt_length, d.max_response_length
    unshared, shared = n * (p + r), p + n * r
    why = (
        "on"
        if _shares_prompt(cfg)
        else "off on accelerators with auto (on the CPU, auto shares)"
        if cfg.worker.actor.shared_prompt == "auto"
        else "off"
    )
    return (
        f"shared prompt (worker.actor.shared_prompt={str(cfg.worker.actor.shared_prompt).lower()}): {why}; a group of {n} at "
        f"the longest holds {shared} tokens instead of {unshared} ({100 * (1 - shared / unshared):.0f} % fewer) "
        "in the old, reference and update passes"
    )


def _micro_tokens(cfg: Config, b: _Batches) -> int:
    """Most prompt + response tokens in one update micro-batch. A fixed-count micro-batch is padded to
    micro x the longest sequence. A token-budget one (`dynamic_batching`) holds about the budget: its parts
    are balanced but, as verl's, not capped, so one part can exceed the budget by up to one sequence, and
    none holds more than the rank's mini-batch. With shared prompts a fixed-count micro-batch holds each of
    its groups' prompt once."""
    a = cfg.worker.actor
    if not a.dynamic_batching:
        micro = a.micro_batch_size_per_device_for_update
        if _shares_prompt(cfg):  # `micro` consecutive samples span at most this many groups
            groups = min(micro, 1 + math.ceil((micro - 1) / cfg.worker.rollout.n))
            return groups * cfg.data.max_prompt_length + micro * cfg.data.max_response_length
        return micro * b.seq
    return min(b.mini_per_rank * b.seq, a.max_token_len_per_device_for_update + b.seq)


def _shapes_line(cfg: Config, seq: int, patch: int) -> str:
    """The largest tensors of one update micro-batch, and the image token range of min/max_pixels."""
    d = cfg.data
    micro = cfg.worker.actor.micro_batch_size_per_device_for_update
    merge = 2 * patch  # patch x spatial merge 2: one LM token per 28x28 (Qwen3-VL: 32x32) pixels
    max_img_tokens = d.max_pixels // merge**2
    min_img_tokens = max(1, d.min_pixels // merge**2)
    patch_dim = 3 * 2 * patch * patch
    too_large = (
        f" -- images above {d.max_prompt_length * merge**2} pixels cannot fit data.max_prompt_length and "
        "their prompts will be filtered"
        if max_img_tokens > d.max_prompt_length
        else ""
    )
    images = f"an image gives {min_img_tokens}..{max_img_tokens} tokens (min/max_pixels)" + too_large
    if cfg.worker.actor.dynamic_batching:
        budget = cfg.worker.actor.max_token_len_per_device_for_update
        return (
            f"update micro-batch shapes: ~{budget} prompt + response tokens each (token budget), as input_ids "
            f"[1, tokens] packed (padding_free) or [samples, longest] padded; pixel_values [<= tokens x 4, "
            f"{patch_dim}]; {images}"
        )
    return (
        f"first batch shapes per micro-batch (padded to the longest; at most): input_ids [{micro}, {seq}], "
        f"position_ids [3, {micro}, {seq}], pixel_values [<= {micro * max_img_tokens * 4}, {patch_dim}], "
        f"image_grid_thw [{micro}, 3]; {images}"
    )


def _train_memory(cfg: Config, model: _Model, b: _Batches) -> dict[str, float]:
    """Bytes per rank while training, by item (arithmetic from parameter counts and config)."""
    a = cfg.worker.actor
    text, world = model.text, b.world
    shard = model.num_params / world
    trainable = model.num_params - (model.num_vision if a.model.freeze_vision_tower else 0)
    checkpointing = a.model.enable_gradient_checkpointing
    per_layer = 1 if checkpointing else 16  # activations kept per layer, in units of the layer's input
    ref_offload = cfg.worker.ref.offload_params
    ref_dtype = _reference_dtype(cfg)
    reference = f"reference {ref_dtype} shard" + (" (CPU offload)" if ref_offload else "")
    logits = f"logits chunk fp32 ({a.logprob_chunk_size} tokens x vocab)"
    tokens = _micro_tokens(cfg, b)
    activations = f"activations (estimate: {tokens} tokens' layer inputs kept" + (
        ", checkpointing)" if checkpointing else ", no checkpointing x ~16)"
    )
    if a.model.lora.enabled:  # frozen base in the compute dtype, fp32 adapters, no reference model
        base = _base_dtype(cfg)
        where = " (CPU offload)" if a.fsdp.offload_params else ""
        state = {
            f"policy: frozen base {base} shard{where}": 0.0 if where else BYTES[base] * shard,
            "policy: LoRA adapters fp32 shard": 4 * model.num_adapter / world,
            "gradients fp32 shard (adapters only)": 4 * model.num_adapter / world,
            "AdamW states fp32 shard (adapters only)": 8 * model.num_adapter / world,
        }
        reference, ref_bytes = "reference: none (the policy with its adapters disabled)", 0.0
    else:
        state = {
            "policy fp32 master shard": 4 * shard,
            "gradients fp32 shard": 4 * trainable / world,
            "AdamW states fp32 shard": 8 * trainable / world,
        }
        ref_bytes = 0.0 if ref_offload or not cfg.algorithm.use_kl_loss else BYTES[ref_dtype] * shard
    return {
        **state,
        "gathered bf16 layer (+ prefetch)": 2 * BF16 * model.layer_params,
        reference: ref_bytes,
        logits: 4 * a.logprob_chunk_size * text.vocab_size * 2,
        activations: tokens * text.hidden_size * BF16 * text.num_hidden_layers * per_layer,
    }


def _base_dtype(cfg: Config) -> str:
    """The dtype a LoRA policy's frozen base is held in on accelerators (fsdp.param_dtype, auto = bf16)."""
    name = cfg.worker.actor.fsdp.param_dtype
    return "bfloat16" if name == "auto" else name


def _resident(cfg: Config, est: dict[str, float]) -> float:
    """What stays on the device while vLLM runs: the policy's shards and (unless offloaded) AdamW states."""
    keep = ("policy",) if cfg.worker.actor.fsdp.offload_optimizer else ("policy", "AdamW")
    return sum(v for k, v in est.items() if k.startswith(keep))


def _lora_lines(cfg: Config, model: _Model, b: _Batches) -> list[str]:
    lora = cfg.worker.actor.model.lora
    if not lora.enabled:
        return []
    return [
        f"LoRA: rank {lora.rank}, alpha {lora.alpha:g} on {model.num_adapted} linear layers: "
        f"{model.num_adapter / 1e6:.1f}M trainable parameters ({100 * model.num_adapter / model.num_params:.2f}%"
        f" of {model.num_params / 1e9:.2f}B); a checkpoint holds the adapters + Adam moments: "
        f"{12 * model.num_adapter / GiB:.2f} GiB (full fine-tuning: {12 * model.num_params / GiB:.0f} GiB); "
        f"no reference model (the policy with its adapters disabled)"
    ]


def _load_line(cfg: Config, model: _Model, b: _Batches, budget: float, device_memory_gb: float) -> str:
    """What a rank holds on the device while building: its fp32 policy shard, its reference shard, one
    slice of the largest tensor being read (the embedding), then vLLM's reservation (dummy weights + KV,
    filled by the first push). The whole model never passes through a rank (`from_pretrained` on every
    rank, the previous way, put 4 bytes x all parameters on each device and in host RAM)."""
    a, ref = cfg.worker.actor, cfg.worker.ref
    shard = model.num_params / b.world
    lora = a.model.lora.enabled
    policy = 0.0 if a.fsdp.offload_params else (BYTES[_base_dtype(cfg)] if lora else 4) * shard
    policy += 4 * model.num_adapter / b.world
    use_ref = cfg.algorithm.use_kl_loss and not ref.offload_params and not lora
    reference = BYTES[_reference_dtype(cfg)] * shard if use_ref else 0.0
    transient = 4 * model.text.vocab_size * model.text.hidden_size / b.world  # fp32 slice of the embedding
    models = policy + reference + transient
    total = models + budget
    fits = "fits" if total <= device_memory_gb * GiB else "DOES NOT FIT"
    return (
        f"  load    policy shard {policy / GiB:.2f} + reference shard {reference / GiB:.2f}"
        + (" (offloaded to host)" if cfg.algorithm.use_kl_loss and ref.offload_params and not lora else "")
        + f" + one slice read "
        f"{transient / GiB:.2f} = {models / GiB:.2f} GiB, then vLLM (dummy weights, reservation {budget / GiB:.1f} "
        f"GiB) = {total / GiB:.1f} GiB -> {fits}; host: one slice buffer per rank (whole-model load per rank, "
        f"the previous way: {4 * model.num_params / GiB:.1f} GiB)"
    )


def _memory_lines(cfg: Config, model: _Model, b: _Batches, device_memory_gb: float) -> list[str]:
    """Per-rank memory: the training items and their peak, the rollout's reservation, vLLM's KV capacity."""
    a, r = cfg.worker.actor, cfg.worker.rollout
    est = _train_memory(cfg, model, b)
    text, tp, seq = model.text, b.tp, b.seq
    # this rank's heads, in the layers that keep a KV cache (a hybrid model's linear-attention layers keep a
    # fixed-size state per sequence instead)
    kv_layers = (getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers).count(
        "full_attention"
    )
    kv_per_token = 2 * kv_layers * text.num_key_value_heads * model.head_dim * BF16 / tp
    vllm_weights = BF16 * model.num_params / tp
    budget = r.gpu_memory_utilization * device_memory_gb * GiB  # what vLLM reserves while awake
    kv_capacity = max(0.0, budget - vllm_weights)
    concurrent = int(kv_capacity // (seq * kv_per_token))
    group_seqs = b.prompts_per_rank * tp * r.n
    offload = a.fsdp.offload_optimizer
    resident = _resident(cfg, est)
    train_total = sum(est.values())
    headroom = "fits" if train_total <= 0.9 * device_memory_gb * GiB else "TOO TIGHT (> 90% of the device)"
    fits = "fits" if resident + budget <= device_memory_gb * GiB else "DOES NOT FIT"
    return [
        f"memory per rank (GiB, arithmetic; device {device_memory_gb:g} GiB):",
        _load_line(cfg, model, b, budget, device_memory_gb),
        *(f"  train   {name:<70} {v / GiB:8.2f}" for name, v in est.items()),
        f"  peak while training  ~{train_total / GiB:.1f} GiB"
        + (" (vLLM asleep: weights and KV released)" if r.enable_sleep_mode else " + vLLM resident")
        + f" -> {headroom}",
        f"  rollout: trainer state kept on the device {resident / GiB:.1f} GiB (policy shard"
        + (")" if offload else " + AdamW states; fsdp.offload_optimizer moves them off)")
        + f" + vLLM reservation {budget / GiB:.1f} GiB (gpu_memory_utilization {r.gpu_memory_utilization})"
        f" = {(resident + budget) / GiB:.1f} GiB -> {fits}",
        f"  vLLM: weights {vllm_weights / GiB:.2f} GiB (bf16 / TP {tp}), KV space {kv_capacity / GiB:.1f} GiB at "
        f"{kv_per_token / 2**10:.0f} KiB/token/rank -> {concurrent} concurrent max-length ({seq}-token) sequences"
        f" per TP group; the step's {group_seqs} sequences per group run in "
        f"{math.ceil(group_seqs / concurrent) if concurrent else 'NO'} wave(s) at worst",
    ]
