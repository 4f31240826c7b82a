"""The Ascend NPU path of the device layer, against a FAKE `torch_npu` (no NPU exists here).

The fake stands in for what the real `torch_npu` import does: it registers `torch.npu` with the cuda-like
device API. Every call to it is recorded, so the tests prove which device module, backend and device index
the trainer would use on an NPU machine. Nothing here has run on a real NPU.
"""

from __future__ import annotations

import os
import sys
import types
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from spmd_grpo.parallel.collectives import init_distributed
from spmd_grpo.parallel.devices import (
    empty_cache,
    hccl_exec_timeout_s,
    max_memory_allocated_gb,
    memory_line,
    resolve_device_type,
    synchronize,
)


class FakeNpu(types.ModuleType):
    """`torch.npu` as torch_npu registers it; records every call as (name, args)."""

    def __init__(self, available: bool = True) -> None:
        super().__init__("torch.npu")
        self.available = available
        self.calls: list[tuple[str, tuple]] = []

    def _record(self, name: str, *args):
        self.calls.append((name, args))

    def is_available(self) -> bool:
        self._record("is_available")
        return self.available

    def device_count(self) -> int:
        self._record("device_count")
        return 8 if self.available else 0

    def set_device(self, index: int) -> None:
        self._record("set_device", index)

    def empty_cache(self) -> None:
        self._record("empty_cache")

    def synchronize(self) -> None:
        self._record("synchronize")

    def max_memory_allocated(self) -> int:
        self._record("max_memory_allocated")
        return 3 * 2**30

    def memory_allocated(self) -> int:
        return 2**30

    def memory_reserved(self) -> int:
        return 2 * 2**30

    def mem_get_info(self) -> tuple[int, int]:
        return 58 * 2**30, 64 * 2**30  # (free, total)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


@pytest.fixture
def fake_npu(monkeypatch) -> FakeNpu:
    """A machine with torch_npu installed and NPUs visible (and no CUDA)."""
    npu = FakeNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return npu


@pytest.fixture
def recorded_init(monkeypatch) -> list[dict]:
    """dist.init_process_group records its arguments instead of creating a group."""
    calls: list[dict] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    return calls


def test_auto_picks_npu_when_torch_npu_sees_a_device(fake_npu):
    assert resolve_device_type("auto") == "npu"
    assert "is_available" in fake_npu.names()


def test_auto_falls_back_when_torch_npu_sees_no_device(fake_npu):
    fake_npu.available = False
    assert resolve_device_type("auto") == "cpu"


def test_init_distributed_on_npu_uses_hccl_and_local_rank(fake_npu, recorded_init, monkeypatch):
    monkeypatch.setenv("RANK", "11")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_RANK", "3")
    world = init_distributed("npu", timeout_s=123)

    assert (world.device_type, world.backend) == ("npu", "cpu:gloo,npu:hccl")
    assert (world.rank, world.world_size, world.local_rank) == (11, 16, 3)
    assert ("set_device", (3,)) in fake_npu.calls
    assert len(recorded_init) == 1
    kwargs = recorded_init[0]
    assert kwargs["backend"] == "cpu:gloo,npu:hccl"  # host tensors (counts, metrics) over gloo
    assert kwargs["timeout"].total_seconds() == 123
    assert kwargs["device_id"] is None  # hccl is created lazily, as verl does


def test_hccl_exec_timeout_follows_the_collective_timeout_unless_the_environment_sets_it(
    fake_npu, monkeypatch
):
    """HCCL reads HCCL_EXEC_TIMEOUT when the process group is created: it must be in the environment by
    then, a little below the process group's timeout (the device fails the operation before the watchdog),
    and a value the user exported wins. Nothing is set off the NPU."""
    seen: list[str | None] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        dist, "init_process_group", lambda **kw: seen.append(os.environ.get("HCCL_EXEC_TIMEOUT"))
    )
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "")
    monkeypatch.delenv("HCCL_EXEC_TIMEOUT")  # unset now, and unset again after the test
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "16")

    init_distributed("cpu", timeout_s=3600)
    init_distributed("npu", timeout_s=3600)
    assert seen == [None, "3540"]
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "900")
    init_distributed("npu", timeout_s=3600)
    assert seen[-1] == "900"
    assert hccl_exec_timeout_s(1800) == 1740 and hccl_exec_timeout_s(3) == 68  # HCCL's smallest


def test_auto_init_on_npu_machine(fake_npu, recorded_init, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "5")
    world = init_distributed("auto")
    assert world.backend == recorded_init[0]["backend"] == "cpu:gloo,npu:hccl"
    assert ("set_device", (5,)) in fake_npu.calls


def test_memory_helpers_go_to_torch_npu(fake_npu):
    empty_cache("npu")
    synchronize("npu")
    assert max_memory_allocated_gb("npu") == 3.0
    assert fake_npu.names() == ["empty_cache", "synchronize", "max_memory_allocated"]


def test_the_memory_line_reports_the_drivers_figure_beside_torchs(fake_npu):
    """What vLLM's sleep frees and its wake takes is mapped behind torch's allocator: only the driver's
    free/total shows it."""
    line = memory_line("npu", "rollout + sleep")
    assert line.startswith("memory after rollout + sleep: device in use 6.00 of 64 GiB")
    assert "(torch allocated 1.00 reserved 2.00)" in line


def test_cpu_helpers_touch_no_device_module(fake_npu):
    empty_cache("cpu")
    synchronize("cpu")
    max_memory_allocated_gb("cpu")
    assert fake_npu.calls == []


def test_npu_requested_without_torch_npu_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # `import torch_npu` raises ImportError
    with pytest.raises(RuntimeError, match="trainer.device=npu but torch_npu cannot be imported"):
        resolve_device_type("npu")
    # ... and auto quietly ignores the missing torch_npu
    assert resolve_device_type("auto") in ("cuda", "cpu")


def test_npu_requested_without_a_visible_npu_is_a_clear_error(fake_npu):
    fake_npu.available = False
    with pytest.raises(RuntimeError, match="torch.npu.is_available\\(\\) is False"):
        resolve_device_type("npu")


def test_cuda_requested_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="trainer.device=cuda but torch.cuda.is_available\\(\\) is False"):
        resolve_device_type("cuda")


# ---------------------------------------------------------------------- dtype rule (models/build.py)
@pytest.mark.parametrize(
    ("device_type", "ref_dtype", "param_dtype", "built", "gathered"),
    [
        ("npu", "auto", "auto", torch.bfloat16, "bfloat16"),
        ("cuda", "auto", "auto", torch.bfloat16, "bfloat16"),
        ("cpu", "auto", "auto", torch.float32, "float32"),
        ("cpu", "auto", "bfloat16", torch.bfloat16, "bfloat16"),
        ("cuda", "auto", "float16", torch.float16, "float16"),
        ("cuda", "float32", "auto", torch.float32, "float32"),
    ],
)
def test_reference_is_built_and_run_in_its_dtype_and_the_policy_in_fp32(
    monkeypatch, device_type, ref_dtype, param_dtype, built, gathered
):
    """The reference never exists in fp32 unless asked, and no sharded tensor of it is ever cast (the
    dtype it is built in is the dtype FSDP2 gathers); the policy always holds fp32 master weights."""
    from spmd_grpo.config.workers import ActorConfig, FSDPConfig, RefConfig
    from spmd_grpo.models import build as M

    calls = []

    def fake_build(cfg, dtype, world, *, training, seed=0):
        calls.append((training, dtype, cfg.fsdp.param_dtype, cfg.fsdp.offload_params))

    monkeypatch.setattr(M, "build_sharded", fake_build)
    world = SimpleNamespace(device_type=device_type, device=torch.device("cpu"))
    cfg = ActorConfig(fsdp=FSDPConfig(param_dtype=param_dtype))

    M.build_policy(cfg, world)
    M.build_reference(cfg, RefConfig(dtype=ref_dtype, offload_params=True), world)

    assert calls == [(True, torch.float32, param_dtype, False), (False, built, gathered, True)]
    # LoRA: the frozen base is held in the compute dtype (the adapters are made fp32 inside build_sharded)
    from spmd_grpo.config.workers import LoRAConfig, ModelConfig
    from spmd_grpo.parallel.devices import resolve_dtype

    M.build_policy(replace(cfg, model=ModelConfig(lora=LoRAConfig(rank=8))), world)
    assert calls[-1] == (True, resolve_dtype(param_dtype, device_type), param_dtype, False)


# ------------------------------------------------------------------- the engine on Ascend (rollout/engine.py)
def test_a_vllm_worker_without_reload_weights_is_refused_when_the_engine_is_built():
    """Every push goes through vLLM's `reload_weights` (vllm-ascend's NPUWorker has it too), which runs each
    layer's post-load processing; a worker without it is refused at build, before the first push."""
    from spmd_grpo.config.workers import RolloutConfig
    from spmd_grpo.rollout.engine import RolloutEngine

    worker = SimpleNamespace(model_runner=SimpleNamespace())  # no reload_weights attribute
    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(worker=worker)),
            model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="qwen2_5_vl")),
        )
    )
    with pytest.raises(RuntimeError, match="SimpleNamespace has no reload_weights"):
        RolloutEngine(llm, RolloutConfig(), SimpleNamespace(device_type="npu"), dtype=torch.float32,
                      tie_word_embeddings=False)  # fmt: skip


@pytest.mark.parametrize("before", [None, "1", "0"])
def test_vllm_ascend_gets_the_plain_weight_layout(monkeypatch, before):
    """vllm-ascend's FRACTAL_NZ layout is off for the engine whatever the environment said (its wake_up
    refuses to run with it on, and the pushes are plain ND weights); other devices' settings are untouched."""
    from spmd_grpo.config.workers import RolloutConfig
    from spmd_grpo.rollout.engine import set_platform_environment

    for name, value in (("VLLM_ASCEND_ENABLE_NZ", before), ("VLLM_CPU_KVCACHE_SPACE", None)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    set_platform_environment(RolloutConfig(), "npu")
    assert os.environ["VLLM_ASCEND_ENABLE_NZ"] == "0" and "VLLM_CPU_KVCACHE_SPACE" not in os.environ
    set_platform_environment(RolloutConfig(kv_cache_memory_gb=2.5), "cpu")
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"


def test_vllm_ascend_gets_nz_mode_0_in_its_own_config():
    """vllm-ascend reads weight_nz_mode from additional_config first; VLLM_ASCEND_ENABLE_NZ is only its
    deprecated fallback (default 1, and its wake_up raises for any non-zero mode). That vLLM takes the
    argument is tests/engine/test_vllm_interfaces.py's (importing vLLM costs seconds)."""
    from spmd_grpo.rollout.engine import platform_llm_kwargs

    assert platform_llm_kwargs("npu") == {"additional_config": {"weight_nz_mode": 0}}
    assert platform_llm_kwargs("cuda") == platform_llm_kwargs("cpu") == {}


@pytest.mark.parametrize(
    ("setting", "refused"),
    [
        ("expandable_segments:True", True),
        ("max_split_size_mb:128, expandable_segments:True", True),
        ("expandable_segments:False", False),
        ("max_split_size_mb:128", False),
        (None, False),
    ],
)
def test_sleep_mode_refuses_expandable_segments_on_ascend_at_start_up(
    fake_npu, monkeypatch, setting, refused
):
    """vllm-ascend's sleep-mode pool asserts on expandable_segments:True in PYTORCH_NPU_ALLOC_CONF when the
    engine is built (after both models loaded), and torch_npu reads the variable only once: refused in
    preflight, naming the key, unless sleep mode is off. CUDA switches the option at run time instead."""
    from spmd_grpo.config.checks import ConfigError
    from spmd_grpo.config.loader import load_config
    from spmd_grpo.parallel.devices import sleep_mode_allocator_error
    from spmd_grpo.run.preflight import check_sleep_mode_allocator

    env = {} if setting is None else {"PYTORCH_NPU_ALLOC_CONF": setting}
    assert (sleep_mode_allocator_error("npu", env) is not None) == refused
    assert sleep_mode_allocator_error("cuda", env) is None
    if setting is None:
        monkeypatch.delenv("PYTORCH_NPU_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", setting)
    cfg = load_config(None, ["trainer.device=npu"])
    if refused:
        with pytest.raises(
            ConfigError, match="worker.rollout.enable_sleep_mode=true: PYTORCH_NPU_ALLOC_CONF"
        ):
            check_sleep_mode_allocator(cfg)
    else:
        check_sleep_mode_allocator(cfg)
    check_sleep_mode_allocator(
        load_config(None, ["trainer.device=npu", "worker.rollout.enable_sleep_mode=false"])
    )
