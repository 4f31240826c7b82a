"""The family table: which model types are supported, how each names and lays out its weights on disk, what a
model path resolves to before anything is built, and that an unsupported model is refused at config time."""

import json

import pytest
import torch

from spmd_grpo.models.families import (
    FAMILIES,
    PUBLISHED,
    QWEN2_5_VL,
    QWEN2_VL,
    QWEN3_5_MOE,
    QWEN3_VL,
    QWEN3_VL_MOE,
    SIZES_B,
    UNCHECKED_SIZES,
    family_of_model_path,
)
from spmd_grpo.train import main
from tests.conftest import tiny_model

NEW_FAMILIES = ["qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"]


def test_six_families_with_their_patch_sizes():
    assert {k: f.image_factor for k, f in FAMILIES.items()} == {
        "qwen2_vl": 28,
        "qwen2_5_vl": 28,
        "qwen3_vl": 32,
        "qwen3_vl_moe": 32,
        "qwen3_5": 32,
        "qwen3_5_moe": 32,
    }
    assert [k for k, f in FAMILIES.items() if f.moe] == ["qwen3_vl_moe", "qwen3_5_moe"]
    assert [k for k, f in FAMILIES.items() if f.linear_attention] == ["qwen3_5", "qwen3_5_moe"]
    assert [k for k, f in FAMILIES.items() if f.deepstack] == ["qwen3_vl", "qwen3_vl_moe"]


def test_experts_go_out_in_the_published_layout_and_nothing_else_changes():
    t = torch.arange(2 * 6 * 4.0).reshape(2, 6, 4)
    experts = "model.language_model.layers.3.mlp.experts"
    ((name, out),) = QWEN3_VL_MOE.hub_tensors(f"{experts}.gate_up_proj", t)
    assert name == f"{experts}.gate_up_proj" and torch.equal(out, t.transpose(1, 2))
    split = dict(QWEN3_5_MOE.hub_tensors(f"{experts}.gate_up_proj", t))
    assert list(split) == [f"{experts}.{e}.{w}_proj.weight" for e in (0, 1) for w in ("gate", "up")]
    assert torch.equal(split[f"{experts}.1.up_proj.weight"], t[1, 3:])
    assert list(dict(QWEN3_5_MOE.hub_tensors(f"{experts}.down_proj", t))) == [
        f"{experts}.0.down_proj.weight",
        f"{experts}.1.down_proj.weight",
    ]
    for family, name in [
        (QWEN3_VL_MOE, "model.language_model.layers.3.mlp.gate.weight"),
        (QWEN3_VL, "model.language_model.layers.3.mlp.up_proj.weight"),
    ]:
        assert list(family.hub_tensors(name, t)) == [(name, t)]


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_tiny_model_has_what_vllm_cpu_needs(family):
    """Every layer sparse with 8 experts, top 2, non-square experts; both layer types with linear head dim
    128; mrope sections summing to the rotating half-dims; no DeepStack in Qwen3.5; experts in the hub layout
    in the file."""
    from safetensors import safe_open
    from transformers import AutoConfig

    d = tiny_model(family=family)
    text = AutoConfig.from_pretrained(d).text_config
    rotary = int(text.head_dim * text.rope_parameters.get("partial_rotary_factor", 1.0))
    assert sum(text.rope_parameters["mrope_section"]) == rotary // 2
    with safe_open(d / "model.safetensors", "pt") as st:
        shapes = {k: tuple(st.get_slice(k).get_shape()) for k in st.keys()}  # noqa: SIM118
    layer = "model.language_model.layers.0.mlp.experts"
    if FAMILIES[family].moe:
        assert (text.num_experts, text.num_experts_per_tok, text.norm_topk_prob) == (8, 2, True)
        assert text.moe_intermediate_size != text.hidden_size
    if family == "qwen3_vl_moe":
        assert text.decoder_sparse_step == 1 and text.mlp_only_layers == []
        assert shapes[f"{layer}.gate_up_proj"] == (8, 64, 192) and shapes[f"{layer}.down_proj"] == (8, 96, 64)
    if family == "qwen3_5_moe":  # what save_pretrained writes and the published checkpoints hold
        assert shapes[f"{layer}.7.gate_proj.weight"] == (96, 64) and f"{layer}.gate_up_proj" not in shapes
    if FAMILIES[family].linear_attention:
        assert set(text.layer_types) == {"linear_attention", "full_attention"}
        assert text.linear_key_head_dim == text.linear_value_head_dim == 128
        assert AutoConfig.from_pretrained(d).vision_config.deepstack_visual_indexes == []


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_experts_load_from_the_file_layout_and_push_in_the_hub_layout(family):
    """The loader fills transformers' expert layout from the file's (transposed / per expert) exactly as
    `from_pretrained` does, and the weight stream gives back every tensor of the published-layout file, bit
    for bit: a transposed expert would fail both on shape (the experts are not square)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from spmd_grpo.models.weights import load_safetensors_into
    from spmd_grpo.rollout.weight_sync import iter_sharded_weights

    d = tiny_model(family=family)
    fam = FAMILIES[family]
    want = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32)
    state = {k: torch.zeros_like(v) for k, v in want.state_dict().items()}
    load_safetensors_into(state, d, name_map=fam.on_disk_name, is_fused_expert=fam.moe.is_fused_expert)
    for k, v in want.state_dict().items():
        assert torch.equal(state[k], v), k
    pushed = dict(
        iter_sharded_weights(want, torch.float32, 1 << 20, tie_word_embeddings=False, layout=fam.hub_tensors)
    )
    on_disk = load_file(str(d / "model.safetensors"))
    assert pushed.keys() == on_disk.keys()
    assert all(torch.equal(pushed[k], on_disk[k]) for k in on_disk)


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
        "Qwen2-VL (model_type qwen2_vl), Qwen2.5-VL (model_type qwen2_5_vl), Qwen3-VL (model_type qwen3_vl), "
        "Qwen3-VL-MoE (model_type qwen3_vl_moe), Qwen3.5 (model_type qwen3_5), Qwen3.5-MoE (model_type qwen3_5_moe)"
    )


@pytest.mark.parametrize("model_id", sorted(SIZES_B))
def test_every_published_architecture_has_its_published_size(model_id):
    """Built on the meta device from the table, each model has the size its model card states (to the card's
    three significant digits), so a wrong width, depth, vocabulary or tie in the table shows here."""
    from spmd_grpo.dry_run.counts import count_parameters

    assert set(SIZES_B) | UNCHECKED_SIZES == set(PUBLISHED) and not set(SIZES_B) & UNCHECKED_SIZES
    params_b = count_parameters(PUBLISHED[model_id].published_config(model_id)).num_params / 1e9
    assert params_b == pytest.approx(SIZES_B[model_id], rel=0.002), params_b


@pytest.mark.parametrize("model_id", sorted(UNCHECKED_SIZES))
def test_the_qwen3_5_rows_have_about_the_size_in_their_name(model_id):
    """No model card states a finer count, so a gross error only (a wrong depth, width or expert count moves
    the count by more than 20 %; 4B counts 4.54B with its vision tower and tied head), plus the one value
    that joins the two towers: the merger's output width is the language model's."""
    from spmd_grpo.dry_run.counts import count_parameters

    config = PUBLISHED[model_id].published_config(model_id)
    named_b = float(model_id.split("-")[1].removesuffix("B"))
    params_b = count_parameters(config).num_params / 1e9
    assert params_b == pytest.approx(named_b, rel=0.2), params_b
    assert config.vision_config.out_hidden_size == config.text_config.hidden_size


@pytest.mark.parametrize("model_id", ["Qwen/Qwen3-VL-2B-Instruct", "Qwen/Qwen3-VL-4B-Instruct"])
def test_the_small_qwen3_vl_models_dry_run_on_8_nodes(model_id):
    from spmd_grpo.config.loader import load_config
    from spmd_grpo.dry_run.plan import dry_run

    cfg = load_config("configs/qwen3_vl_8b_geo3k_grpo.yaml", [f"worker.actor.model.model_path={model_id}"])
    plan = dry_run(cfg, nnodes=8, nproc_per_node=8, device_memory_gb=80)
    assert "world 64" in plan and f"{SIZES_B[model_id]:.2f}B parameters" in plan, plan


def test_qwen3_5_on_cpu_needs_a_bf16_rollout(capsys):
    """vLLM's CPU Gated DeltaNet kernel runs in bf16 only: an fp32 rollout stops at config time."""
    d = tiny_model(family="qwen3_5")
    with pytest.raises(SystemExit) as exit_info:
        main(["configs/smoke.yaml", f"worker.actor.model.model_path={d}", "worker.rollout.dtype=float32"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "config error: worker.rollout.dtype=float32: Qwen3.5's linear-attention layers run in vLLM's CPU build "
        "only in bfloat16 (got float32); set bfloat16"
    )


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_an_moe_family_on_cpu_refuses_adapter_lora_sync(capsys, family):
    """vLLM's CPU build runs an MoE model's experts under enable_lora through a Triton kernel it does not have
    (the first generate failed, tests/engine's job run with lora_sync=adapter): refused at config time."""
    d = tiny_model(family=family)
    lora = [
        "worker.actor.model.lora.rank=8",
        "worker.rollout.lora_sync=adapter",
        "worker.rollout.dtype=bfloat16",
    ]
    with pytest.raises(SystemExit) as exit_info:
        main(["configs/smoke.yaml", f"worker.actor.model.model_path={d}", *lora])
    assert exit_info.value.code == 2
    name = FAMILIES[family].name
    assert capsys.readouterr().err.strip() == (
        f"config error: worker.rollout.lora_sync=adapter: vLLM's CPU build cannot serve {name} with LoRA "
        "adapters (its MoE layers then need Triton's kernel); use merged"
    )


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_the_export_writes_the_published_expert_layout(tmp_path, family, caplog):
    """A checkpoint of the policy (transformers' memory layout, as the trainer saves it) exports to exactly
    the published-layout file the tiny model was built from (Qwen3-VL-MoE's transposed fused experts,
    Qwen3.5-MoE's one tensor per expert), every other tensor as is, and its names are recognised as the base
    checkpoint's (no warning that they match neither naming)."""
    import json

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from spmd_grpo.run.export import export_hf

    src = tiny_model(family=family)
    model = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32)
    ckpt = tmp_path / "global_step_1"
    dcp.save(
        {f"model.hf.{k}": v for k, v in model.state_dict().items()}, checkpoint_id=str(ckpt), no_dist=True
    )
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1, "model_path": str(src)}))
    with caplog.at_level("WARNING", logger="spmd_grpo.run.export"):
        out = export_hf(ckpt, tmp_path / "hf", "float32")
    warned = [r.getMessage() for r in caplog.records if r.name == "spmd_grpo.run.export"]
    assert not warned, warned
    exported, published = load_file(str(out / "model.safetensors")), load_file(str(src / "model.safetensors"))
    assert exported.keys() == published.keys()
    assert all(torch.equal(exported[k], published[k]) for k in published)


def test_a_moe_checkpoint_that_vllm_would_route_differently_is_refused(tmp_path, capsys):
    """transformers' MoE routers always renormalise the top-k probabilities; vLLM follows norm_topk_prob."""
    import shutil

    d = tmp_path / "model"
    shutil.copytree(tiny_model(family="qwen3_vl_moe"), d)
    config = json.loads((d / "config.json").read_text())
    config["text_config"]["norm_topk_prob"] = False
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit):
        main(["configs/smoke.yaml", f"worker.actor.model.model_path={d}"])
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            "config.json: text_config.norm_topk_prob is false, but transformers always renormalises the top-k "
            "and vLLM would not (the two would compute different models); set it to true, as the published "
            "checkpoints do"
        )
    )
