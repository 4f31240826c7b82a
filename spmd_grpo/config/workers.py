"""The `worker.*` sections (EasyR1/verl names): the actor's model, optimizer, FSDP and MoE settings, the
rollout engine and its validation overrides, the reference model and the reward function.

`auto` settings (`fsdp.gather_once_per_pass`, `padding_free`, `shared_prompt`, `reuse_image_features`,
`old_logprobs_from_update`) are speed and memory choices that leave the numbers unchanged: `auto` turns each
on wherever it applies (decided once, in `actor/spec.py`, `models/build.py` and the device layer); `true`
where it cannot apply is a config error saying why.
"""

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
    """LoRA adapters on the policy (PEFT's: y = W x + alpha / rank * B A x, B initialised to 0). The base
    weights are frozen in the compute dtype, the adapters train in fp32, and the KL reference is the policy
    with its adapters disabled (as verl; no second model)."""

    rank: c.NonNegative = 0
    """0: off (full fine-tuning). verl's `lora_rank`."""
    alpha: c.PositiveFloat = 16.0
    """The adapters' output is scaled by alpha / rank (PEFT's `lora_alpha`)."""
    dropout: Annotated[c.Float, Field(ge=0, lt=1)] = 0.0
    """Dropout on the adapters' input in every training-mode forward (PEFT's `lora_dropout`)."""
    target_modules: Literal["all-linear"] | Annotated[tuple[ModuleName, ...], Field(min_length=1)] = (
        LORA_ALL_LINEAR
    )
    """`all-linear` (every nn.Linear but the output head, as PEFT) or names, each matching a module whose name
    is it or ends with `.<name>` (PEFT's rule), e.g. [q_proj, v_proj]."""
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
    lr: c.PositiveFloat = 1e-6
    """AdamW learning rate."""
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: c.NonNegativeFloat = 1e-2
    """AdamW weight decay (decoupled)."""
    lr_warmup_steps: c.NonNegative = 0
    """Linear warm-up steps."""
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    """After warm-up: constant, or cosine decay to `min_lr_ratio` x `lr` at the last step."""
    min_lr_ratio: c.Fraction = 0.0
    """The cosine schedule's floor, as a fraction of `lr`."""


@dataclass(config=c.SECTION)
class FSDPConfig:
    param_dtype: DType = "auto"
    """auto: bfloat16 on accelerators, float32 on CPU. float16 is refused (worker.ref and worker.rollout take
    it): there is no loss scaling, without which fp16 gradients underflow (torchtitan refuses it too)."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Gradient reduction dtype."""
    offload_params: c.Bool = False
    """Keep the policy's shards, gradients and optimizer step in host memory (FSDP2 CPUOffloadPolicy)."""
    offload_optimizer: c.Bool = False
    """Keep the optimizer state in host memory (nothing to do on CPU)."""
    gather_once_per_pass: Auto = "auto"
    """Keep the gathered parameters through a pass's micro-batches and reduce the gradient once per mini-batch
    (+ a gathered model and an unsharded gradient per rank). auto: on the CPU, where each gloo gather costs."""
    expert_parallel_size: c.Positive = 1
    """Expert parallelism of an MoE policy (1: off), out of the data-parallel ranks: each EP rank holds
    num_experts / EP experts (reached by all-to-all), FSDP-sharded over the other world / EP ranks."""


@dataclass(config=c.SECTION)
class MoEConfig:
    """Mixture-of-experts controls (Qwen3-VL-MoE, Qwen3.5-MoE; ignored, with a warning, for a dense model)."""

    routing_replay: Literal["none", "old", "rollout"] = "none"
    """The experts the trainer's passes use. none: each pass routes by its own top-k; old: the reference and
    the update use those of the old-logprob pass (GSPO's routing replay: the step-start ratio compares one
    sub-network); rollout: those vLLM chose (R3, arXiv 2510.11370; CUDA only, with
    worker.rollout.tensor_parallel_size 1, not for Qwen3.5-MoE: vLLM 0.32 returns them from a TP group's
    first rank only, and only with prefix caching, which the engine keeps off for linear attention). The
    used experts' router probabilities stay differentiable; `moe/route_diff/<pass>` logs the fraction of
    decisions that differ."""
    router_aux_loss_coef: c.NonNegativeFloat | None = None
    """Weight of the router's load-balancing loss (`actor/router_aux_loss`). None: the model config's
    `router_aux_loss_coef` if its `output_router_logits` is true, else 0 (the RL default)."""


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
    ppo_epochs: c.Positive = 1
    """Passes over the step's samples."""
    loss_mode: Literal["vanilla", "gspo"] = "vanilla"
    """vanilla: PPO's token-level ratio; gspo: GSPO's sequence-level ratio (no dual clip)."""
    clip_ratio_low: Annotated[c.Float, Field(ge=0, lt=1)] = 0.2
    """The ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]."""
    clip_ratio_high: c.NonNegativeFloat = 0.2
    """DAPO's clip-higher: high > low."""
    clip_ratio_dual: Annotated[c.Float, Field(gt=1)] | None = 3.0
    """Dual-clip PPO's c (null: off); loss_mode vanilla only."""
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How token losses become the loss (verl's modes; formulas in algorithm/loss.py)."""
    entropy_coef: c.NonNegativeFloat = 0.0
    """Entropy bonus weight."""
    max_grad_norm: c.PositiveFloat = 1.0
    """Gradient clipping by the global norm over all shards."""
    logprob_chunk_size: c.Positive = 1024
    """Tokens per chunk of the vocabulary-sized log-softmax (bounds its memory)."""
    padding_free: Auto = "auto"
    """Pack each micro-batch's sequences into one row. auto: on where the device has a varlen attention path
    (flash attention with `flash_attn`, Ascend's fused kernel, per-length sdpa on the CPU); on CUDA without
    `flash_attn` true packs with a dense block-diagonal mask (correct, not faster)."""
    shared_prompt: Auto = "auto"
    """Hold each group's prompt (and its images and videos) once in the old, reference and update passes,
    its responses attending to it and causally to themselves: the same numbers for P + nR tokens instead of
    n(P + R), for every family (MoE routes follow the shared row; a hybrid's linear-attention state after the
    prompt seeds each response). auto: on with the packed layout on the CPU, off on accelerators (flash
    attention's varlen kernel takes no shared prefix; the flex-attention kernel that does is unchecked on a
    GPU); true: flex attention with a block mask on CUDA, the CPU's sdpa path elsewhere; needs padding_free."""
    reuse_image_features: Auto = "auto"
    """Encode each prompt's images once for all its samples: once per step with a frozen tower, once per
    forward-only pass with a trained one. auto: on unless worker.rollout.limit_videos > 0."""
    dynamic_batching: c.Bool = False
    """Micro-batches by the token budgets below (prompt + response tokens per rank) instead of the counts:
    balanced token sums, the same number of forwards on every rank."""
    max_token_len_per_device_for_update: c.Positive = 16384
    """Token budget of an update micro-batch."""
    max_token_len_per_device_for_experience: c.Positive = 16384
    """Token budget of a forward-only micro-batch."""
    old_logprobs_from_update: Auto = "auto"
    """Take the old logprobs from the update's forward (detached) instead of a forward-only pass. auto: when a
    step is exactly on-policy (one mini-batch and epoch, no algorithm.rollout_correction.rollout_rs)."""

    def __post_init__(self) -> None:
        c.require(
            not (self.shared_prompt is True and self.padding_free is False),
            "shared_prompt=true needs padding_free (the shared layout is a packed row)",
        )


@dataclass(config=c.SECTION)
class ValOverrideConfig:
    """Sampling for validation, instead of worker.rollout's."""

    temperature: c.NonNegativeFloat = 0.6
    """0: greedy."""
    top_p: c.TopP = 0.95
    """As worker.rollout.top_p."""
    top_k: c.TopK = -1
    """As worker.rollout.top_k."""
    n: c.Positive = 1
    """Samples per validation prompt (the N of `val-core/<source>/acc/mean@N`); 1 with temperature 0."""

    def __post_init__(self) -> None:
        c.require(
            self.temperature > 0 or self.n == 1,
            f"n must be 1 with temperature 0 (greedy: vLLM refuses n > 1), got {self.n}",
        )


@dataclass(config=c.SECTION)
class RolloutConfig:
    n: c.Positive = 8
    """Samples per prompt (the GRPO group size)."""
    temperature: c.PositiveFloat = 1.0
    """The trainer's logprobs use the same temperature."""
    top_p: c.TopP = 1.0
    """Below 1 the trainer's logprobs are not truncated: `rollout/logprob_diff_*` includes the truncation."""
    top_k: c.TopK = -1
    """-1 or 0: off (as vLLM)."""
    tensor_parallel_size: c.Positive = 1
    """vLLM TP; consecutive ranks form a group and submit identical requests."""
    dtype: DType = "auto"
    """auto: bfloat16 on accelerators, float32 on CPU (exact parity with an fp32 trainer)."""
    gpu_memory_utilization: Annotated[c.Float, Field(gt=0, le=1)] = 0.6
    """vLLM's memory fraction."""
    enforce_eager: c.Bool = True
    """Passed to vLLM (no CUDA graphs / compilation)."""
    enable_sleep_mode: c.Bool = True
    """vLLM's sleep mode between rollouts (none on CPU)."""
    sleep_level: Literal[1, 2] = 2
    """2: release vLLM's weights and KV cache (all weights pushed again at wake); 1: keep weights in host memory."""
    max_num_batched_tokens: c.Positive = 16384
    """vLLM's scheduler budget; raised to `max_model_len` if smaller (chunked prefill is off)."""
    max_num_seqs: c.Positive = 256
    """vLLM's concurrent sequences."""
    limit_images: c.Positive = 1
    """Most images per prompt (vLLM's limit_mm_per_prompt)."""
    limit_videos: c.NonNegative = 0
    """Most videos per prompt. 0: rows with a video are skipped at load and vLLM reserves nothing for video."""
    kv_cache_memory_gb: c.PositiveFloat = 1.0
    """CPU only: KV cache size (VLLM_CPU_KVCACHE_SPACE)."""
    weight_sync_bucket_mb: c.Positive = 512
    """Size of one bucket of the weight push (a decoder layer or vision block is never split)."""
    lora_sync: Literal["merged", "adapter"] = "merged"
    """With LoRA: `merged` pushes base + alpha / r * B A per adapted weight (any vLLM model); `adapter` pushes
    the base once, then only the adapters into vLLM's LoRA support."""
    ignore_eos: c.Bool = False
    """Training rollouts generate exactly `data.max_response_length` tokens (vLLM's `ignore_eos`, as verl's): a
    fixed workload for benchmarks, not for training. Validation keeps its stop tokens."""
    val_override: ValOverrideConfig = field(default_factory=ValOverrideConfig)


@dataclass(config=c.SECTION)
class RefConfig:
    """The frozen reference model for the KL loss (built only with algorithm.use_kl_loss)."""

    dtype: DType = "auto"
    """The reference's dtype; auto: worker.actor.fsdp.param_dtype resolved (the numbers of an fp32 copy cast
    at the all-gather, at half the memory)."""
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
        # Here and not in FSDPConfig: the reference's build reuses that section with worker.ref.dtype.
        c.require(
            self.actor.fsdp.param_dtype != "float16",
            "actor.fsdp.param_dtype=float16 would train without loss scaling, which this trainer does not "
            "implement: fp16 gradients underflow (the log-softmax's gradient to every vocabulary entry but the "
            "sampled one is below fp16's smallest subnormal); use bfloat16 (worker.ref.dtype and "
            "worker.rollout.dtype may stay float16)",
        )
