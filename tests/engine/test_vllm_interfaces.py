"""Our code inside vLLM's own classes, without building an engine: tests of the seam with vLLM, kept with the
other vLLM tests. Importing vLLM costs the test process about 2 s and its exit about 1 s more, a tenth of the
unit tier's budget, which is why no unit test imports it.

* The logits processor that makes the vision special tokens unsamplable, under both of vLLM 0.32's model
  runners. The CPU engine tests run it under the V1 runner (the CPU build has no Triton); the V2 runner (the
  CUDA default, and the one that returns routed experts) loads processors through its own loader, which
  refuses a class that does not derive from its base when the engine is built. Its loader and request-state
  type import without a GPU, so the V2 path is exercised here with vLLM's own code and a real engine config.
* The engine argument the platform layer adds for vllm-ascend (`additional_config`, tests/unit/test_device_npu.py
  for what it holds) is one vLLM's `EngineArgs` takes.
"""

from __future__ import annotations

import pytest
import torch

from spmd_grpo.models.policy import unsamplable_token_ids
from spmd_grpo.rollout.vllm_args import suppress_vision_tokens_processor
from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def vllm_config():
    from vllm.config import ModelConfig, VllmConfig

    return VllmConfig(model_config=ModelConfig(model=str(tiny_model())))


def _masked(logits: torch.Tensor, ids: list[int]) -> None:
    assert ids and torch.isneginf(logits[:, ids]).all()
    keep = torch.ones(logits.shape[1], dtype=torch.bool)
    keep[ids] = False
    assert torch.isfinite(logits[:, keep]).all()


def test_the_v2_runner_loads_and_applies_it(vllm_config):
    """What the V2 runner does with `logits_processors`: the front end's check at engine build, then the
    worker's construction with the request states, then apply(logits, ctx) on the batch's rows."""
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcRequestState
    from vllm.v1.worker.gpu.sample.logits_processor.loader import (
        _load_v2_logitsprocs,
        build_custom_logits_processors_params_validator,
    )

    cls = suppress_vision_tokens_processor()
    build_custom_logits_processors_params_validator([cls])  # raised "... is not a subclass of ..." before
    [ctor] = _load_v2_logitsprocs([cls])
    vocab = vllm_config.model_config.get_vocab_size()
    states = LogitsProcRequestState(torch.device("cpu"), 4, vocab, None, None, None, None)
    processor = ctor(vllm_config, states)
    assert processor.add_request(0, None)
    logits = processor.apply(torch.zeros(3, vocab), ctx=None)  # this processor reads nothing of the layout
    _masked(logits, unsamplable_token_ids(vllm_config.model_config.hf_config))


def test_the_v1_runner_builds_and_applies_it(vllm_config):
    """The V1 runner's construction (vllm_config, device, is_pin_memory) and apply(logits)."""
    from vllm.v1.sample.logits_processor import LogitsProcessor

    cls = suppress_vision_tokens_processor()
    assert issubclass(cls, LogitsProcessor)
    processor = cls(vllm_config, torch.device("cpu"), False)
    vocab = vllm_config.model_config.get_vocab_size()
    _masked(processor.apply(torch.zeros(2, vocab)), unsamplable_token_ids(vllm_config.model_config.hf_config))


def test_vllm_takes_the_additional_config_the_npu_engine_gets():
    """vllm-ascend reads weight_nz_mode from vLLM's `additional_config` (`platform_llm_kwargs("npu")`)."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    assert "additional_config" in {f.name for f in dataclasses.fields(EngineArgs)}
