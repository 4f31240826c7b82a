"""The `worker.*` sections of the config (EasyR1/verl names): the actor's model, optimizer and FSDP settings,
the rollout engine and its validation overrides, the reference model and the reward function. Each section
checks its own values in `check(prefix)`; rules across sections are in `validate.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from spmd_grpo.config.checks import (
    BUILTIN_REWARDS,
    check_model_path,
    check_reward_file,
    check_tokenizer_dir,
    require,
    require_at_least,
    require_positive,
    require_top_k,
)

LORA_ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters on the policy (PEFT's LoRA: y = W x + alpha / rank * B A x, B initialised to 0).

    rank 0 (the default) is full fine-tuning. With rank > 0 the base weights are frozen and held in the
    compute dtype, only the adapters train (fp32), and the KL reference is the policy with its adapters
    disabled (as verl; no second model)."""

    rank: int = 0
    """0: off (full fine-tuning). verl's `lora_rank`."""
    alpha: float = 16.0
    """The adapters' output is scaled by alpha / rank (PEFT's `lora_alpha`)."""
    dropout: float = 0.0
    """Dropout on the adapters' input (PEFT's `lora_dropout`); applied in every training-mode forward."""
    target_modules: str | tuple[str, ...] = LORA_ALL_LINEAR
    """`all-linear` (every nn.Linear but the output head, as PEFT) or module names: a name matches a module
    whose name is it or ends with `.<name>` (PEFT's rule), e.g. [q_proj, v_proj]."""
    exclude_modules: tuple[str, ...] = ("model.visual",)
    """Module-name prefixes (in-memory names) that get no adapter. Default: the vision tower with its
    merger; [] lets `target_modules` reach the tower too."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def check(self, prefix: str) -> None:
        require_at_least(self, prefix, 0, "rank")
        require_positive(self, prefix, "alpha")
        require(0 <= self.dropout < 1, f"{prefix}dropout must be in [0, 1), got {self.dropout}")
        targets = self.target_modules
        require(
            targets == LORA_ALL_LINEAR
            or (isinstance(targets, tuple) and bool(targets) and all(_module_name(t) for t in targets)),
            f"{prefix}target_modules must be {LORA_ALL_LINEAR!r} or a non-empty list of module names, "
            f"got {targets!r}",
        )
        bad = [e for e in self.exclude_modules if not _module_name(e)]
        require(not bad, f"{prefix}exclude_modules must hold module names (a.b.c), got {bad}")


def _module_name(name: str) -> bool:
    return bool(name) and all(part.isidentifier() or part.isdigit() for part in name.split("."))


@dataclass(frozen=True)
class ModelConfig:
    model_path: str = ""
    """Local directory or HF hub id of a checkpoint of a supported family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)."""
    tokenizer_path: str | None = None
    """Where the processor (tokenizer + image processor) comes from; None = model_path."""
    trust_remote_code: bool = False
    """Passed to transformers (config, processor) and to vLLM: allow code shipped with the checkpoint."""
    freeze_vision_tower: bool = False
    enable_gradient_checkpointing: bool = False
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def check(self, prefix: str) -> None:
        require(self.model_path != "", f"{prefix}model_path must be set (a local directory or HF id)")

    def check_files(self, prefix: str) -> None:
        check_model_path(f"{prefix}model_path", self.model_path)
        if self.tokenizer_path is not None:
            check_model_path(f"{prefix}tokenizer_path", self.tokenizer_path)
        source = "tokenizer_path" if self.tokenizer_path is not None else "model_path"
        check_tokenizer_dir(f"{prefix}{source}", getattr(self, source))


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 1e-2
    lr_warmup_steps: int = 0
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0

    def check(self, prefix: str) -> None:
        require_positive(self, prefix, "lr")
        require(
            all(0 <= b < 1 for b in self.betas),
            f"{prefix}betas must both be in [0, 1), got {list(self.betas)}",
        )
        require_at_least(self, prefix, 0, "weight_decay", "lr_warmup_steps")
        require(
            0 <= self.min_lr_ratio <= 1, f"{prefix}min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}"
        )


@dataclass(frozen=True)
class FSDPConfig:
    param_dtype: Literal["bfloat16", "float16", "float32", "auto"] = "auto"
    """auto: bfloat16 on accelerators, float32 on CPU."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    offload_params: bool = False
    """Keep the policy's shards (and gradients, optimizer step) in host memory (FSDP2 CPUOffloadPolicy)."""
    offload_optimizer: bool = False
    gather_once_per_pass: bool | Literal["auto"] = "auto"
    """Keep the gathered parameters through all micro-batches of a pass and reduce the gradient once per
    mini-batch instead of once per micro-batch (+ a gathered model and an unsharded gradient per rank at the
    peak). auto: on the CPU only, where memory is plentiful and every gloo gather and cast costs compute."""


@dataclass(frozen=True)
class ActorConfig:
    """The policy and its update; the reference model (worker.ref) is loaded from the same model_path."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    global_batch_size: int = 16
    """Samples (not prompts) per optimizer step, across all ranks."""
    micro_batch_size_per_device_for_update: int = 4
    """Samples per forward/backward; gradients accumulate over the rank's share of global_batch_size."""
    micro_batch_size_per_device_for_experience: int = 16
    """Samples per forward when computing the old and reference logprobs (no gradient)."""
    ppo_epochs: int = 1
    loss_mode: Literal["vanilla", "gspo"] = "vanilla"
    """vanilla: PPO's token-level ratio; gspo: GSPO's sequence-level ratio (no dual clip)."""
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    """The ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high] (DAPO's clip-higher: high > low)."""
    clip_ratio_dual: float | None = 3.0
    """Dual-clip PPO's c > 1 (null: off); used by loss_mode vanilla only."""
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = "token-mean"
    entropy_coef: float = 0.0
    max_grad_norm: float = 1.0
    logprob_chunk_size: int = 1024
    """Tokens per chunk of the vocabulary-sized log-softmax (bounds its memory)."""
    padding_free: bool | Literal["auto"] = "auto"
    """Pack each micro-batch's sequences into one row (no padding tokens). auto: on where the device has a
    varlen attention path (flash attention on CUDA with `flash_attn`, the fused kernel on Ascend, causal
    sdpa per sequence length on the CPU), off on CUDA without `flash_attn`, where true packs with a dense
    block-diagonal mask (correct, not faster)."""
    shared_prompt: bool | Literal["auto"] = "auto"
    """Hold each GRPO group's prompt (and its images and videos) once in the old-logprob, reference and
    update passes, followed by its responses, each attending to the prompt and causally to itself: the
    same logprobs and gradients, P + nR tokens per group instead of n(P + R). auto: on with the packed
    layout on the CPU (causal sdpa per length with a prompt prefix), off elsewhere (flash attention's varlen
    kernel cannot take a shared prefix) and for model families with linear-attention layers; true: on with
    any packed layout (the same sdpa path on accelerators); needs padding_free."""
    reuse_image_features: bool = True
    """With model.freeze_vision_tower: encode each prompt's images once per step, reused by all its samples
    and every trainer pass; ignored (images re-encoded in every forward) when the tower is trained, and
    when worker.rollout.limit_videos > 0 (transformers takes precomputed features for all modalities or none)."""
    dynamic_batching: bool = False
    """Micro-batches by token budget (the two keys below, prompt + response tokens per rank) instead of
    the micro_batch_size_* counts: balanced token sums, the same number of forwards on every rank."""
    max_token_len_per_device_for_update: int = 16384
    max_token_len_per_device_for_experience: int = 16384
    old_logprobs_from_update: bool = True
    """When a step is exactly on-policy (one mini-batch, one epoch, no rollout_rs), take the old logprobs
    detached from the update's forward instead of a separate forward-only pass."""

    def check(self, prefix: str) -> None:
        require_positive(
            self,
            prefix,
            "global_batch_size",
            "micro_batch_size_per_device_for_update",
            "micro_batch_size_per_device_for_experience",
            "ppo_epochs",
            "logprob_chunk_size",
            "max_token_len_per_device_for_update",
            "max_token_len_per_device_for_experience",
        )
        low, high, dual = self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_dual
        require(0 <= low < 1, f"{prefix}clip_ratio_low must be in [0, 1), got {low}")
        require(high >= 0, f"{prefix}clip_ratio_high must be >= 0, got {high}")
        require(dual is None or dual > 1, f"{prefix}clip_ratio_dual must be > 1 (or null), got {dual}")
        require_at_least(self, prefix, 0, "entropy_coef")
        require_positive(self, prefix, "max_grad_norm")
        require(
            not (self.shared_prompt is True and self.padding_free is False),
            f"{prefix}shared_prompt=true needs {prefix}padding_free (the shared layout is a packed row)",
        )


@dataclass(frozen=True)
class ValOverrideConfig:
    """Sampling for validation, instead of worker.rollout's."""

    temperature: float = 0.6
    """0: greedy."""
    top_p: float = 0.95
    top_k: int = -1
    n: int = 1

    def check(self, prefix: str) -> None:
        require_positive(self, prefix, "n")
        require_at_least(self, prefix, 0, "temperature")
        require(
            self.temperature > 0 or self.n == 1,
            f"{prefix}n must be 1 with temperature 0 (greedy: vLLM refuses n > 1), got {self.n}",
        )
        require(0 < self.top_p <= 1, f"{prefix}top_p must be in (0, 1], got {self.top_p}")
        require_top_k(prefix, self.top_k)


@dataclass(frozen=True)
class RolloutConfig:
    n: int = 8
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    tensor_parallel_size: int = 1
    dtype: Literal["bfloat16", "float16", "float32", "auto"] = "auto"
    """auto: bfloat16 on accelerators, float32 on CPU (exact parity with an fp32 trainer)."""
    gpu_memory_utilization: float = 0.6
    enforce_eager: bool = True
    enable_sleep_mode: bool = True
    """Ignored (one log line) on CPU, where vLLM has no sleep mode."""
    sleep_level: Literal[1, 2] = 2
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 256
    limit_images: int = 1
    """Most images per prompt (vLLM's limit_mm_per_prompt)."""
    limit_videos: int = 0
    """Most videos per prompt (vLLM's limit_mm_per_prompt). 0: rows with a video are skipped at load, and
    vLLM reserves nothing for video (it profiles memory with the largest allowed video at start-up)."""
    kv_cache_memory_gb: float = 1.0
    """CPU only: KV cache size (VLLM_CPU_KVCACHE_SPACE)."""
    weight_sync_bucket_mb: int = 512
    lora_sync: Literal["merged", "adapter"] = "merged"
    """With worker.actor.model.lora: `merged` pushes base + alpha / r * B A per adapted weight (any vLLM model);
    `adapter` pushes the base once, then only the adapters into vLLM's LoRA support (enable_lora)."""
    ignore_eos: bool = False
    """Training rollouts generate exactly `data.max_response_length` tokens, past the end-of-sequence and stop
    tokens (vLLM's `ignore_eos`, as verl's `rollout.ignore_eos`): a fixed workload for benchmarks and load
    tests, not for training. Validation keeps its stop tokens."""
    val_override: ValOverrideConfig = field(default_factory=ValOverrideConfig)

    def check(self, prefix: str) -> None:
        require_positive(
            self,
            prefix,
            "n",
            "tensor_parallel_size",
            "max_num_batched_tokens",
            "weight_sync_bucket_mb",
            "limit_images",
            "max_num_seqs",
            "kv_cache_memory_gb",
        )
        require_at_least(self, prefix, 0, "limit_videos")
        require(self.temperature > 0, f"{prefix}temperature must be > 0, got {self.temperature}")
        require(0 < self.top_p <= 1, f"{prefix}top_p must be in (0, 1], got {self.top_p}")
        require_top_k(prefix, self.top_k)
        require(
            0 < self.gpu_memory_utilization <= 1,
            f"{prefix}gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )


@dataclass(frozen=True)
class RefConfig:
    """The frozen reference model for the KL loss (built only with algorithm.use_kl_loss)."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The dtype the reference is held and run in; auto = worker.actor.fsdp.param_dtype resolved (bfloat16 on
    accelerators, float32 on CPU): the same numbers as an fp32 copy cast at the all-gather, at half the
    memory."""
    offload_params: bool = False
    """Keep the reference's shards in host memory between its forwards (FSDP2 CPUOffloadPolicy)."""


@dataclass(frozen=True)
class RewardConfig:
    reward_function: str = "math"
    """`math` (geometry3k accuracy + format), `color` (the smoke task), or `path/file.py:fn`."""
    format_weight: float = 0.1
    """The built-in rewards' overall = (1 - format_weight) * accuracy + format_weight * format (EasyR1's
    `r1v` / `math`); a `path/file.py:fn` reward computes its own `overall` and does not get it."""

    def check(self, prefix: str) -> None:
        require(
            0 <= self.format_weight <= 1, f"{prefix}format_weight must be in [0, 1], got {self.format_weight}"
        )
        spec, key = self.reward_function, f"{prefix}reward_function"
        path, sep, fn = spec.rpartition(":")
        require(
            spec in BUILTIN_REWARDS or (bool(sep) and path.endswith(".py") and fn.isidentifier()),
            f"{key} must be one of {', '.join(BUILTIN_REWARDS)} or path/to/file.py:function, got {spec!r}",
        )

    def check_files(self, prefix: str) -> None:
        if self.reward_function not in BUILTIN_REWARDS:
            check_reward_file(f"{prefix}reward_function", self.reward_function)


@dataclass(frozen=True)
class WorkerConfig:
    """EasyR1's worker roles: the trained policy, the vLLM rollout, the reference model, the reward."""

    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
