"""Per-rank device memory of a planned job, by phase (load, training, rollout) and item: ARITHMETIC from the
parameter counts and the config, not measurements.

What the figures assume:
- Full fine-tuning: fp32 master weights, fp32 gradients and two fp32 AdamW moments per trainable parameter
  (4 + 4 + 8 = 16 bytes; a frozen vision tower: 4), FSDP2-sharded over the ranks; the forward and backward
  gather one decoder layer at a time in bf16 plus the next one prefetched. A reference model (KL loss) is a
  shard in its dtype unless offloaded to the host.
- LoRA: the frozen base in the param dtype (2 bytes per parameter; on the host with `fsdp.offload_params`),
  fp32 adapters with their gradients and AdamW moments (16 bytes per adapter parameter), no reference model.
- Activations: with gradient checkpointing each layer keeps its input (tokens x hidden in bf16) for the
  backward, without it ~16 such tensors: an order-of-magnitude estimate. The recompute of one layer in the
  backward (its attention and MLP intermediates; for an MoE layer the tokens x top-k routed rows) is not
  counted. Logits: one chunk of `logprob_chunk_size` tokens x vocab in fp32 and its gradient.
- The layer being reduced (full fine-tuning): its unsharded gradient as autograd leaves it (param dtype) and
  as the reduce-scatter takes it (reduce dtype), one layer's gathered parameters each.
- Expert parallelism (`worker.actor.fsdp.expert_parallel_size` = EP; torchtitan's layout): EP rank p holds
  experts p x E/EP .. (p + 1) x E/EP - 1 of every MoE layer, FSDP-sharded over the world/EP ranks that hold the
  same experts; every other parameter (attention, routers, a shared expert, vision) is FSDP-sharded over the
  whole world. So an EP rank's experts are N_expert / EP parameters, and a rank's shard of them is
  N_expert / world whatever EP is (shards assumed even: world <= E, or the experts sharded on another dim than
  0 as torchtitan does past that). What EP divides is what a rank gathers per layer (E/EP experts, not E)
  and the group an expert's all-gather and reduce-scatter span.
- All-to-all buffers (EP > 1): the dispatch sends a micro-batch's tokens x top-k rows of `hidden` values in
  the param dtype and receives as many (balanced routing: on average a rank receives what it sends; a skewed
  router can make one rank receive up to EP times that), the combine the same back: 4 buffers in a forward, 4
  more in a backward (the gradients take the routes back), one layer at a time. The larger of the update
  micro-batch (forward + backward) and the forward-only experience micro-batch is counted.
- vLLM: bf16 weights split over TP and a KV cache of 2 x full-attention layers x KV heads x head_dim bf16
  values per token split over TP, inside gpu_memory_utilization x the device; with sleep mode it releases
  both while the trainer runs. It does not fit when its weights leave no room for one max-length sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from spmd_grpo.config.schema import Config
from spmd_grpo.dry_run.counts import (
    BF16,
    BYTES,
    Batches,
    GiB,
    ModelCounts,
    experience_tokens,
    micro_tokens,
    param_dtype,
    reference_dtype,
)

TRAIN_HEADROOM = 0.9
"""Training must leave a tenth of the device to the allocator's fragmentation and what is not counted."""


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per rank in each phase of a step and the verdict of each phase."""

    items: dict[str, float]
    """Training, by item."""
    load: float
    """Policy and reference shards plus the largest tensor's slice while loading (before vLLM's reservation)."""
    budget: float
    """vLLM's reservation while awake (gpu_memory_utilization x the device)."""
    resident: float
    """Trainer state kept on the device while vLLM runs."""
    vllm_weights: float
    kv_per_token: float
    seq: int
    device: float

    @property
    def train_peak(self) -> float:
        return sum(self.items.values())

    @property
    def kv_capacity(self) -> float:
        return max(0.0, self.budget - self.vllm_weights)

    @property
    def concurrent(self) -> int:
        """Max-length sequences a TP group's KV cache holds at once."""
        return int(self.kv_capacity // (self.seq * self.kv_per_token))

    @property
    def verdicts(self) -> dict[str, bool]:
        return {
            "load": self.load + self.budget <= self.device,
            "train": self.train_peak <= TRAIN_HEADROOM * self.device,
            "rollout": self.resident + self.budget <= self.device,
            "vLLM": self.concurrent >= 1,
        }

    @property
    def fits(self) -> bool:
        return all(self.verdicts.values())


def memory_plan(cfg: Config, model: ModelCounts, b: Batches, device_memory_gb: float) -> MemoryPlan:
    """The per-rank memory of `cfg` for `model` on the world of `b`, devices of `device_memory_gb` GiB."""
    a, r = cfg.worker.actor, cfg.worker.rollout
    items = train_memory(cfg, model, b)
    text = model.text
    # this rank's heads, in the layers that keep a KV cache (a hybrid model's linear-attention layers keep a
    # fixed-size state per sequence instead)
    kv_layers = (getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers).count(
        "full_attention"
    )
    keep = ("policy",) if a.fsdp.offload_optimizer else ("policy", "AdamW")
    return MemoryPlan(
        items=items,
        load=sum(_load_parts(cfg, model, b).values()),
        budget=r.gpu_memory_utilization * device_memory_gb * GiB,
        resident=sum(v for k, v in items.items() if k.startswith(keep)),
        vllm_weights=BF16 * model.num_params / b.tp,
        kv_per_token=2 * kv_layers * text.num_key_value_heads * model.head_dim * BF16 / b.tp,
        seq=b.seq,
        device=device_memory_gb * GiB,
    )


def _state(cfg: Config, model: ModelCounts, world: int) -> dict[str, float]:
    """Parameters, gradients and optimizer states per rank; an MoE model's experts apart."""
    a = cfg.worker.actor
    ep = a.fsdp.expert_parallel_size
    frozen_vision = model.num_vision if a.model.freeze_vision_tower else 0
    if a.model.lora.enabled:  # frozen base in the compute dtype, fp32 adapters, no reference model
        base = param_dtype(cfg)
        where = " (CPU offload)" if a.fsdp.offload_params else ""
        return {
            f"policy: frozen base {base} shard{where}": 0.0
            if where
            else BYTES[base] * model.num_params / world,
            "policy: LoRA adapters fp32 shard": 4 * model.num_adapter / world,
            "gradients fp32 shard (adapters only)": 4 * model.num_adapter / world,
            "AdamW states fp32 shard (adapters only)": 8 * model.num_adapter / world,
        }
    if not model.num_expert:
        trainable = model.num_params - frozen_vision
        return {
            "policy fp32 master shard": 4 * model.num_params / world,
            "gradients fp32 shard": 4 * trainable / world,
            "AdamW states fp32 shard": 8 * trainable / world,
        }
    dense, experts = model.num_params - model.num_expert, model.num_expert
    over = f"E/EP = {model.num_experts // ep} per EP rank, FSDP over {world // ep}"
    return {
        f"policy fp32 master shard, non-expert (FSDP over {world})": 4 * dense / world,
        f"policy fp32 master shard, experts ({over})": 4 * experts / world,
        "gradients fp32 shard, non-expert": 4 * (dense - frozen_vision) / world,
        "gradients fp32 shard, experts": 4 * experts / world,
        "AdamW states fp32 shard, non-expert": 8 * (dense - frozen_vision) / world,
        "AdamW states fp32 shard, experts": 8 * experts / world,
    }


def train_memory(cfg: Config, model: ModelCounts, b: Batches) -> dict[str, float]:
    """Bytes per rank while training, by item (arithmetic from parameter counts and config)."""
    a = cfg.worker.actor
    text, ep = model.text, a.fsdp.expert_parallel_size
    checkpointing = a.model.enable_gradient_checkpointing
    per_layer = 1 if checkpointing else 16  # activations kept per layer, in units of the layer's input
    ref_dtype = reference_dtype(cfg)
    reference = f"reference {ref_dtype} shard" + (" (CPU offload)" if cfg.worker.ref.offload_params else "")
    on_device = cfg.algorithm.use_kl_loss and not cfg.worker.ref.offload_params
    ref_bytes = BYTES[ref_dtype] * model.num_params / b.world if on_device else 0.0
    if a.model.lora.enabled:
        reference, ref_bytes = "reference: none (the policy with its adapters disabled)", 0.0
    tokens = micro_tokens(cfg, b)
    activations = f"activations (estimate: {tokens} tokens' layer inputs kept" + (
        ", checkpointing)" if checkpointing else ", no checkpointing x ~16)"
    )
    gathered = "gathered bf16 layer (+ prefetch)"
    if model.num_expert:
        gathered = (
            f"gathered bf16 layer, {model.num_experts // ep} of {model.num_experts} experts (+ prefetch)"
        )
    layer = model.layer_params - model.layer_expert + model.layer_expert / ep  # what a rank gathers
    reducing = {}
    if not a.model.lora.enabled:
        grads = BYTES[param_dtype(cfg)] + BYTES[a.fsdp.reduce_dtype]
        reducing = {f"unsharded gradients of the layer being reduced ({grads} bytes/param)": grads * layer}
    return {
        **_state(cfg, model, b.world),
        gathered: 2 * BF16 * layer,
        **reducing,
        reference: ref_bytes,
        f"logits chunk fp32 ({a.logprob_chunk_size} tokens x vocab)": 4
        * a.logprob_chunk_size
        * text.vocab_size
        * 2,
        activations: tokens * text.hidden_size * BF16 * text.num_hidden_layers * per_layer,
        **all_to_all_buffers(cfg, model, b),
    }


def all_to_all_buffers(cfg: Config, model: ModelCounts, b: Batches) -> dict[str, float]:
    """The dispatch and combine buffers of one MoE layer under expert parallelism (none at EP 1): tokens x
    top-k rows of `hidden` values in the param dtype, send + receive, dispatch + combine, x2 with a backward."""
    ep = cfg.worker.actor.fsdp.expert_parallel_size
    if ep == 1 or not model.num_expert:
        return {}
    update, experience = micro_tokens(cfg, b), experience_tokens(cfg, b)
    tokens, passes, which = (
        (update, 2, "update fwd + bwd") if 2 * update >= experience else (experience, 1, "experience fwd")
    )
    row = model.top_k * model.text.hidden_size * BYTES[param_dtype(cfg)]
    name = f"all-to-all buffers: {4 * passes} x {tokens} tok x top-{model.top_k} x hidden ({which})"
    return {name: 4 * passes * tokens * row}


def _load_parts(cfg: Config, model: ModelCounts, b: Batches) -> dict[str, float]:
    """What a rank holds on the device while building, before vLLM: its policy shard (fp32, or the frozen
    base in the param dtype with LoRA), its reference shard, one slice of the largest tensor being read."""
    a, ref = cfg.worker.actor, cfg.worker.ref
    shard = model.num_params / b.world
    lora = a.model.lora.enabled
    policy = 0.0 if a.fsdp.offload_params else (BYTES[param_dtype(cfg)] if lora else 4) * shard
    use_ref = cfg.algorithm.use_kl_loss and not ref.offload_params and not lora
    return {
        "policy": policy + 4 * model.num_adapter / b.world,
        "reference": BYTES[reference_dtype(cfg)] * shard if use_ref else 0.0,
        "slice": 4 * model.text.vocab_size * model.text.hidden_size / b.world,  # fp32 slice of the embedding
    }


def _load_line(cfg: Config, model: ModelCounts, b: Batches, plan: MemoryPlan) -> str:
    """The load phase: the policy and reference shards, one slice of the largest tensor being read, then vLLM's
    reservation (dummy weights + KV, filled by the first push). The whole model never passes through a rank
    (`from_pretrained` on every rank, the previous way, put 4 bytes x all parameters on each device and in
    host RAM)."""
    parts = _load_parts(cfg, model, b)
    total = plan.load + plan.budget
    fits = "fits" if plan.verdicts["load"] else "DOES NOT FIT"
    offloaded = (
        cfg.algorithm.use_kl_loss
        and cfg.worker.ref.offload_params
        and not cfg.worker.actor.model.lora.enabled
    )
    return (
        f"  load    policy shard {parts['policy'] / GiB:.2f} + reference shard {parts['reference'] / GiB:.2f}"
        + (" (offloaded to host)" if offloaded else "")
        + f" + one slice read {parts['slice'] / GiB:.2f} = {plan.load / GiB:.2f} GiB, then vLLM (dummy weights, "
        f"reservation {plan.budget / GiB:.1f} GiB) = {total / GiB:.1f} GiB -> {fits}; host: one slice buffer per "
        f"rank (whole-model load per rank, the previous way: {4 * model.num_params / GiB:.1f} GiB)"
    )


def memory_lines(cfg: Config, model: ModelCounts, b: Batches, device_memory_gb: float) -> list[str]:
    """Per-rank memory: the load, the training items and their peak, the rollout's reservation, vLLM's KV."""
    r = cfg.worker.rollout
    plan = memory_plan(cfg, model, b, device_memory_gb)
    v = plan.verdicts
    waves = math.ceil(b.prompts_per_rank * b.tp * r.n / plan.concurrent) if plan.concurrent else "NO"
    return [
        f"memory per rank (GiB, arithmetic; device {device_memory_gb:g} GiB):",
        _load_line(cfg, model, b, plan),
        *(f"  train   {name:<70} {v / GiB:8.2f}" for name, v in plan.items.items()),
        f"  peak while training  ~{plan.train_peak / GiB:.1f} GiB"
        + (" (vLLM asleep: weights and KV released)" if r.enable_sleep_mode else " + vLLM resident")
        + f" -> {'fits' if v['train'] else 'TOO TIGHT (> 90% of the device)'}",
        f"  rollout: trainer state kept on the device {plan.resident / GiB:.1f} GiB (policy shard"
        + (
            ")"
            if cfg.worker.actor.fsdp.offload_optimizer
            else " + AdamW states; fsdp.offload_optimizer moves them off)"
        )
        + f" + vLLM reservation {plan.budget / GiB:.1f} GiB (gpu_memory_utilization {r.gpu_memory_utilization})"
        f" = {(plan.resident + plan.budget) / GiB:.1f} GiB -> {'fits' if v['rollout'] else 'DOES NOT FIT'}",
        f"  vLLM: weights {plan.vllm_weights / GiB:.2f} GiB (bf16 / TP {b.tp}), KV space {plan.kv_capacity / GiB:.1f} "
        f"GiB at {plan.kv_per_token / 2**10:.0f} KiB/token/rank -> {plan.concurrent} concurrent max-length "
        f"({b.seq}-token) sequences per TP group; the step's {b.prompts_per_rank * b.tp * r.n} sequences per group "
        f"run in {waves} wave(s) at worst"
        + ("" if v["vLLM"] else " -> DOES NOT FIT (no room for one sequence)"),
    ]
