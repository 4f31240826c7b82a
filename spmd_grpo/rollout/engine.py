"""The rollout half of the hybrid engine: one in-process vLLM `LLM` per rank, and the weight stream into it.
Where it sits in the training step: docs/architecture.md.

The engine never reads the checkpoint: it is built with `load_format="dummy"` (small random weights) and
receives every weight, frozen ones included, from the FSDP2 policy through the sharded weight stream at the
first `rollout_mode`, also after a resume. A third read of the model files per rank (policy, reference,
vLLM) would be overwritten at the first push anyway (for Qwen2.5-VL-32B: 67 GB x 8 ranks per node).

Every rank builds `LLM(distributed_executor_backend="external_launcher")` after the trainer's process group
exists; consecutive ranks form a tensor-parallel group (`worker.rollout.tensor_parallel_size`) and use the
same engine seed, so the ranks of a group sample identically (per-request seeds make it independent of
batching too).

The accelerator is time-shared: `rollout_mode(policy, version)` is the one way to use it for generation
(training steps and validation alike). On entry it moves what must leave the device (AdamW state with
`fsdp.offload_optimizer`), switches the CUDA allocator's expandable segments off (vLLM's sleep-mode allocator
owns memory now), then wakes vLLM in the order empty cache -> wake(weights) -> push the policy's weights if
the engine does not hold this version -> empty cache -> wake(kv_cache): waking everything at once could hold
old weights + new weights + KV cache together. On exit, also on an exception, it puts vLLM to sleep and
restores the allocator setting and the optimizer state. A new engine is put to sleep at once (verl and
EasyR1 do the same), so the first `rollout_mode` follows that order too and nothing of vLLM holds the device
before it. Sleep level 2 DISCARDS the weights, so after it the engine holds no version and the next
`rollout_mode` pushes every weight again (level 1 keeps them in host memory). On CPU vLLM has no sleep mode:
it is skipped with one log line and the weights stay.

Where the hand-over differs from verl's FSDP + vLLM hybrid engine: the policy's and the reference's shards
stay on the device while vLLM generates (verl's `param_offload` moves the policy's to host memory around the
rollout; `fsdp.offload_params` here keeps them in host memory throughout) and only the AdamW state can leave;
the device RNG is not swapped around the rollout (verl and EasyR1 keep one generation RNG state per TP group
for unseeded sampling; every request here carries its own seed). As in verl, each `rollout_mode` after a
level-2 sleep pushes the whole model, so a validation at the end of a step and every further DAPO generation
batch push a version the engine held before it slept (level 1 keeps it, at the cost of a host copy of the
weights per rank).

Weight sync (`iter_sharded_weights`): parameters are streamed in bounded buckets (grouped by layer, up to
`weight_sync_bucket_mb`), each FSDP2 local shard cast to the rollout dtype BEFORE it travels (half the
traffic of gathering fp32 masters), gathered per bucket straight into one receive buffer (in-place all-gather
on nccl/hccl, one broadcast per rank on gloo), yielding HF names. Live extra memory is about one bucket plus
vLLM's reload of one fused layer (its inputs, the fused weight and, on CPU, its new oneDNN pack: ~3 x the
largest fused parameter), never the model; on CPU the heap is trimmed after a push (vLLM-CPU repacks every
linear layer and glibc would keep the freed pages; measurements in docs/benchmarks.md).
`lm_head.weight` is yielded for tied models (vLLM otherwise keeps the old head). After a push the prefix,
multimodal and encoder caches are reset (stale image embeddings otherwise; vLLM also failed with "Encoder
cache miss" without the reset). A push is skipped when the engine already holds the policy's version, and
parameters that do not require grad (a frozen vision tower) are sent only when the engine holds no weights
of the policy at all: they never change. Except the frozen partners of a weight that is sent into one fused
vLLM layer (`k_proj` beside LoRA-adapted `q_proj`/`v_proj` in `qkv_proj`): vLLM rebuilds a reloaded fused
layer from empty memory, so they travel with it (`weight_sync.fused_partners`).

vLLM CPU (0.32) does not re-pack its unquantized fused-MoE experts when `reload_weights` reloads them:
`from_config` wraps those layers once, so that every push packs what it loads (`moe_reload.py`).

LoRA: `worker.rollout.lora_sync` merged pushes base + scale * B A (weight_sync.py); adapter pushes the base
once and then only the adapters under a new LoRA id each time (lora_sync.py).

Vision special tokens (`<|image_pad|>` etc.) can never be sampled: a logits processor sets them to -inf in
vLLM, and `models/policy.py` applies the same mask, so vLLM's `processed_logprobs` and the trainer's logprobs
describe the same distribution.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from spmd_grpo.config.schema import Config
from spmd_grpo.config.workers import LoRAConfig, RolloutConfig
from spmd_grpo.data.prompts import ProcessorSizes
from spmd_grpo.models.families import family_of
from spmd_grpo.models.lora import is_adapter_name, merge_sources
from spmd_grpo.models.weights import hf_name
from spmd_grpo.parallel.collectives import World
from spmd_grpo.parallel.devices import empty_cache, memory_line, resolve_dtype, set_expandable_segments
from spmd_grpo.rollout.lora_sync import AdapterSync, vllm_lora_kwargs
from spmd_grpo.rollout.moe_reload import repack_on_worker
from spmd_grpo.rollout.vllm_args import (
    host_side_image_normalisation,
    llm_kwargs,
    quiet_vllm,
    suppress_vision_tokens_processor,
    weight_push,
)
from spmd_grpo.rollout.weight_sync import CountingIterator, fused_partners, iter_sharded_weights

log = logging.getLogger(__name__)


NO_WEIGHTS = -1  # `EngineStats.synced_version` when the engine holds none of the policy's weights


@dataclass
class EngineStats:
    synced_version: int = NO_WEIGHTS
    num_syncs: int = 0
    last_sync_s: float = 0.0
    last_sync_bytes: int = 0


class RolloutEngine:
    """One vLLM engine per rank, driven in-process (no Ray, no server)."""

    adapters: AdapterSync | None = None  # lora_sync adapter: the pushes of the LoRA adapters

    def __init__(
        self,
        llm,
        cfg: RolloutConfig,
        world: World,
        *,
        dtype: torch.dtype,
        tie_word_embeddings: bool,
        adapter_lora: LoRAConfig | None = None,
    ) -> None:
        """Drive `llm`, this rank's `vllm.LLM` (`from_config` builds it), which holds none of the policy's
        weights yet (`load_format="dummy"`): the first `rollout_mode` pushes every weight. With sleep mode
        the engine is put to sleep here. `dtype`: the rollout dtype weights are cast to before they travel;
        `adapter_lora`: adapter-only LoRA pushes."""
        self.llm, self.cfg, self.world, self.dtype = llm, cfg, world, dtype
        self.tie_word_embeddings = tie_word_embeddings
        self.sleep_enabled = _sleep_mode(cfg, world)
        self.adapters = AdapterSync(adapter_lora) if adapter_lora else None
        # the tensors vLLM's loader reads (Qwen3-VL-MoE: transposed experts; Qwen3.5-MoE: one per expert)
        self.weight_layout = family_of(llm.llm_engine.model_config.hf_config).hub_tensors
        worker = llm.llm_engine.model_executor.driver_worker.worker
        if not hasattr(worker, "reload_weights"):  # vLLM's and vllm-ascend's workers have it
            raise RuntimeError(
                f"the vLLM worker {type(worker).__name__} has no reload_weights: it cannot take pushes"
            )
        # {fused vLLM module: the HF modules it stacks}: frozen weights fused with sent ones are sent too
        self.packed_modules = dict(getattr(worker.get_model(), "packed_modules_mapping", {}))
        self.stats = EngineStats()
        self.asleep = False
        # Asleep from the start, as verl and EasyR1 leave a new engine: its dummy weights and KV cache would
        # otherwise hold the device until the first `rollout_mode` (through the resume's optimizer-state
        # load), and that first push would run beside the whole KV cache instead of before it is allocated.
        self.sleep()

    @classmethod
    def from_config(
        cls, cfg: Config, world: World, *, tie_word_embeddings: bool, sizes: ProcessorSizes
    ) -> RolloutEngine:
        """Build this rank's `vllm.LLM` as a run's config describes it and drive it: the one way the trainer,
        the test jobs and the benchmarks build an engine, so what they test is the trainer's wiring of every
        setting. `sizes`: the run's processor sizes (`data.prompts.processor_sizes`), the ones the data
        loader and the trainer's processor calls use."""
        from vllm import LLM

        quiet_vllm()
        rollout, model = cfg.worker.rollout, cfg.worker.actor.model
        dtype = resolve_dtype(rollout.dtype, world.device_type)
        adapter_lora = model.lora if model.lora.enabled and rollout.lora_sync == "adapter" else None
        set_platform_environment(rollout, world.device_type)
        routes = {}
        if cfg.worker.actor.moe.routing_replay == "rollout":  # MoE: vLLM's Model Runner V2 returns the routes
            # (with prefix caching on and TP 1, which the config checks ensure). Its capture buffer is allocated
            # in the sleep allocator's "runtime" pool, which vLLM keeps in host memory at both sleep levels.
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
            routes = {"enable_return_routed_experts": True}
        llm = LLM(
            **llm_kwargs(
                model.model_path,
                rollout,
                trust_remote_code=model.trust_remote_code,
                max_model_len=cfg.max_model_len,
                mm_processor_kwargs=sizes.processor_kwargs(),
            ),
            seed=cfg.trainer.seed + world.rank // rollout.tensor_parallel_size,
            dtype=dtype,
            enable_sleep_mode=_sleep_mode(rollout, world),
            logits_processors=[suppress_vision_tokens_processor()],
            **host_side_image_normalisation(),
            **(vllm_lora_kwargs(adapter_lora) if adapter_lora else {}),
            **platform_llm_kwargs(world.device_type),
            **routes,
        )
        if world.device_type == "cpu":
            # vLLM CPU's fused-MoE layers must re-pack their experts at every push (moe_reload.py)
            llm.collective_rpc(repack_on_worker)
        return cls(
            llm,
            rollout,
            world,
            dtype=dtype,
            tie_word_embeddings=tie_word_embeddings,
            adapter_lora=adapter_lora,
        )

    def settings(self) -> dict:
        """What vLLM was built with, read back from the engine (for checks of the wiring)."""
        vc = self.llm.llm_engine.vllm_config
        return {
            "model": vc.model_config.model,
            "trust_remote_code": vc.model_config.trust_remote_code,
            "max_model_len": vc.model_config.max_model_len,
            "dtype": str(vc.model_config.dtype).removeprefix("torch."),
            "seed": vc.model_config.seed,
            "tensor_parallel_size": vc.parallel_config.tensor_parallel_size,
            "max_num_seqs": vc.scheduler_config.max_num_seqs,
            "limit_images": vc.model_config.multimodal_config.get_limit_per_prompt("image"),
            "limit_videos": vc.model_config.multimodal_config.get_limit_per_prompt("video"),
            "mm_processor_kwargs": vc.model_config.multimodal_config.mm_processor_kwargs,
        }

    # ----------------------------------------------------------------------------------- sleep / wake
    @contextmanager
    def rollout_mode(
        self, policy: nn.Module, version: int, *, optimizer=None, timer=None, log_memory: bool = False
    ) -> Iterator[None]:
        """The accelerator belongs to vLLM inside this block, holding `policy` at `version` (see the module
        docstring for the order). `optimizer`: its state leaves the device meanwhile (None: it stays).
        `timer` times the weight push as `update_weights`."""
        offload = optimizer is not None and self.world.device_type != "cpu"
        if offload:
            move_optimizer_state(optimizer, "cpu")
        set_expandable_segments(self.world.device_type, False)
        try:
            self._wake(["weights"])
            with timer("update_weights") if timer is not None else nullcontext():
                self.sync_weights(policy, version)
            self._wake(["kv_cache"])
            self.asleep = False
            if log_memory:
                log.info(memory_line(self.world.device_type, "wake + weight push"))
            yield
        finally:
            self.sleep()
            set_expandable_segments(self.world.device_type, True)
            if offload:
                move_optimizer_state(optimizer, None)  # back where its parameters are
            if log_memory:
                log.info(memory_line(self.world.device_type, "rollout + sleep"))

    def sleep(self) -> None:
        """Release weights (level 2) or offload them (level 1) and the KV cache until the next rollout."""
        if self.sleep_enabled and not self.asleep:
            self.llm.sleep(level=self.cfg.sleep_level)
            empty_cache(self.world.device_type)
            self.asleep = True
            if self.cfg.sleep_level == 2:  # the weights are gone: the next wake needs a full push
                self.stats.synced_version = NO_WEIGHTS

    def _wake(self, tags: list[str]) -> None:
        if self.sleep_enabled and self.asleep:
            empty_cache(self.world.device_type)
            self.llm.wake_up(tags=tags)

    # ------------------------------------------------------------------------------------ weight sync
    def sync_weights(self, policy: nn.Module, version: int) -> None:
        """Push `policy` (FSDP2-sharded; collective) unless the engine holds `version` already."""
        if version == self.stats.synced_version:
            return
        if self.adapters is not None and self.stats.synced_version != NO_WEIGHTS:  # the adapters alone
            start = time.perf_counter()
            self._record_sync(version, start, self.adapters.push(self.llm, policy, version))
            return
        # A parameter that does not require grad never changes: send it only to an engine without weights.
        frozen = set()
        if self.stats.synced_version != NO_WEIGHTS:  # (a LoRA-adapted base weight changes with its adapters)
            trains = {
                hf_name(n): p.requires_grad for n, p in policy.named_parameters() if not is_adapter_name(n)
            }
            frozen = {n for n, t in trains.items() if not t} - merge_sources(policy).keys()
            frozen -= fused_partners(frozen, trains.keys() - frozen, self.packed_modules)
        weights = iter_sharded_weights(
            policy,
            self.dtype,
            self.cfg.weight_sync_bucket_mb << 20,
            tie_word_embeddings=self.tie_word_embeddings,
            skip=frozen.__contains__,
            merge=self.adapters is None,
            layout=self.weight_layout,
        )
        self.load_weights(weights, version, partial=bool(frozen))
        if self.adapters is not None:  # the unmerged base is in: now its adapters, under a new LoRA id
            self.stats.last_sync_bytes += self.adapters.push(self.llm, policy, version)

    def load_weights(
        self, weights: Iterator[tuple[str, torch.Tensor]], version: int, *, partial: bool = False
    ) -> None:
        """Stream `(hf_name, full_tensor)` into the engine, then drop every cache derived from old weights.
        `partial`: frozen weights are left out (vLLM keeps them; its warnings for them are dropped)."""
        start = time.perf_counter()
        counted = CountingIterator(weights)
        with weight_push(partial=partial):
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": counted, "is_checkpoint_format": True}
            )
        self.reset_caches()
        if self.world.device_type == "cpu":
            # vLLM-CPU repacks every linear layer (oneDNN) at every push: a model-sized amount of 5-11 MiB
            # blocks is allocated at new heap addresses and the old packs are freed. glibc keeps those freed
            # pages resident, so without a trim RSS stays ~1 x the model higher after each push and the next
            # push adds its peak on top (docs/benchmarks.md). malloc_trim(0) hands the free pages back.
            _malloc_trim()
        self._record_sync(version, start, counted.num_bytes)

    def _record_sync(self, version: int, start: float, num_bytes: int) -> None:
        """The engine now holds `version`: a push that began at `start` (perf_counter) moved `num_bytes`."""
        self.stats.synced_version = version
        self.stats.num_syncs += 1
        self.stats.last_sync_s = time.perf_counter() - start
        self.stats.last_sync_bytes = num_bytes

    def reset_caches(self) -> None:
        self.llm.reset_prefix_cache()
        self.llm.reset_mm_cache()
        self.llm.llm_engine.reset_encoder_cache()

    def shutdown(self) -> None:
        """Tear the engine down while the trainer's process group still exists.

        vLLM's teardown (also run at interpreter exit if not called) destroys its own groups AND the default
        process group (`destroy_distributed_environment`); after the trainer destroyed the default group
        first it raised "Invalid process group specified". Call this last, before `collectives.destroy()`.
        """
        self.llm.llm_engine.engine_core.shutdown()
        if self.adapters is not None:
            self.adapters.close()

    def generate(self, prompts: list, sampling_params: list) -> list:
        lora = self.adapters.request if self.adapters is not None else None  # the current adapter's id
        return self.llm.generate(prompts, sampling_params, use_tqdm=False, lora_request=lora)

    def decode(self, token_ids: list[list[int]]) -> list[str]:
        """Each response's text, special tokens dropped: the tokenizer's decode of the whole sequence (the
        requests ask vLLM for no text; see `rollout.generate`)."""
        return self.llm.get_tokenizer().batch_decode(token_ids, skip_special_tokens=True)


def set_platform_environment(rollout: RolloutConfig, device_type: str) -> None:
    """The variables vLLM's platform reads when the engine is built. CPU: the KV cache size (its backend
    sizes the cache from VLLM_CPU_KVCACHE_SPACE, not from a memory fraction). Ascend: vllm-ascend's plain
    (ND) weight layout: its FRACTAL_NZ layout (VLLM_ASCEND_ENABLE_NZ, on by default for quantized weights)
    would not take the trainer's ND weights, and its `wake_up` refuses to run with NZ on."""
    if device_type == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(rollout.kv_cache_memory_gb))))
    if device_type == "npu":
        if os.environ.get("VLLM_ASCEND_ENABLE_NZ", "0") != "0":
            log.warning(
                "VLLM_ASCEND_ENABLE_NZ=%s set to 0: weight pushes are ND", os.environ["VLLM_ASCEND_ENABLE_NZ"]
            )
        os.environ["VLLM_ASCEND_ENABLE_NZ"] = "0"


def platform_llm_kwargs(device_type: str) -> dict:
    """`vllm.LLM` arguments for one platform's plugin. Ascend: `additional_config={"weight_nz_mode": 0}`,
    the plain (ND) weight layout as vllm-ascend's own setting. Its AscendConfig reads `weight_nz_mode` from
    additional_config first and falls back to VLLM_ASCEND_ENABLE_NZ only with a deprecation warning ("will be
    removed in the next release"), default 1; its `NPUWorker.wake_up` raises for any non-zero mode, so a
    release without the variable would fail at the first wake while the environment still said 0. Releases
    that predate the key ignore it (additional_config is read key by key). `set_platform_environment` still
    sets the variable for those.

    vllm-ascend's `additional_config.rl_config` is left off, a deliberate difference from its sleep-mode guide:
    its `enable_batch_invariant` registers batch-invariant kernels over aten ops and turns on
    `torch.use_deterministic_algorithms` and HCCL_DETERMINISTIC=strict, all process-wide, and the engine
    lives in the trainer's process, so the trainer's kernels would change with it; `sleep_mode_extra_cleanup`
    destroys and rebuilds vLLM's HCCL groups at every sleep and wake (less memory asleep, slower wake);
    `enable_training_consistency` selects an FA3 backend that needs the separate `flash_attn_npu_v3`
    package; `enabled` alone would set weight_nz_mode 0 (done here) and drop expandable_segments from
    PYTORCH_NPU_ALLOC_CONF while the trainer's allocator keeps the option it started with (refused at
    start-up instead: `devices.sleep_mode_allocator_error`)."""
    return {"additional_config": {"weight_nz_mode": 0}} if device_type == "npu" else {}


def _sleep_mode(cfg: RolloutConfig, world: World) -> bool:
    return cfg.enable_sleep_mode and world.device_type != "cpu"  # vLLM has none on CPU


@functools.cache
def _libc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where libc has none (e.g. musl)."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def _malloc_trim() -> None:
    """`malloc_trim(0)`: give the heap's free pages back to the OS (a no-op without glibc)."""
    fn = _libc_malloc_trim()
    if fn is not None:
        fn(0)


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str | None) -> None:
    """Move AdamW's state tensors (exp_avg, exp_avg_sq; DTensor shards too) to `device`, in place; None: back
    to each parameter's own device.

    With `worker.actor.fsdp.offload_optimizer` the state lives on the CPU while vLLM is awake and comes back
    for the update: the states are 2x the fp32 parameter shard, the largest training-only allocation. It
    comes back to its parameter's device, not the accelerator: with `fsdp.offload_params` too the shards and
    so the state stay in host memory (verl turns its optimizer offload off under FSDP2's offload policy).
    """
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(param.device if device is None else device, non_blocking=True)
