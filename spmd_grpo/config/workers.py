"""The `worker.*` sections of the config (EasyR1/verl names): the actor's model, optimizer and FSDP settings,
the rollout engine and its validation overrides, the reference model and the reward function. Types, ranges
and descriptions are on the fields; rules across sections are in `validate.py`.

`auto` settings (`fsdp.gather_once_per_pass`, `padding_free`, `reuse_image_features`,
`old_logprobs_from_update`) are speed and memory choices that leave the numbers unchanged: `auto` turns each
on wherever it applies (decided once, in `actor/spec.py` and the device layer); `true` where it cannot apply
is a config error saying why.
"""

from __future__ import annotations

from dataclasses import field
from typing import Annotated, Literal

from pydantic import AfterValidator, Field
from pydantic.dataclasses import dataclass

from spmd_grpo.config.checks import (
    BUILTIN_REWARDS,
    SECTION,
    Bool,
    Float,
    Fraction,
    NonNegative,
    NonNegativeFloat,
    Positive,
    PositiveFloat,
    Str,
    TopK,
    TopP,
    require,
)

LORA_ALL_LINEAR = "all-linear"
Auto = Bool | Literal["auto"]


def _module_name(name: str) -> str:
    require(
        bool(name) and all(part.isidentifier() or part.isdigit() for part in name.split(".")),
        f"{name!r} is not a module name (a.b.c)",
    )
    return name


ModuleNames = Annotated[tuple[Annotated[Str, AfterValidator(_module_name)], ...], Field(min_length=1)]


@dataclass(config=SECTION)
class LoRAConfig:
    """LoRA adapters on the policy (PEFT's LoRA: y = W x + alpha / rank * B A x, B initialised to 0).

    rank 0 (the default) is full fine-tuning. With rank > 0 the base weights are frozen and held in the
    compute dtype, only the adapters train (fp32), and the KL reference is the policy with its adapters
    disabled (as verl; no second model)."""

    rank: NonNegative = 0
    """0: off (full fine-tuning). verl's `lora_rank`."""
    alpha: PositiveFloat = 16.0
    """The adapters' output is scaled by alpha / rank (PEFT's `lora_alpha`)."""
    dropout: Annotated[Float, Field(ge=0, lt=1)] = 0.0
    """Dropout on the adapters' input (PEFT's `lora_dropout`); applied in every training-mode forward."""
    target_modules: Literal["all-linear"] | ModuleNames = LORA_ALL_LINEAR
    """`all-linear` (every nn.Linear but the output head, as PEFT) or module names: a name matches a module
    whose name is it or ends with `.<name>` (PEFT's rule), e.g. [q_proj, v_proj]."""
    exclude_modules: tuple[Annotated[Str, AfterValidator(_module_name)], ...] = ("model.visual",)
    """Module-name prefixes (in-memory names) that get no adapter. Default: the vision tower with its
    merger; [] lets `target_modules` reach the tower too."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass(config=SECTION)
class ModelConfig:
    model_path: Str = ""
    """Local directory or HF hub id of a checkpoint of a supported family (README: supported models)."""
    tokenizer_path: Str | None = None
    """Where the processor (tokenizer + image processor) comes from; None = model_path."""
    trust_remote_code: Bool = False
    """Passed to transformers (config, processor) and to vLLM: allow code shipped with the checkpoint."""
    freeze_vision_tower: Bool = False
    """The vision tower (with Qwen3-VL's DeepStack mergers and position embedding) gets no gradient and no optimizer
    state."""
    enable_gradient_checkpointing: Bool = False
    """Activation checkpointing of every language-model decoder layer."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)


Beta = Annotated[Float, Field(ge=0, lt=1)]


@dataclass(config=SECTION)
class OptimConfig:
    lr: PositiveFloat = 1e-6
    """AdamW learning rate."""
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    """AdamW betas. Two values, each in [0, 1)."""
    weight_decay: NonNegativeFloat = 1e-2
    lr_warmup_steps: NonNegative = 0
    """Linear warm-up steps."""
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    """After warm-up: constant, or cosine decay to `min_lr_ratio` x `lr` at the last step."""
    min_lr_ratio: Fraction = 0.0
    """In [0, 1]."""


@dataclass(config=SECTION)
class FSDPConfig:
    param_dtype: Literal["bfloat16", "float16", "float32", "auto"] = "auto"
    """auto: bfloat16 on accelerators, float32 on CPU."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Gradient reduction dtype."""
    offload_params: Bool = False
    """Keep the policy's shards (and gradients, optimizer step) in host memory (FSDP2 CPUOffloadPolicy)."""
    offload_optimizer: Bool = False
    """Keep the optimizer state in host memory (nothing to do on CPU)."""
    gather_once_per_pass: Auto = "auto"
    """Keep the gathered parameters through all micro-batches of a pass and reduce the gradient once per
    mini-batch instead of once per micro-batch (+ a gathered model and an unsharded gradient per rank at the
    peak). auto: on the CPU only, where memory is plentiful and every gloo gather and cast costs compute."""
    expert_parallel_size: Positive = 1
    """Expert parallelism of an MoE policy (1: off). EP ranks come out of the data-parallel ranks: each holds
    num_experts / EP experts, tokens reach them by all-to-all, and the expert weights are FSDP-sharded over
    the other world / EP ranks. Must divide the world size and the model's num_experts."""


@dataclass(config=SECTION)
class MoEConfig:
    """Mixture-of-experts controls (Qwen3-VL-MoE, Qwen3.5-MoE; ignored, with a warning, for a dense model)."""

    routing_replay: Literal["none", "old", "rollout"] = "none"
    """Which experts the trainer's passes use. none: each pass routes by its own top-k. old: the reference
    and the update use the experts chosen in the old-logprob pass (GSPO's routing replay), so the step-start
    importance ratio compares the same sub-network; the old-logprob pass then always runs separately. rollout:
    every trainer pass uses the experts vLLM chose (R3, arXiv 2510.11370; vLLM's
    `enable_return_routed_experts`, CUDA only). The router's probabilities of the used experts stay
    differentiable and are normalised as the model does. `moe/route_diff/<pass>` logs the fraction of the
    router's own top-k decisions that differ from the old pass's (or vLLM's) routes either way."""
    router_aux_loss_coef: NonNegativeFloat | None = None
    """Weight of the router's load-balancing loss (transformers' Switch-style aux loss) in the update. None:
    the model config's `router_aux_loss_coef` if its `output_router_logits` is true, else 0 (off: the RL
    default; the loss, when on, is logged as `actor/router_aux_loss`)."""


@dataclass(config=SECTION)
class ActorConfig:
    """The policy and its update; the reference model (worker.ref) is loaded from the same model_path."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    global_batch_size: Positive = 16
    """Samples (not prompts) per optimizer step, across all ranks."""
    micro_batch_size_per_device_for_update: Positive = 4
    """Samples per forward/backward; gradients accumulate over the rank's share of global_batch_size."""
    micro_batch_size_per_device_for_experience: Positive = 16
    """Samples per forward when computing the old and reference logprobs (no gradient)."""
    ppo_epochs: Positive = 1
    """Passes over the step's samples."""
    loss_mode: Literal["vanilla", "gspo"] = "vanilla"
    """vanilla: PPO's token-level ratio; gspo: GSPO's sequence-level ratio (no dual clip)."""
    clip_ratio_low: Annotated[Float, Field(ge=0, lt=1)] = 0.2
    """The ratio is clipped to [1 - low, 1 + high]. In [0, 1)."""
    clip_ratio_high: NonNegativeFloat = 0.2
    """The ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high] (DAPO's clip-higher: high > low)."""
    clip_ratio_dual: Annotated[Float, Field(gt=1)] | None = 3.0
    """Dual-clip PPO's c > 1 (null: off); used by loss_mode vanilla only."""
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = "token-mean"
    entropy_coef: NonNegativeFloat = 0.0
    """Entropy bonus weight."""
    max_grad_norm: PositiveFloat = 1.0
    """Gradient clipping by the global norm over all shards."""
    logprob_chunk_size: Positive = 1024
    """Tokens per chunk of the vocabulary-sized log-softmax (bounds its memory)."""
    padding_free: Auto = "auto"
    """Pack each micro-batch's sequences into one row (no padding tokens). auto: on where the device has a
    varlen attention path (flash attention on CUDA with `flash_attn`, the fused kernel on Ascend, causal
    sdpa per sequence length on the CPU), off on CUDA without `flash_attn`, where true packs with a dense
    block-diagonal mask (correct, not faster)."""
    shared_prompt: Auto = "auto"
    """Hold each GRPO group's prompt (and its images and videos) once in the old-logprob, reference and
    update passes, followed by its responses, each attending to the prompt and causally to itself: the
    same logprobs and gradients, P + nR tokens per group instead of n(P + R). auto: on with the packed
    layout on the CPU (causal sdpa per length with a prompt prefix), off elsewhere (flash attention's varlen
    kernel cannot take a shared prefix) and for model families with linear-attention layers; true: on with
    any packed layout (the same sdpa path on accelerators); needs padding_free."""
    reuse_image_features: Auto = "auto"
    """Encode each prompt's images once, reused by all its samples: once per step with a frozen tower (every
    trainer pass), once per forward-only pass with a trained one. auto: on unless videos are allowed
    (worker.rollout.limit_videos > 0: transformers takes precomputed features for all modalities or none,
    and true is then an error)."""
    dynamic_batching: Bool = False
    """Micro-batches by token budget (the two keys below, prompt + response tokens per rank) instead of
    the micro_batch_size_* counts: balanced token sums, the same number of forwards on every rank."""
    max_token_len_per_device_for_update: Positive = 16384
    """Token budget of an update micro-batch."""
    max_token_len_per_device_for_experience: Positive = 16384
    """Token budget of a forward-only micro-batch."""
    old_logprobs_from_update: Auto = "auto"
    """Take the old logprobs detached from the update's forward instead of a separate forward-only pass.
    auto: when a step is exactly on-policy (one mini-batch, one epoch, no algorithm.rollout_correction
    .rollout_rs); true elsewhere is an error."""

    def __post_init__(self) -> None:
        require(
            not (self.shared_prompt is True and self.padding_free is False),
            "shared_prompt=true needs padding_free (the shared layout is a packed row)",
        )


@dataclass(config=SECTION)
class ValOverrideConfig:
    """Sampling for validation, instead of worker.rollout's."""

    temperature: NonNegativeFloat = 0.6
    """0: greedy."""
    top_p: TopP = 0.95
    """In (0, 1]."""
    top_k: TopK = -1
    """As `worker.rollout.top_k`."""
    n: Positive = 1
    """Samples per validation prompt (the N of `val-core/<source>/acc/mean@N`). > 0; must be 1 with temperature
    0."""

    def __post_init__(self) -> None:
        require(
            self.temperature > 0 or self.n == 1,
            f"n must be 1 with temperature 0 (greedy: vLLM refuses n > 1), got {self.n}",
        )


@dataclass(config=SECTION)
class RolloutConfig:
    n: Positive = 8
    """Samples per prompt (the GRPO group size)."""
    temperature: PositiveFloat = 1.0
    """> 0. The trainer's logprobs use the same temperature."""
    top_p: TopP = 1.0
    """In (0, 1]. With `top_p` < 1 the trainer's logprobs are not truncated, so `rollout/logprob_diff_*` includes
    the truncation."""
    top_k: TopK = -1
    """-1 or 0: off; otherwise >= 1 (as vLLM)."""
    tensor_parallel_size: Positive = 1
    """vLLM TP; consecutive ranks form a group and submit identical requests. > 0; must divide the world size."""
    dtype: Literal["bfloat16", "float16", "float32", "auto"] = "auto"
    """auto: bfloat16 on accelerators, float32 on CPU (exact parity with an fp32 trainer)."""
    gpu_memory_utilization: Annotated[Float, Field(gt=0, le=1)] = 0.6
    """vLLM's memory fraction."""
    enforce_eager: Bool = True
    """Passed to vLLM (no CUDA graphs / compilation)."""
    enable_sleep_mode: Bool = True
    """Nothing to do on CPU, where vLLM has no sleep mode."""
    sleep_level: Literal[1, 2] = 2
    """2: release vLLM's weights and KV cache (every weight is pushed again at the next wake); 1: keep the weights
    in host memory (used on NPU)."""
    max_num_batched_tokens: Positive = 16384
    """vLLM's scheduler budget; raised to `max_model_len` if smaller (chunked prefill is off)."""
    max_num_seqs: Positive = 256
    """vLLM's concurrent sequences."""
    limit_images: Positive = 1
    """Most images per prompt (vLLM's limit_mm_per_prompt)."""
    limit_videos: NonNegative = 0
    """Most videos per prompt (vLLM's limit_mm_per_prompt). 0: rows with a video are skipped at load, and
    vLLM reserves nothing for video (it profiles memory with the largest allowed video at start-up)."""
    kv_cache_memory_gb: PositiveFloat = 1.0
    """CPU only: KV cache size (VLLM_CPU_KVCACHE_SPACE)."""
    weight_sync_bucket_mb: Positive = 512
    """Size of one bucket of the weight push (a decoder layer or vision block is never split)."""
    lora_sync: Literal["merged", "adapter"] = "merged"
    """With worker.actor.model.lora: `merged` pushes base + alpha / r * B A per adapted weight (any vLLM model);
    `adapter` pushes the base once, then only the adapters into vLLM's LoRA support (enable_lora)."""
    ignore_eos: Bool = False
    """Training rollouts generate exactly `data.max_response_length` tokens, past the end-of-sequence and stop
    tokens (vLLM's `ignore_eos`, as verl's `rollout.ignore_eos`): a fixed workload for benchmarks and load
    tests, not for training. Validation keeps its stop tokens."""
    val_override: ValOverrideConfig = field(default_factory=ValOverrideConfig)


@dataclass(config=SECTION)
class RefConfig:
    """The frozen reference model for the KL loss (built only with algorithm.use_kl_loss)."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The dtype the reference is held and run in; auto = worker.actor.fsdp.param_dtype resolved (bfloat16 on
    accelerators, float32 on CPU): the same numbers as an fp32 copy cast at the all-gather, at half the
    memory."""
    offload_params: Bool = False
    """Keep the reference's shards in host memory between its forwards (FSDP2 CPUOffloadPolicy)."""


def _reward_spec(spec: str) -> str:
    path, sep, fn = spec.rpartition(":")
    require(
        spec in BUILTIN_REWARDS or (bool(sep) and path.endswith(".py") and fn.isidentifier()),
        f"must be one of {', '.join(BUILTIN_REWARDS)} or path/to/file.py:function",
    )
    return spec


@dataclass(config=SECTION)
class RewardConfig:
    reward_function: Annotated[Str, AfterValidator(_reward_spec)] = "math"
    """`math` (geometry3k accuracy + format), `color` (the smoke task), or `path/file.py:fn` (README: your
    own reward function)."""
    format_weight: Fraction = 0.1
    """The built-in rewards' overall = (1 - format_weight) * accuracy + format_weight * format (EasyR1's
    `r1v` / `math`); a `path/file.py:fn` reward computes its own `overall` and does not get it."""


@dataclass(config=SECTION)
class WorkerConfig:
    """EasyR1's worker roles: the trained policy, the vLLM rollout, the reference model, the reward."""

    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
