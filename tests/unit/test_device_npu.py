"""The Ascend NPU path of the device layer, against a FAKE `torch_npu` (no NPU exists here).

The fake stands in for what the real `torch_npu` import does: it registers `torch.npu` with the cuda-like
device API. Every call to it is recorded, so the tests prove which device module, backend and device index
the trainer would use on an NPU machine. Nothing here has run on a real NPU.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from spmd_grpo import distributed as D


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
    assert D.resolve_device_type("auto") == "npu"
    assert "is_available" in fake_npu.names()


def test_auto_falls_back_when_torch_npu_sees_no_device(fake_npu):
    fake_npu.available = False
    assert D.resolve_device_type("auto") == "cpu"


def test_init_distributed_on_npu_uses_hccl_and_local_rank(fake_npu, recorded_init, monkeypatch):
    monkeypatch.setenv("RANK", "11")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_RANK", "3")
    world = D.init_distributed("npu", timeout_s=123)

    assert (world.device_type, world.backend) == ("npu", "hccl")
    assert (world.rank, world.world_size, world.local_rank) == (11, 16, 3)
    assert ("set_device", (3,)) in fake_npu.calls
    assert len(recorded_init) == 1
    kwargs = recorded_init[0]
    assert kwargs["backend"] == "hccl"
    assert kwargs["timeout"].total_seconds() == 123
    assert kwargs["device_id"] is None  # hccl is created lazily, as verl does


def test_auto_init_on_npu_machine(fake_npu, recorded_init, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "5")
    world = D.init_distributed("auto")
    assert world.backend == recorded_init[0]["backend"] == "hccl"
    assert ("set_device", (5,)) in fake_npu.calls


def test_memory_helpers_go_to_torch_npu(fake_npu):
    D.empty_cache("npu")
    D.synchronize("npu")
    assert D.max_memory_allocated_gb("npu") == 3.0
    assert fake_npu.names() == ["empty_cache", "synchronize", "max_memory_allocated"]


def test_cpu_helpers_touch_no_device_module(fake_npu):
    D.empty_cache("cpu")
    D.synchronize("cpu")
    D.max_memory_allocated_gb("cpu")
    assert fake_npu.calls == []


def test_cast_rule_per_device():
    assert D.cast_before_shard("npu")
    assert not D.cast_before_shard("cuda") and not D.cast_before_shard("cpu")


def test_npu_requested_without_torch_npu_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # `import torch_npu` raises ImportError
    with pytest.raises(RuntimeError, match="trainer.device=npu but torch_npu cannot be imported"):
        D.resolve_device_type("npu")
    # ... and auto quietly ignores the missing torch_npu
    assert D.resolve_device_type("auto") in ("cuda", "cpu")


def test_npu_requested_without_a_visible_npu_is_a_clear_error(fake_npu):
    fake_npu.available = False
    with pytest.raises(RuntimeError, match="torch.npu.is_available\\(\\) is False"):
        D.resolve_device_type("npu")


def test_cuda_requested_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="trainer.device=cuda but torch.cuda.is_available\\(\\) is False"):
        D.resolve_device_type("cuda")


# ---------------------------------------------------------------------- dtype rule (model.py)
class _TinyHf(nn.Module):
    """Stands in for the HF model: one weight and a config without vision token ids."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4, dtype=dtype)
        self.config = SimpleNamespace()


@pytest.mark.parametrize(
    ("device_type", "policy_dtype", "reference_dtype"),
    [("npu", torch.float32, torch.bfloat16), ("cuda", torch.float32, torch.float32)],
)
def test_npu_casts_the_reference_before_sharding_and_keeps_fp32_policy(
    monkeypatch, device_type, policy_dtype, reference_dtype
):
    from spmd_grpo import model as M
    from spmd_grpo.config import ActorConfig

    loaded, sharded = [], []

    def fake_load(model_path, dtype, device="cpu"):
        loaded.append(dtype)
        return _TinyHf(dtype)

    def fake_shard(model, fsdp, world, *, training):
        sharded.append((training, model.hf.proj.weight.dtype, fsdp.param_dtype))
        return model

    monkeypatch.setattr(M, "load_hf_model", fake_load)
    monkeypatch.setattr(M, "shard_model", fake_shard)
    # torch.device("npu") needs the real torch_npu; the world only has to name the device type here.
    world = SimpleNamespace(device_type=device_type, device=torch.device("cpu"))
    cfg = ActorConfig()
    assert cfg.fsdp.param_dtype == "auto"  # bfloat16 on accelerators

    M.build_policy(cfg, world)
    M.build_reference(cfg, offload=False, world=world)

    assert loaded == [policy_dtype, reference_dtype]
    # dtype of the parameters at the moment fully_shard sees them
    assert sharded == [(True, policy_dtype, "auto"), (False, reference_dtype, "auto")]


# ---------------------------------------------------------------------- weight push fallback (engine.py)
def test_weight_push_falls_back_to_load_weights_without_reload_weights():
    """vllm-ascend's worker has no `reload_weights`: the push goes straight into the model's load_weights."""
    from spmd_grpo.engine import EngineStats, RolloutEngine

    received, resets = [], []
    model = SimpleNamespace(load_weights=lambda weights: received.extend(weights))
    worker = SimpleNamespace(model_runner=SimpleNamespace(model=model))  # no reload_weights attribute

    def no_rpc(*args, **kwargs):
        raise AssertionError("collective_rpc must not be used without reload_weights")

    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(worker=worker)),
            reset_encoder_cache=lambda: resets.append("encoder"),
        ),
        collective_rpc=no_rpc,
        reset_prefix_cache=lambda: resets.append("prefix"),
        reset_mm_cache=lambda: resets.append("mm"),
    )
    engine = RolloutEngine.__new__(RolloutEngine)  # skip building a real vLLM engine
    engine.llm, engine.stats = llm, EngineStats()
    engine.world = SimpleNamespace(device_type="npu")

    weights = [("model.embed_tokens.weight", torch.ones(2, 3)), ("lm_head.weight", torch.zeros(2, 3))]
    engine.load_weights(iter(weights), version=1)

    assert [name for name, _ in received] == ["model.embed_tokens.weight", "lm_head.weight"]
    assert sorted(resets) == ["encoder", "mm", "prefix"]
    assert engine.stats.synced_version == 1 and engine.stats.last_sync_bytes == 2 * 6 * 4
