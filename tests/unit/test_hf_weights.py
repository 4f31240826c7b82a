"""Reading an HF safetensors directory into (here unsharded) tensors: names, dtypes, sharded checkpoints, and
one-line errors naming the file and the tensor; and writing one, the LoRA export's merged weights. DCP runs
without a process group (a world of one)."""

import json
import warnings

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from spmd_grpo.models.families import QWEN2_5_VL
from spmd_grpo.models.weights import load_safetensors_into, weight_files

on_disk_name = QWEN2_5_VL.on_disk_name

TENSORS = {
    "model.embed_tokens.weight": torch.arange(24, dtype=torch.float32).reshape(6, 4) / 7,
    "model.layers.0.mlp.up_proj.weight": torch.linspace(-1, 1, 15).reshape(5, 3),
    "visual.blocks.0.norm1.weight": torch.tensor([0.5, 1.5, 2.5]),
    "lm_head.weight": torch.full((6, 4), 3.0),
}


def _model_state(dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Empty tensors under the in-memory names (what a sharded module's state_dict would give)."""
    names = {
        "model.language_model.embed_tokens.weight": (6, 4),
        "model.language_model.layers.0.mlp.up_proj.weight": (5, 3),
        "model.visual.blocks.0.norm1.weight": (3,),
        "lm_head.weight": (6, 4),
    }
    return {n: torch.full(shape, float("nan"), dtype=dtype) for n, shape in names.items()}


def _load(state, path):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        load_safetensors_into(state, path, name_map=on_disk_name)


def test_on_disk_names_of_qwen2_5_vl():
    assert (
        on_disk_name("model.language_model.layers.3.mlp.up_proj.weight")
        == "model.layers.3.mlp.up_proj.weight"
    )
    assert on_disk_name("model.visual.merger.mlp.0.weight") == "visual.merger.mlp.0.weight"
    assert on_disk_name("lm_head.weight") == "lm_head.weight"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_file_is_read_into_every_tensor_in_the_targets_dtype(tmp_path, dtype):
    save_file(TENSORS, str(tmp_path / "model.safetensors"))
    state = _model_state(dtype)
    _load(state, tmp_path)
    for name, t in state.items():
        assert t.dtype == dtype
        assert torch.equal(t, TENSORS[on_disk_name(name)].to(dtype)), name


def test_a_sharded_checkpoint_is_read_through_its_index(tmp_path):
    names = sorted(TENSORS)
    files = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for fname, keys in files.items():
        save_file({k: TENSORS[k] for k in keys}, str(tmp_path / fname))
    weight_map = {k: f for f, keys in files.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert [p.name for p in weight_files(tmp_path)] == sorted(files)
    state = _model_state(torch.bfloat16)
    _load(state, tmp_path)
    assert torch.equal(
        state["model.visual.blocks.0.norm1.weight"], TENSORS["visual.blocks.0.norm1.weight"].bfloat16()
    )


def test_missing_tensor_and_wrong_shape_are_one_line_errors(tmp_path):
    save_file(
        {k: v for k, v in TENSORS.items() if k != "lm_head.weight"}, str(tmp_path / "model.safetensors")
    )
    with pytest.raises(
        ValueError, match=r"1 tensor\(s\) of the model are in no \*\.safetensors file of .*lm_head"
    ):
        _load(_model_state(), tmp_path)
    state = {k: v for k, v in _model_state().items() if k != "lm_head.weight"}  # a tied model leaves it out
    _load(state, tmp_path)
    state["model.visual.blocks.0.norm1.weight"] = torch.empty(4)
    with pytest.raises(ValueError, match=r"visual.blocks.0.norm1.weight in .* has shape \[3\] but the model"):
        _load(state, tmp_path)


def test_a_broken_file_is_named(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(TENSORS, str(path))
    header = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    path.write_bytes(path.read_bytes()[: header + 8])  # header intact, data cut
    with pytest.raises(ValueError, match=r"cannot read the safetensors file .*model.safetensors: "):
        _load(_model_state(), tmp_path)


def test_a_failed_read_names_the_file_and_the_tensor(tmp_path, monkeypatch):
    """DCP wraps a reader's error in a CheckpointException (a BaseException); it comes out a RuntimeError."""
    from spmd_grpo.models.weights import SliceReader

    def fail(*args):
        raise OSError("Input/output error")

    save_file(TENSORS, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(SliceReader, "_read_item", staticmethod(fail))
    with pytest.raises(
        RuntimeError, match=r"failed on rank 0: reading \S+ from \S+model.safetensors: Input/output"
    ):
        _load(_model_state(), tmp_path)


def test_directories_without_weights_or_with_a_broken_index(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors in"):
        weight_files(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-1.safetensors"}})
    )
    with pytest.raises(FileNotFoundError, match="names files that are not in .*model-1.safetensors"):
        weight_files(tmp_path)


def test_unknown_non_persistent_buffers_are_refused():
    from spmd_grpo.models.build import init_non_persistent_buffers

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.zeros(2), persistent=False)

    with pytest.raises(NotImplementedError, match=r"non-persistent buffers \['table'\] of odd"):
        init_non_persistent_buffers(nn.ModuleDict({"odd": Odd()}), torch.device("cpu"))


def test_a_bf16_merged_lora_export_merges_the_fp32_adapters_as_the_weight_push_does(tmp_path):
    """`export --merged --dtype bfloat16` writes bf16(W + alpha / r * B @ A) from the saved fp32 adapters, the
    merged weight push's computation (`lora.merged_weight`), bit for bit; merging adapters already rounded to
    bf16 moved 21 % of the weights by one bf16 step here (adapter delta 0.28 of |W|). The adapter file itself
    is in --dtype."""
    import torch.distributed.checkpoint as dcp
    import yaml
    from safetensors import safe_open

    from spmd_grpo.models.lora import merged_weight
    from spmd_grpo.run.export_lora import export_adapter

    base, ckpt, rank, alpha = tmp_path / "base", tmp_path / "ckpt", 8, 16.0
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 64, generator=g) * 0.02).bfloat16()
    save_file({"model.layers.0.self_attn.q_proj.weight": w}, base / "model.safetensors")
    a, b = torch.randn(rank, 64, generator=g) * 0.1, torch.randn(64, rank, generator=g) * 0.01
    layer = "hf.model.language_model.layers.0.self_attn.q_proj"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        adapters = {f"{layer}.lora_A.default.weight": a, f"{layer}.lora_B.default.weight": b}
        dcp.save({"model": adapters}, checkpoint_id=str(ckpt), no_dist=True)
    lora = {"rank": rank, "alpha": alpha, "dropout": 0.0}
    (ckpt / "config.yaml").write_text(yaml.safe_dump({"worker": {"actor": {"model": {"lora": lora}}}}))

    out, merged = tmp_path / "adapter", tmp_path / "merged"
    export_adapter(ckpt, out, torch.bfloat16, model_path=str(base), src=base, merged=merged)

    with safe_open(str(merged / "model.safetensors"), "pt") as f:
        got = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert torch.equal(got, merged_weight(w, (a, b, alpha / rank)))
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118


def test_a_merged_weight_is_computed_where_the_gathered_base_is():
    """With `fsdp.offload_params` on an accelerator the weight push gathers the base on the accelerator while
    the adapters' shards stay in host memory: the merge must bring the adapters to the base. (This machine
    has no accelerator: the base is on `meta` here, the adapters on the CPU.)"""
    from spmd_grpo.models.lora import merged_weight

    base = torch.empty(6, 5, dtype=torch.bfloat16, device="meta")
    a, b = torch.ones(2, 5), torch.ones(6, 2)
    merged = merged_weight(base, (a, b, 0.5))
    assert merged.device.type == "meta" and merged.dtype == torch.bfloat16 and merged.shape == (6, 5)


def test_the_export_copies_the_tokenizer_and_chat_template_the_run_trained_with(tmp_path):
    """A run with `worker.actor.model.tokenizer_path` tokenised its prompts (chat template included) with
    that directory's files: the export takes them from there, and the model's own configs from the base."""
    import torch.distributed.checkpoint as dcp
    import yaml

    from spmd_grpo.run.export import export_hf
    from tests.conftest import checkpoint_stand_in

    base = checkpoint_stand_in(tmp_path / "base")
    (base / "generation_config.json").write_text('{"eos_token_id": 1}')
    tokenizer = checkpoint_stand_in(tmp_path / "tokenizer", '{"model_type": "other"}')
    (tokenizer / "chat_template.jinja").write_text("{{ 'the run' }}")
    (tokenizer / "tokenizer.json").write_text('{"run": 1}')
    (tokenizer / "generation_config.json").write_text('{"eos_token_id": 2}')
    ckpt = tmp_path / "global_step_1"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        dcp.save({"model": {"hf.weight": torch.ones(1)}}, checkpoint_id=str(ckpt), no_dist=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1, "model_path": str(base)}))
    saved = {"worker": {"actor": {"model": {"model_path": str(base), "tokenizer_path": str(tokenizer)}}}}
    (ckpt / "config.yaml").write_text(yaml.safe_dump(saved))

    out = export_hf(ckpt, tmp_path / "hf", "float32")
    assert (out / "chat_template.jinja").read_text() == "{{ 'the run' }}"
    assert (out / "tokenizer.json").read_text() == '{"run": 1}'
    assert (out / "generation_config.json").read_text() == '{"eos_token_id": 1}'
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2_5_vl"


def test_a_merged_export_from_a_hub_model_path_fetches_the_base_weights(tmp_path, monkeypatch):
    """A run whose model_path is a hub id: the adapter export needs only the base's configs, but `--merged`
    reads its weights, so the snapshot must include them (the hub cannot be reached here: a local directory
    stands in for it, serving the files the patterns ask for)."""
    import fnmatch
    import shutil

    import huggingface_hub
    import torch.distributed.checkpoint as dcp
    import yaml
    from safetensors import safe_open

    from spmd_grpo.run.export import export_hf

    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    save_file({"model.layers.0.self_attn.q_proj.weight": w}, hub / "model.safetensors")

    def snapshot_download(repo_id, allow_patterns):
        snapshot = tmp_path / "snapshot"
        snapshot.mkdir(exist_ok=True)
        for f in hub.iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy2(f, snapshot / f.name)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    ckpt = tmp_path / "global_step_1"
    a, b = torch.ones(2, 8), torch.ones(8, 2)
    layer = "hf.model.language_model.layers.0.self_attn.q_proj"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        adapters = {f"{layer}.lora_A.default.weight": a, f"{layer}.lora_B.default.weight": b}
        dcp.save({"model": adapters}, checkpoint_id=str(ckpt), no_dist=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1, "model_path": "org/tiny"}))
    lora = {"rank": 2, "alpha": 2.0, "dropout": 0.0}
    (ckpt / "config.yaml").write_text(yaml.safe_dump({"worker": {"actor": {"model": {"lora": lora}}}}))

    export_hf(ckpt, tmp_path / "adapter", "float32", merged=tmp_path / "merged")
    with safe_open(str(tmp_path / "merged" / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("model.layers.0.self_attn.q_proj.weight"), w + b @ a)
