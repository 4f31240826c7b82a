"""Config fields reach what they configure: `worker.actor.model.trust_remote_code` reaches transformers (the
model's config, read for real from a checkpoint that ships its own configuration code). What reaches vLLM is
read back from real engines built by `RolloutEngine.from_config` in tests/engine/test_engine_parity.py."""

from __future__ import annotations

import json

import pytest

from spmd_grpo.config.loader import load_config
from spmd_grpo.models.build import hf_config

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
