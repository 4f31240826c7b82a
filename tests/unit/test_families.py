"""The family table: which model types are supported, how each names its weights on disk, what a model path
resolves to before anything is built, and that an unsupported model is refused at config time."""

import json

import pytest

from spmd_grpo.models.families import (
    FAMILIES,
    PUBLISHED,
    QWEN2_5_VL,
    QWEN2_VL,
    QWEN3_VL,
    SIZES_B,
    family_of_model_path,
)
from spmd_grpo.train import main


def test_three_families_with_their_patch_sizes():
    assert {k: f.image_factor for k, f in FAMILIES.items()} == {
        "qwen2_vl": 28,
        "qwen2_5_vl": 28,
        "qwen3_vl": 32,
    }


@pytest.mark.parametrize("family", [QWEN2_VL, QWEN2_5_VL])
def test_qwen2_and_qwen2_5_store_the_older_layout(family):
    assert (
        family.on_disk_name("model.language_model.layers.3.mlp.up_proj.weight")
        == "model.layers.3.mlp.up_proj.weight"
    )
    assert family.on_disk_name("model.visual.merger.mlp.0.weight") == "visual.merger.mlp.0.weight"
    assert family.on_disk_name("lm_head.weight") == "lm_head.weight"


def test_qwen3_stores_the_in_memory_names():
    for name in (
        "model.language_model.layers.3.mlp.up_proj.weight",
        "model.visual.deepstack_merger_list.0.norm.weight",
    ):
        assert QWEN3_VL.on_disk_name(name) == name


def test_model_paths_resolve_offline(tmp_path):
    assert PUBLISHED["Qwen/Qwen3-VL-8B-Instruct"] is QWEN3_VL
    assert family_of_model_path("Qwen/Qwen2-VL-7B-Instruct") is QWEN2_VL
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    assert family_of_model_path(str(tmp_path)) is QWEN3_VL


def test_an_unsupported_model_is_refused_at_config_time_naming_the_supported_ones(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava"}))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        main(["configs/smoke.yaml", f"worker.actor.model.model_path={tmp_path}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"config error: worker.actor.model.model_path={str(tmp_path)!r}: {tmp_path / 'config.json'} has model_type 'llava', which is not supported; supported: "
        "Qwen2-VL (model_type qwen2_vl), Qwen2.5-VL (model_type qwen2_5_vl), Qwen3-VL (model_type qwen3_vl)"
    )


@pytest.mark.parametrize("model_id", sorted(PUBLISHED))
def test_every_published_architecture_has_its_published_size(model_id):
    """Built on the meta device from the table, each model has the size its model card states (to the card's
    three significant digits), so a wrong width, depth, vocabulary or tie in the table shows here."""
    from spmd_grpo.dry_run import _count_parameters

    assert set(SIZES_B) == set(PUBLISHED)
    params_b = _count_parameters(PUBLISHED[model_id].published_config(model_id)).num_params / 1e9
    assert params_b == pytest.approx(SIZES_B[model_id], rel=0.002), params_b


@pytest.mark.parametrize("model_id", ["Qwen/Qwen3-VL-2B-Instruct", "Qwen/Qwen3-VL-4B-Instruct"])
def test_the_small_qwen3_vl_models_dry_run_on_8_nodes(model_id):
    from spmd_grpo.config.loader import load_config
    from spmd_grpo.dry_run import dry_run

    cfg = load_config("configs/qwen3_vl_8b_geo3k_grpo.yaml", [f"worker.actor.model.model_path={model_id}"])
    plan = dry_run(cfg, nnodes=8, nproc_per_node=8, device_memory_gb=80)
    assert "world 64" in plan and f"{SIZES_B[model_id]:.2f}B parameters" in plan, plan
