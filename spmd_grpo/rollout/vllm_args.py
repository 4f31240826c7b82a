"""How a vLLM engine is configured: the `vllm.LLM` arguments that come from the config, the processor sizes it
shares with the trainer, the logits processor that makes vision tokens unsamplable, host-side image
normalisation, and the filters for vLLM's log noise. `engine.RolloutEngine` is the one place that builds an
engine from them; the bare-limit benchmark builds a plain `vllm.LLM` from the same arguments.

Unlike verl and EasyR1, which always pass `disable_custom_all_reduce=True`, vLLM's custom all-reduce keeps
its default (used for TP > 1 on NVLink). It registers CUDA-graph buffers through CUDA IPC, which needs
`cudaMalloc` memory (vLLM 0.32 copies the graph buffers its sleep-mode pool holds instead): graphs captured
(`enforce_eager` false) with TP > 1 while PYTORCH_CUDA_ALLOC_CONF has `expandable_segments:True` at engine
build are where it can fail. Not run on a GPU.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from spmd_grpo.config.workers import RolloutConfig
from spmd_grpo.models.families import family_of_model_path
from spmd_grpo.models.policy import unsamplable_token_ids


def suppress_vision_tokens_processor():
    """The logits processor class that sets the vision special tokens' logits to -inf for every request.

    vLLM 0.32 has two model runners with two logits-processor interfaces, and which one runs is vLLM's
    choice at engine build: V1 (the CPU build; CUDA with VLLM_USE_V2_MODEL_RUNNER=0) builds a processor with
    (vllm_config, device, is_pin_memory) and calls apply(logits); V2 (the CUDA default, and the runner that
    returns routed experts) builds it with (vllm_config, req_states), calls apply(logits, ctx), and refuses at
    engine build a class that does not derive from its own base. One class derives from both."""
    from vllm.v1.sample.logits_processor import LogitsProcessor
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as RunnerV2LogitsProcessor

    class SuppressVisionTokens(LogitsProcessor, RunnerV2LogitsProcessor):
        def __init__(self, vllm_config, device_or_req_states, is_pin_memory: bool = False) -> None:
            device = getattr(device_or_req_states, "device", device_or_req_states)  # V2: the request states
            ids = unsamplable_token_ids(vllm_config.model_config.hf_config)
            self.ids = torch.tensor(ids, dtype=torch.long, device=device)

        def is_argmax_invariant(self) -> bool:  # V1
            return False

        def update_state(self, batch_update) -> None:  # V1
            pass

        def add_request(self, req_idx: int, sampling_params) -> bool:  # V2: every request is processed
            return True

        def apply(self, logits: torch.Tensor, ctx=None) -> torch.Tensor:  # V2 passes the batch layout
            logits.index_fill_(1, self.ids, float("-inf"))
            return logits

    return SuppressVisionTokens


class _DropVllmNoise(logging.Filter):
    """Drops vLLM warnings that are about vLLM's own internals or a push's known gaps, not this run, and
    would flood the console.

    * "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it." vLLM's CPU
      worker replaces `torch.set_num_threads` with a stub that logs this (the OpenMP threads are already
      bound to cores), and vLLM's multimodal renderer calls `torch.set_num_threads` twice around every
      request's image processing. With the engine in the trainer's process every request hits the stub: a
      smoke run logged ~120,000 of these. The calls are meant to be skipped, nothing is lost.
    * "<X>RotaryEmbedding: Failed to load weights", at every weight push. A rotary layer's only tensor is
      `cos_sin_cache`, a non-persistent buffer computed from the config, never part of a checkpoint or a
      push; vLLM's layerwise reload then puts the existing cache back (its fallback right after the warning).
    * "<X>: Failed to load weights" during a PARTIAL push (`weight_push(partial=True)`: the frozen weights
      are left out after the first push, e.g. every norm, embedding and the vision tower with LoRA adapters
      merged, or a frozen vision tower) for a layer class none of whose layers failed in this engine's
      full pushes: a layer that loaded when everything was pushed and gets nothing now got nothing because
      its weights were left out on purpose (a push sends the same names, a subset of a full push's), and
      vLLM keeps its tensors, which are the frozen ones. A class that failed in a full push keeps its
      warnings in every push: a real missing weight always shows.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith("CPU backend doesn't allow to use `torch.set_num_threads`"):
            return False
        if message != "%s: Failed to load weights" or not record.args:
            return True
        layer = str(record.args[0])
        if layer.endswith("RotaryEmbedding"):
            return False
        if not _PUSH.partial:
            _PUSH.failed_in_full_push.add(layer)
            return True
        return layer in _PUSH.failed_in_full_push


class _PushState:
    """What `_DropVllmNoise` knows of the weight push under way (one engine per process)."""

    partial = False
    failed_in_full_push: set[str] = set()  # noqa: RUF012 - process-wide by design


_PUSH = _PushState()


@contextmanager
def weight_push(*, partial: bool) -> Iterator[None]:
    """Mark vLLM's logging during a weight push: `partial` when frozen weights are left out of it."""
    _PUSH.partial = partial
    try:
        yield
    finally:
        _PUSH.partial = False


def quiet_vllm() -> None:
    """Install `_DropVllmNoise` on the two vLLM loggers, and ignore the FutureWarning about
    `torch.distributed.reduce_op` that vLLM's kernel registration raises by probing every module attribute
    (vLLM's scan, not a call of ours). Idempotent."""
    for name in ("vllm.v1.worker.cpu_worker", "vllm.model_executor.model_loader.reload.layerwise"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropVllmNoise) for f in logger.filters):
            logger.addFilter(_DropVllmNoise())
    warnings.filterwarnings("ignore", r"`torch\.distributed\.reduce_op` is deprecated", FutureWarning)


def host_side_image_normalisation() -> dict:
    """`mm_device_do_normalize=False` where vLLM has the option (0.32): its device-side image normalisation
    keeps the processor's mean/std in persistent buffers (`FusedMMInputNorm`) that are not in the checkpoint,
    so the dummy loader leaves them random and no weight push restores them (measured: per-token logprob
    errors of 0.14 against the trainer after a full push). Normalising on the host, as vLLM did before,
    has no such buffer. Costs host CPU time per image, nothing on the device."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    options = {f.name for f in dataclasses.fields(EngineArgs)}
    return {"mm_device_do_normalize": False} if "mm_device_do_normalize" in options else {}


def _hybrid_cache_kwargs(model_path: str) -> dict:
    """No prefix caching for a model with linear-attention layers (Qwen3.5): vLLM caches such a model's
    prefixes only with chunked prefill (its 'align' state cache), which the engine keeps off (seeded requests
    crash a partial prefill on the CPU). The n samples of a prompt then each prefill the prompt."""
    family = family_of_model_path(model_path)
    return {"enable_prefix_caching": False} if family and family.linear_attention else {}


def llm_kwargs(
    model_path: str,
    cfg: RolloutConfig,
    *,
    trust_remote_code: bool,
    max_model_len: int,
    mm_processor_kwargs: dict,
) -> dict:
    """The `vllm.LLM` arguments that come from the config alone (the engine adds the rank's seed, the dtype,
    sleep mode and the logits processor). `mm_processor_kwargs`: the run's processor sizes
    (`data.prompts.ProcessorSizes.processor_kwargs`), the ones the trainer's processor calls get."""
    # Seeded requests + chunked prefill crash on CPU ("CPU Generator does not use offset"); with chunked
    # prefill off, one scheduler step must hold the largest prompt.
    return dict(
        **_hybrid_cache_kwargs(model_path),
        model=model_path,
        trust_remote_code=trust_remote_code,  # worker.actor.model.trust_remote_code, as transformers gets it
        distributed_executor_backend="external_launcher",
        tensor_parallel_size=cfg.tensor_parallel_size,
        enforce_eager=cfg.enforce_eager,
        load_format="dummy",  # the weights come from the policy (first `rollout_mode`), not from disk
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        max_model_len=max_model_len,
        max_num_batched_tokens=max(cfg.max_num_batched_tokens, max_model_len),
        max_num_seqs=cfg.max_num_seqs,
        enable_chunked_prefill=False,
        limit_mm_per_prompt={"image": cfg.limit_images, "video": cfg.limit_videos},
        mm_processor_kwargs=mm_processor_kwargs,
        logprobs_mode="processed_logprobs",
    )
