"""The device layer: which accelerator this process uses (cuda / npu / cpu) and everything device-specific.

`auto` picks npu when `torch_npu` imports and reports a device, else cuda when available, else cpu. The
default process group gets a host backend as well (`cpu:gloo,cuda:nccl` / `cpu:gloo,npu:hccl`; gloo on cpu)
so small bookkeeping collectives reduce CPU tensors without a device copy. Memory statistics, cache emptying,
`expandable_segments`, HCCL's execution timeout, synchronisation and seeding go through here; nothing else
spells a device name. A dtype of `auto` is bfloat16 on accelerators and float32 on the CPU (`resolve_dtype`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import random
from collections.abc import Mapping
from types import ModuleType

import numpy as np
import torch

BACKENDS = {"cuda": "cpu:gloo,cuda:nccl", "npu": "cpu:gloo,npu:hccl", "cpu": "gloo"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(name: str, device_type: str) -> torch.dtype:
    """A config's dtype name; `auto` is bfloat16 on accelerators and float32 on CPU."""
    if name == "auto":
        return torch.float32 if device_type == "cpu" else torch.bfloat16
    return DTYPES[name]


def _import_torch_npu() -> ModuleType | None:
    try:
        return importlib.import_module("torch_npu")
    except ImportError:
        return None


def _npu_available() -> bool:
    """True when torch_npu imports (which registers `torch.npu`) and sees at least one NPU."""
    return _import_torch_npu() is not None and hasattr(torch, "npu") and torch.npu.is_available()


def resolve_device_type(requested: str = "auto") -> str:
    """`auto` | `cuda` | `npu` | `cpu` -> a concrete device type, checking that it exists."""
    if requested == "auto":
        if _npu_available():
            return "npu"
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "npu":
        if _import_torch_npu() is None:
            raise RuntimeError(
                "trainer.device=npu but torch_npu cannot be imported (install torch_npu for your CANN "
                "release and source CANN's set_env.sh)"
            )
        if not _npu_available():
            raise RuntimeError("trainer.device=npu but torch.npu.is_available() is False (no NPU visible)")
        return "npu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but torch.cuda.is_available() is False")
    if requested not in BACKENDS:
        raise RuntimeError(f"unknown device {requested!r}; expected auto, cuda, npu or cpu")
    return requested


def device_module(device_type: str) -> ModuleType | None:
    """torch.cuda / torch.npu (registered by torch_npu), or None for cpu."""
    if device_type == "npu":
        if not hasattr(torch, "npu"):
            raise RuntimeError("device npu but torch.npu does not exist: import torch_npu first")
        return torch.npu
    return {"cuda": torch.cuda}.get(device_type)


def seed_everything(seed: int) -> None:
    """Same seed on every call site; callers add the rank where streams must differ per rank."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def empty_cache(device_type: str) -> None:
    mod = device_module(device_type)
    if mod is not None:
        mod.empty_cache()


def set_expandable_segments(device_type: str, enabled: bool) -> None:
    """CUDA allocator: expandable segments help training (less fragmentation) but must be off while vLLM's
    sleep-mode allocator owns memory (older vLLM asserted on it). No-op elsewhere.

    Only that one option changes: torch parses an allocator setting string as a whole and resets every
    option it does not name, so writing `expandable_segments:X` alone would silently drop the user's
    `max_split_size_mb`, `garbage_collection_threshold` or `roundup_power2_divisions` (from
    PYTORCH_CUDA_ALLOC_CONF) at the first rollout. The current string is read back and rewritten with the
    option replaced, as vLLM does around its own pool."""
    if device_type == "cuda":
        options = allocator_options(torch._C._accelerator_getAllocatorSettings())
        options.pop("expandable_segments", None)
        options["expandable_segments"] = str(enabled)
        torch._C._accelerator_setAllocatorSettings(",".join(f"{k}:{v}" for k, v in options.items()))


def allocator_options(setting: str) -> dict[str, str]:
    """A PYTORCH_*_ALLOC_CONF-style settings string (`key:value,key:value`) as {key: value}, in order."""
    return {f.split(":")[0].strip(): f.partition(":")[2].strip() for f in setting.split(",") if f.strip()}


def sleep_mode_allocator_error(device_type: str, environ: Mapping[str, str]) -> str | None:
    """Why vLLM's sleep mode cannot start under this process's allocator settings, or None.

    Ascend: vllm-ascend's sleep-mode pool (`CaMemAllocator`, built with the engine) asserts that
    PYTORCH_NPU_ALLOC_CONF does not contain `expandable_segments:True` (a memory pool cannot live beside
    expandable segments). The assertion reads the variable itself, not the live allocator, so unlike CUDA
    (`set_expandable_segments`, a run-time switch around the rollout) the option must be absent from the
    environment from the start (the NPU template leaves it out). Other devices: None."""
    if device_type != "npu":
        return None
    setting = environ.get("PYTORCH_NPU_ALLOC_CONF", "")
    if allocator_options(setting).get("expandable_segments") == "True":
        return (
            f"PYTORCH_NPU_ALLOC_CONF={setting!r} turns on expandable_segments, which vllm-ascend's sleep mode "
            "refuses (its memory pool asserts at engine build); remove that option"
        )
    return None


HCCL_EXEC_MARGIN_S = 60
HCCL_EXEC_MIN_S = 68  # HCCL's smallest execution timeout


def hccl_exec_timeout_s(collective_timeout_s: int) -> int:
    """HCCL_EXEC_TIMEOUT for `trainer.collective_timeout_s`, which `init_distributed` sets on Ascend when the
    environment does not.

    HCCL bounds every operation on the device by HCCL_EXEC_TIMEOUT (default 1836 s), read when the process
    group and its communicators are created, apart from the process group's own timeout (torch_npu's
    watchdog). A config timeout above HCCL's was silently cut to it (the templates' fixed 1800 s); one below
    left the device waiting after the watchdog ended the process, and torch_npu then warns that the device
    log (plog) of the stuck operation may be missing. So the device bound is the config's timeout less
    `HCCL_EXEC_MARGIN_S`, at least `HCCL_EXEC_MIN_S`: HCCL fails the operation and logs it first, and the
    watchdog, at the config's timeout, is the backstop. (A process-group timeout of exactly 1800 s, torch_npu's
    default, is replaced by torch_npu with HCCL_EXEC_TIMEOUT + 1800 s; the device bound still ends the
    operation at 1740 s. Atlas training series (910) NPUs accept at most 17340 s.)"""
    return max(HCCL_EXEC_MIN_S, collective_timeout_s - HCCL_EXEC_MARGIN_S)


def memory_line(device_type: str, phase: str) -> str:
    """One log line of memory at a phase boundary: on accelerators the device memory in use (the driver's
    free/total, as verl logs it) and torch's allocated/reserved; the process RSS.

    The driver's figure is the one that shows what vLLM's sleep freed and its wake took: the sleep-mode pool
    unmaps and maps physical memory behind torch's caching allocator, whose counters alone cannot show it."""
    mod = device_module(device_type)
    device = ""
    if mod is not None:
        free, total = mod.mem_get_info()
        device = (
            f"device in use {(total - free) / 2**30:.2f} of {total / 2**30:.0f} GiB (torch allocated "
            f"{mod.memory_allocated() / 2**30:.2f} reserved {mod.memory_reserved() / 2**30:.2f}), "
        )
    return f"memory after {phase}: {device}process RSS {cpu_memory_used_gb():.2f} GiB"


def synchronize(device_type: str) -> None:
    mod = device_module(device_type)
    if mod is not None:
        mod.synchronize()


def max_memory_allocated_gb(device_type: str) -> float:
    """Peak memory of the compute device. On CPU the device memory IS the process memory: its peak
    resident set (VmHWM), which also counts vLLM's CPU KV cache and the Python heap."""
    mod = device_module(device_type)
    if mod is not None:
        return mod.max_memory_allocated() / 2**30
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def cpu_memory_used_gb() -> float:
    """Resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
