"""The `worker.*` sections (EasyR1/verl names): actor (model, optimizer, FSDP, MoE), rollout, ref, reward.
An `auto` setting is a speed/memory choice with unchanged numbers, turned on wherever it applies (decided
once: `actor/spec.py`, `models/build.py`, the device layer); `true` where it cannot apply is an error."""

from __future__ import annotations

from dataclasses import field
from typing import Annotated, Literal

from pydantic import Field
from pydantic.dataclasses import dataclass

import spmd_grpo.config.checks as c

LORA_ALL_LINEAR = "all-linear"
Auto = c.Bool | Literal["auto"]
ModuleName = Annotated[
    str,
    c.rule(
        lambda n: all(p.isidentifier() or p.isdigit() for p in n.split(".")), "is not a module name (a.b.c)"
    ),
]
Beta = Annotated[c.Float, Field(ge=0, lt=1)]
DType = Literal["bfloat16", "float16", "float32", "auto"]


@dataclass(config=c.SECTION)
class LoRAConfig:
    """PEFT LoRA on the policy (y = W x + alpha / rank * B A x): frozen base in the compute dtype, fp32
    adapters; the KL reference is the policy with its adapters disabled (as verl; no second model)."""

    rank: c.NonNegative = Field(0, description="0: off (full fine-tuning). verl's `lora_rank`.")
    alpha: c.PositiveFloat = 16.0
    """The adapters' output is scaled by alpha / rank (PEFT's `lora_alpha`)."""
    dropout: Annotated[c.Float, Field(ge=0, lt=1)] = 0.0
    """Dropout on the adapters' input in every training-mode forward (PEFT's `lora_dropout`)."""
    target_modules: Literal["all-linear"] | Annotated[tuple[ModuleName, ...], Field(min_length=1)] = (
        LORA_ALL_LINEAR
    )
    """`all-linear` (every nn.Linear but the output head) or module names ending so, e.g. [q_proj, v_proj]."""
    exclude_modules: tuple[ModuleName, ...] = ("model.visual",)
    """Module-name prefixes (in memory) that get no adapter; the default is the vision tower with its merger."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass(config=c.SECTION)
class ModelConfig:
    model_path: str = ""
    """Local directory or HF hub id of a checkpoint of a supported family (README: supported models)."""
    tokenizer_path: str | None = None
    """Where the processor (tokenizer + image processor) comes from; None: model_path."""
    trust_remote_code: c.Bool = False
    """Passed to transformers (config, processor) and to vLLM: allow code shipped with the checkpoint."""
    freeze_vision_tower: c.Bool = False
    """The vision tower (with Qwen3-VL's DeepStack mergers) gets no gradient and no optimizer state."""
    enable_gradient_checkpointing: c.Bool = False
    """Activation checkpointing of every language-model decoder layer."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)


@dataclass(config=c.SECTION)
class OptimConfig:
    lr: c.PositiveFloat = Field(1e-6, description="AdamW learning rate.")
    betas: tuple[Beta, Beta] = Field((0.9, 0.999), description="AdamW betas.")
    weight_decay: c.NonNegativeFloat = Field(1e-2, description="AdamW weight decay (decoupled).")
    lr_warmup_steps: c.NonNegative = Field(0, description="Linear warm-up steps.")
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    """After warm-up: constant, or cosine decay to `min_lr_ratio` x `lr` at the last step."""
    min_lr_ratio: c.Fraction = Field(0.0, description="The cosine schedule's floor, as a fraction of `lr`.")


@dataclass(config=c.SECTION)
class FSDPConfig:
    param_dtype: DType = "auto"
    """auto: bfloat16 on accelerators, float32 on CPU. Not float16: there is no loss scaling."""
    reduce_dtype: Literal["float32", "bfloat16"] = Field("float32", description="Gradient reduction dtype.")
    offload_params: c.Bool = False
    """Keep the policy's shards, gradients and optimizer step in host memory (FSDP2 CPUOffloadPolicy)."""
    offload_optimizer: c.Bool = False
    """Keep the optimizer state in host memory (nothing to do on CPU)."""
    gather_once_per_pass: Auto = "auto"
    """Gather the parameters once per pass and reduce gradients once per mini-batch (+ a full model and
    gradient per rank). auto: on the CPU, where each gloo gather costs."""
    expert_parallel_size: c.Positive = 1
    """MoE expert parallelism over the data-parallel ranks (1: off): num_experts / EP experts per rank."""


@dataclass(config=c.SECTION)
class MoEConfig:
    """Mixture-of-experts controls (Qwen3-VL-MoE, Qwen3.5-MoE; ignored, with a warning, for a dense model)."""

    routing_replay: Literal["none", "old", "rollout"] = "none"
    """none: each pass routes by its own top-k; old: reference and update replay the old-logprob pass's
    experts (GSPO); rollout: vLLM's (R3; CUDA, TP 1, not Qwen3.5-MoE). docs/models.md: Mixture of experts."""
    router_aux_loss_coef: c.NonNegativeFloat | None = None
    """Router load-balancing loss weight. None: the model config's if `output_router_logits`, else 0."""


@dataclass(config=c.SECTION)
class ActorConfig:
    """The policy and its update; the reference model (worker.ref) is loaded from the same model_path."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    global_batch_size: c.Positive = 16
    """Samples (not prompts) per optimizer step, across all ranks."""
    micro_batch_size_per_device_for_update: c.Positive = 4
    """Samples per forward/backward; gradients accumulate over the rank's share of global_batch_size."""
    micro_batch_size_per_device_for_experience: c.Positive = 16
    """Samples per forward of the old and reference logprobs (no gradient)."""
    ppo_epochs: c.Positive = Field(1, description="Passes over the step's samples.")
    loss_mode: Literal["vanilla", "gspo"] = "vanilla"
    """vanilla: PPO's token-level ratio; gspo: GSPO's sequence-level ratio (no dual clip)."""
    clip_ratio_low: Annotated[c.Float, Field(ge=0, lt=1)] = 0.2
    """The ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]."""
    clip_ratio_high: c.NonNegativeFloat = Field(0.2, description="DAPO's clip-higher: high > low.")
    clip_ratio_dual: Annotated[c.Float, Field(gt=1)] | None = 3.0
    """Dual-clip PPO's c (null: off); loss_mode vanilla only."""
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How token losses become the loss (verl's modes; formulas in algorithm/loss.py)."""
    entropy_coef: c.NonNegativeFloat = Field(0.0, description="Entropy bonus weight.")
    max_grad_norm: c.PositiveFloat = 1.0
    """Gradient clipping by the global norm over all shards."""
    logprob_chunk_size: c.Positive = 1024
    """Tokens per chunk of the vocabulary-sized log-softmax (bounds its memory)."""
    padding_free: Auto = "auto"
    """Pack a micro-batch into one row. auto: everywhere (`flash_attn` on CUDA, else flex attention; Ascend's
    fused kernel; the CPU's per-length sdpa). docs/models.md: Attention and packing."""
    shared_prompt: Auto = "auto"
    """Each group's prompt and images once in the trainer's passes: P + nR tokens instead of n(P + R), same
    numbers (flex attention on CUDA). auto: on when packed, on the CPU and CUDA; off on Ascend (unchecked
    there); needs padding_free. docs/models.md: Shared prompts."""
    reuse_image_features: Auto = "auto"
    """Encode a prompt's images once for its samples (per step if frozen, else per forward-only pass).
    auto: on unless worker.rollout.limit_videos > 0."""
    dynamic_batching: c.Bool = False
    """Micro-batches by the token budgets below instead of counts (the same number on every rank)."""
    max_token_len_per_device_for_update: c.Positive = 16384
    """Token budget of an update micro-batch."""
    max_token_len_per_device_for_experience: c.Positive = 16384
    """Token budget of a forward-only micro-batch."""
    old_logprobs_from_update: Auto = "auto"
    """Old logprobs from the update's forward (detached), not their own pass. auto: when a step is exactly
    on-policy (one mini-batch and epoch, no algorithm.rollout_correction.rollout_rs)."""

    def __post_init__(self) -> None:
        c.require(
            not (self.shared_prompt is True and self.padding_free is False),
            "shared_prompt=true needs padding_free (the shared layout is a packed row)",
        )


@dataclass(config=c.SECTION)
class ValOverrideConfig:
    """Sampling for validation, instead of worker.rollout's."""

    temperature: c.NonNegativeFloat = Field(0.6, description="0: greedy.")
    top_p: c.TopP = Field(0.95, description="As worker.rollout.top_p.")
    top_k: c.TopK = Field(-1, description="As worker.rollout.top_k.")
    n: c.Positive = 1
    """Samples per validation prompt (the N of `val-core/<source>/acc/mean@N`, or `reward/`); 1 if greedy."""

    def __post_init__(self) -> None:
        c.require(
            self.temperature > 0 or self.n == 1,
            f"n must be 1 with temperature 0 (greedy: every sample would be the same), got {self.n}",
        )


@dataclass(config=c.SECTION)
class RolloutConfig:
    n: c.Positive = Field(8, description="Samples per prompt (the GRPO group size).")
    temperature: c.PositiveFloat = Field(1.0, description="The trainer's logprobs use the same temperature.")
    top_p: c.TopP = 1.0
    """Below 1 the trainer's logprobs are not truncated: `rollout/logprob_diff_*` includes the truncation."""
    top_k: c.TopK = Field(-1, description="-1 or 0: off (as vLLM).")
    tensor_parallel_size: c.Positive = 1
    """vLLM TP; consecutive ranks form a group and submit identical requests."""
    dtype: DType = "auto"
    """auto: bfloat16 on accelerators, float32 on CPU (exact parity with an fp32 trainer)."""
    gpu_memory_utilization: c.Float = Field(0.6, gt=0, le=1, description="vLLM's memory fraction.")
    enforce_eager: c.Bool = Field(True, description="Passed to vLLM (no CUDA graphs / compilation).")
    enable_sleep_mode: c.Bool = Field(True, description="vLLM's sleep mode between rollouts (none on CPU).")
    sleep_level: Literal[1, 2] = 2
    """2: release vLLM's weights and KV cache (all pushed again at wake); 1: weights kept in host memory."""
    max_num_batched_tokens: c.Positive = 16384
    """vLLM's scheduler budget; raised to `max_model_len` if smaller (chunked prefill is off)."""
    max_num_seqs: c.Positive = Field(256, description="vLLM's concurrent sequences.")
    limit_images: c.Positive = Field(1, description="Most images per prompt (vLLM's limit_mm_per_prompt).")
    limit_videos: c.NonNegative = 0
    """Most videos per prompt. 0: rows with a video are skipped at load and vLLM reserves nothing for video."""
    kv_cache_memory_gb: c.PositiveFloat = 1.0
    """CPU only: KV cache size (VLLM_CPU_KVCACHE_SPACE)."""
    weight_sync_bucket_mb: c.Positive = 512
    """Size of one bucket of the weight push (a decoder layer or vision block is never split)."""
    lora_sync: Literal["merged", "adapter"] = "merged"
    """With LoRA: `merged` pushes W + alpha / r * B A (any model); `adapter` the base once, then adapters
    (not for an MoE model on the CPU: vLLM's MoE LoRA layer needs Triton)."""
    ignore_eos: c.Bool = False
    """Training rollouts run to `data.max_response_length` (vLLM's `ignore_eos`): for benchmarks only."""
    val_override: ValOverrideConfig = field(default_factory=ValOverrideConfig)


@dataclass(config=c.SECTION)
class RefConfig:
    """The frozen reference model for the KL loss (built only with algorithm.use_kl_loss)."""

    dtype: DType = "auto"
    """auto: worker.actor.fsdp.param_dtype resolved (as an fp32 copy cast at the gather, half the memory)."""
    offload_params: c.Bool = False
    """Keep the reference's shards in host memory between its forwards (FSDP2 CPUOffloadPolicy)."""


def _reward_spec(spec: str) -> bool:
    path, sep, fn = spec.rpartition(":")
    return spec in c.BUILTIN_REWARDS or (bool(sep) and path.endswith(".py") and fn.isidentifier())


@dataclass(config=c.SECTION)
class RewardConfig:
    reward_function: Annotated[
        str,
        c.rule(_reward_spec, f"must be one of {', '.join(c.BUILTIN_REWARDS)} or path/to/file.py:function"),
    ] = "math"
    """`math` (geometry3k accuracy + format), `color` (the smoke task), or `path/file.py:fn` (README)."""
    format_weight: c.Fraction = 0.1
    """The built-in rewards' overall = (1 - format_weight) * accuracy + format_weight * format (EasyR1's)."""


@dataclass(config=c.SECTION)
class WorkerConfig:
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)

    def __post_init__(self) -> None:
        c.require(  # not FSDPConfig's: the reference's build reuses that section with its float16
            self.actor.fsdp.param_dtype != "float16",
            "actor.fsdp.param_dtype=float16 would train without loss scaling (not implemented): fp16 gradients "
            "underflow; use bfloat16 (worker.ref.dtype and worker.rollout.dtype may stay float16)",
        )
