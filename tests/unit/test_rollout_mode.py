"""`RolloutEngine.rollout_mode`, the one way the accelerator is handed to vLLM, against a FAKE sleep-mode vLLM.

vLLM has no sleep mode on CPU, so the real engine cannot show the wake/sleep sequence here. The fake records
every call in order: the tests prove the order (offload optimizer -> wake weights -> push -> wake KV ->
generate -> sleep -> restore), that a new engine is asleep so its first rollout follows that order too, that
the restore also happens when generation raises, and that after a level-2 sleep (which discards vLLM's
weights) the next wake pushes every weight again, frozen ones included.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import spmd_grpo.rollout.engine as engine_mod
from spmd_grpo.config.workers import RolloutConfig
from spmd_grpo.rollout.engine import RolloutEngine, move_optimizer_state


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.language = nn.Linear(2, 2)
        self.visual = nn.Linear(2, 2)
        self.visual.requires_grad_(False)  # a frozen vision tower


def fake_engine(events: list, sleep_level: int) -> RolloutEngine:
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "qkv": ["qkv"]}  # vLLM's, for LoRA and quantization
    worker = SimpleNamespace(
        reload_weights=True, get_model=lambda: SimpleNamespace(packed_modules_mapping=packed)
    )

    def collective_rpc(method, kwargs):
        events.append(("push", sorted(name for name, _ in kwargs["weights_iterator"])))

    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(worker=worker)),
            reset_encoder_cache=lambda: None,
            model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="qwen2_5_vl")),
        ),
        collective_rpc=collective_rpc,
        reset_prefix_cache=lambda: None,
        reset_mm_cache=lambda: None,
        sleep=lambda level: events.append(("sleep", level)),
        wake_up=lambda tags: events.append(("wake", tuple(tags))),
    )
    cfg = RolloutConfig(enable_sleep_mode=True, sleep_level=sleep_level, weight_sync_bucket_mb=1)
    world = SimpleNamespace(device_type="cuda", device="cuda:0")  # never touched: faked moves
    return RolloutEngine(llm, cfg, world, dtype=torch.float32, tie_word_embeddings=False)


@pytest.fixture
def events(monkeypatch) -> list:
    events: list = []
    monkeypatch.setattr(engine_mod, "empty_cache", lambda device_type: None)
    monkeypatch.setattr(
        engine_mod, "set_expandable_segments", lambda t, on: events.append(("expandable", on))
    )
    monkeypatch.setattr(
        engine_mod, "move_optimizer_state", lambda opt, device: events.append(("optim", str(device)))
    )
    return events


ALL = ["language.bias", "language.weight", "visual.bias", "visual.weight"]
TRAINABLE = ["language.bias", "language.weight"]


def test_a_new_engine_sleeps_and_its_first_push_comes_before_the_kv_cache(events):
    """Built awake, vLLM would hold its dummy weights and its whole KV cache from construction to the first
    rollout (the resume's optimizer-state load included), and the first push would run beside that KV cache."""
    engine, policy = fake_engine(events, sleep_level=1), Policy()
    assert events == [("sleep", 1)]
    events.clear()
    with engine.rollout_mode(policy, 0):
        pass
    assert [e[0] for e in events] == ["expandable", "wake", "push", "wake", "sleep", "expandable"]
    assert events[1:4] == [("wake", ("weights",)), ("push", ALL), ("wake", ("kv_cache",))]


def test_order_and_full_push_after_level_2_sleep(events):
    engine, policy, optimizer = fake_engine(events, sleep_level=2), Policy(), object()
    events.clear()  # the start-up sleep; level 2 drops the (dummy) weights
    with engine.rollout_mode(policy, 1, optimizer=optimizer):
        events.append(("generate",))
    assert events == [
        ("optim", "cpu"),
        ("expandable", False),
        ("wake", ("weights",)),
        ("push", ALL),  # the engine held nothing: the frozen tower too
        ("wake", ("kv_cache",)),
        ("generate",),
        ("sleep", 2),
        ("expandable", True),
        ("optim", "None"),  # back to its parameters' device
    ]
    events.clear()
    with engine.rollout_mode(policy, 1):  # same version, but level 2 discarded it: push everything again
        pass
    assert ("push", ALL) in events


def test_level_1_keeps_weights_and_skips_frozen(events):
    engine, policy = fake_engine(events, sleep_level=1), Policy()
    for version in (0, 1, 1):  # level 1 kept version 1: no push the second time
        with engine.rollout_mode(policy, version):
            pass
    pushes = [e for e in events if e[0] == "push"]
    # A new engine holds none of the policy's weights; once it holds a version, frozen ones never change.
    assert pushes == [("push", ALL), ("push", TRAINABLE)]


class PartlyAdapted(nn.Module):
    """LoRA on q and v only (k frozen), both fused by vLLM into one `qkv_proj`; a frozen layer fused with nothing
    sent (`frozen_attn`), and a frozen already-packed `qkv`."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.ModuleDict({m: nn.Linear(2, 2) for m in ("q_proj", "k_proj", "v_proj")})
        self.frozen_attn = nn.ModuleDict({m: nn.Linear(2, 2) for m in ("q_proj", "k_proj", "v_proj")})
        self.visual = nn.ModuleDict({"qkv": nn.Linear(2, 2)})
        self.requires_grad_(False)
        self.attn.q_proj.requires_grad_(True)
        self.attn.v_proj.requires_grad_(True)


def test_frozen_weights_fused_with_sent_ones_are_sent_with_them(events):
    """vLLM rebuilds a reloaded fused layer from empty memory: leaving out k_proj while q_proj and v_proj go to
    `qkv_proj` would leave k's rows uninitialised in the engine (tests/engine: per-token logprob errors of
    0.37 nats with LoRA on q_proj and v_proj before this)."""
    engine, policy = fake_engine(events, sleep_level=1), PartlyAdapted()
    for version in (0, 1):
        with engine.rollout_mode(policy, version):
            pass
    pushes = [e[1] for e in events if e[0] == "push"]
    assert len(pushes[0]) == 14
    assert pushes[1] == sorted(f"attn.{m}_proj.{p}" for m in "qkv" for p in ("bias", "weight"))


def test_sleeps_and_restores_when_generation_fails(events):
    engine, policy, optimizer = fake_engine(events, sleep_level=2), Policy(), object()
    with pytest.raises(RuntimeError, match="boom"), engine.rollout_mode(policy, 1, optimizer=optimizer):
        raise RuntimeError("boom")
    assert events[-3:] == [("sleep", 2), ("expandable", True), ("optim", "None")]


def test_failed_load_warnings_are_dropped_only_for_layers_a_partial_push_leaves_out():
    """vLLM's "<layer>: Failed to load weights" (its layerwise reload, once per layer that got nothing):
    in a full push every class shows but rotary (a buffer); in a partial push (frozen weights left out, as
    every push after the first with LoRA merged sync) the classes that loaded in full pushes are dropped,
    and a class that failed in a full push still shows (a real missing weight is never hidden)."""
    import logging

    from spmd_grpo.rollout.vllm_args import _PUSH, _DropVllmNoise, weight_push

    noise = _DropVllmNoise()

    def shown(layer: str) -> bool:
        record = logging.LogRecord(
            "vllm", logging.WARNING, "", 0, "%s: Failed to load weights", (layer,), None
        )
        return noise.filter(record)

    with weight_push(partial=False):  # the first push, everything sent
        assert not shown("MRotaryEmbedding")
        assert shown("BrokenLinear")  # a name vLLM could not place: a real failure
    with weight_push(partial=True):  # frozen norms, embeddings and vision tower left out
        assert not shown("RMSNorm") and not shown("VocabParallelEmbedding")
        assert shown("BrokenLinear")
    assert shown("RMSNorm")  # outside a partial push nothing is presumed
    _PUSH.failed_in_full_push.clear()


def test_the_expandable_segments_switch_keeps_the_other_allocator_settings():
    """Torch resets every allocator option a settings string leaves out: switching expandable segments around
    the rollout must not drop a user's PYTORCH_CUDA_ALLOC_CONF options (the real torch setter, run here for
    the cuda path: it only parses and stores the string)."""
    from spmd_grpo.parallel.devices import set_expandable_segments

    get, put = torch._C._accelerator_getAllocatorSettings, torch._C._accelerator_setAllocatorSettings
    before = get()
    put("max_split_size_mb:512,garbage_collection_threshold:0.6")
    try:
        set_expandable_segments("cuda", False)
        assert get() == "max_split_size_mb:512,garbage_collection_threshold:0.6,expandable_segments:False"
        set_expandable_segments("cuda", True)
        assert get() == "max_split_size_mb:512,garbage_collection_threshold:0.6,expandable_segments:True"
        set_expandable_segments("cpu", False)  # nothing to switch
        assert get().endswith("expandable_segments:True")
    finally:
        put(before)


def test_the_optimizer_state_comes_back_to_its_parameters_device(events, monkeypatch):
    """With `fsdp.offload_params` as well, the parameters and so AdamW's state live in host memory: after the
    rollout the state must return there, not to the accelerator (where the next step would meet CPU
    gradients). The real move, with `meta` standing for the accelerator this machine lacks."""
    monkeypatch.setattr(engine_mod, "move_optimizer_state", move_optimizer_state)
    policy = Policy()
    optimizer = torch.optim.AdamW(policy.language.parameters(), foreach=False)
    policy.language(torch.ones(1, 2)).sum().backward()
    optimizer.step()  # state on the CPU, beside its (host-memory) parameters
    engine = fake_engine(events, sleep_level=2)
    engine.world = SimpleNamespace(device_type="cuda", device=torch.device("meta"))
    with engine.rollout_mode(policy, 1, optimizer=optimizer):
        pass
    states = [v for state in optimizer.state.values() for k, v in state.items() if k != "step"]
    assert len(states) == 4 and all(v.device.type == "cpu" for v in states)
    optimizer.step()  # and the next step runs
