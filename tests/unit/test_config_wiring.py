"""Config fields reach what they configure: `worker.actor.model.trust_remote_code` reaches transformers (the
model's config, read for real from a checkpoint that ships its own configuration code) and the arguments the
engine gives `vllm.LLM`."""

from __future__ import annotations

import json

import pytest

from spmd_grpo.config.loader import load_config
from spmd_grpo.models.build import hf_config
from spmd_grpo.rollout.engine import llm_kwargs

CUSTOM_CONFIG = """from transformers import PretrainedConfig


class CustomVLConfig(PretrainedConfig):
    model_type = "custom_vl_for_trust_test"
"""


@pytest.fixture(scope="module")
def remote_code_checkpoint(tmp_path_factory):
    """A checkpoint directory whose config class lives in the checkpoint (`auto_map`), as remote-code
    models ship it."""
    root = tmp_path_factory.mktemp("remote_code")
    (root / "configuration_custom.py").write_text(CUSTOM_CONFIG)
    config = {
        "model_type": "custom_vl_for_trust_test",
        "auto_map": {"AutoConfig": "configuration_custom.CustomVLConfig"},
        "marker": 7,
    }
    (root / "config.json").write_text(json.dumps(config))
    return root


def test_trust_remote_code_reaches_transformers(remote_code_checkpoint):
    cfg = load_config(None, [f"worker.actor.model.model_path={remote_code_checkpoint}"])
    assert cfg.worker.actor.model.trust_remote_code is False
    with pytest.raises(ValueError, match="contains custom code"):
        hf_config(remote_code_checkpoint, trust_remote_code=cfg.worker.actor.model.trust_remote_code)
    trusted = load_config(
        None,
        [
            f"worker.actor.model.model_path={remote_code_checkpoint}",
            "worker.actor.model.trust_remote_code=true",
        ],
    )
    config = hf_config(remote_code_checkpoint, trust_remote_code=trusted.worker.actor.model.trust_remote_code)
    assert type(config).__name__ == "CustomVLConfig" and config.marker == 7


@pytest.mark.parametrize("trust", [False, True])
def test_trust_remote_code_reaches_vllm(trust):
    cfg = load_config(
        None, ["worker.actor.model.model_path=m", f"worker.actor.model.trust_remote_code={trust}"]
    )
    kwargs = llm_kwargs(
        cfg.worker.actor.model.model_path,
        cfg.worker.rollout,
        trust_remote_code=cfg.worker.actor.model.trust_remote_code,
        max_model_len=cfg.max_model_len,
        min_pixels=cfg.data.min_pixels,
        max_pixels=cfg.data.max_pixels,
    )
    assert kwargs["trust_remote_code"] is trust and kwargs["model"] == "m"
    assert kwargs["max_num_seqs"] == cfg.worker.rollout.max_num_seqs
    assert kwargs["max_model_len"] == cfg.data.max_prompt_length + cfg.data.max_response_length
