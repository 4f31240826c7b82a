"""Policy and reference are built on the meta device, sharded, then filled from the checkpoint (each rank
reading only its rows): the result must be bit-identical to transformers' `from_pretrained` in fp32, at
world 1 and world 2, with tied and untied embeddings (tests/jobs/model_load.py does the building).

Two torchrun launches (world 1 and world 2) cover both models, the policy, the reference and CPU offload;
the world-1 launch also builds a checkpoint that ships its own classes, with `trust_remote_code` off and on.
"""

import json
import shutil

import pytest
import torch

from tests.conftest import tiny_model, torchrun

JOB = "tests/jobs/model_load.py"
WORLDS = [1, 2]
MODELS = ["tied", "untied"]
ROTARY = {
    "model.language_model.rotary_emb.inv_freq",
    "model.language_model.rotary_emb.original_inv_freq",
    "model.visual.rotary_pos_emb.inv_freq",
    "model.visual.rotary_pos_emb.original_inv_freq",
}


NEW_FAMILIES = ["qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"]
"""Policy and LoRA checks only (`--policy-and-lora`): their experts are read from the file's layout."""


REMOTE_CONFIG = """from transformers import Qwen2_5_VLConfig


class RemoteQwen2_5_VLConfig(Qwen2_5_VLConfig):
    pass
"""
REMOTE_MODEL = """from transformers import Qwen2_5_VLForConditionalGeneration

from .configuration_remote import RemoteQwen2_5_VLConfig


class RemoteQwen2_5_VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    config_class = RemoteQwen2_5_VLConfig
"""


def remote_code_checkpoint(model_dir, root):
    """A copy of `model_dir` whose config and model classes live in the checkpoint (`auto_map`), as
    remote-code models ship them; loaded without trust, transformers' own Qwen2.5-VL classes serve it."""
    shutil.copytree(model_dir, root)
    (root / "configuration_remote.py").write_text(REMOTE_CONFIG)
    (root / "modeling_remote.py").write_text(REMOTE_MODEL)
    config = json.loads((root / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "configuration_remote.RemoteQwen2_5_VLConfig",
        "AutoModelForImageTextToText": "modeling_remote.RemoteQwen2_5_VLForConditionalGeneration",
    }
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def results(tiny_tied, tiny_untied, tmp_path_factory):
    """{(world, "tied" | "untied" | family): the job's checks for that model, (1, "remote_code"): the
    classes}."""
    out = {}
    work = tmp_path_factory.mktemp("load")
    families = {f: tiny_model(family=f) for f in NEW_FAMILIES}
    remote = remote_code_checkpoint(tiny_untied, work / "remote")
    for world in WORLDS:
        path = work / f"w{world}.pt"
        job = [JOB, str(path), str(tiny_tied), str(tiny_untied)]
        job += ["--remote-code", str(remote)] if world == 1 else []
        job += ["--policy-and-lora", *map(str, families.values())]
        torchrun(job, nproc=world, env={"HF_MODULES_CACHE": str(work / "modules")})
        saved = torch.load(path)
        assert saved["world_size"] == world
        out[world, "tied"], out[world, "untied"] = saved[tiny_tied.name], saved[tiny_untied.name]
        out.update({(world, f): saved[d.name] for f, d in families.items()})
    out[1, "remote_code"] = torch.load(work / "w1.pt")["remote_code"]
    return out


def test_trust_remote_code_reaches_the_model_build(results):
    """`worker.actor.model.trust_remote_code` as `build_policy` reads it: on, the checkpoint's own classes
    are built; off, transformers' own."""
    assert results[1, "remote_code"] == {
        False: ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig"),
        True: ("RemoteQwen2_5_VLForConditionalGeneration", "RemoteQwen2_5_VLConfig"),
    }


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("model", MODELS)
def test_policy_is_bit_identical_to_from_pretrained(results, world, model):
    r = results[world, model]
    assert r["tied"] == (model == "tied") == r["policy_tied"]
    assert r["policy_checked"] >= 60 and set(r["rotary_buffers"]) == ROTARY
    assert r["policy_mismatches"] == []  # every parameter (gathered) and buffer, dtype included
    assert r["policy_dtypes"] == ["torch.float32"]  # fp32 master weights
    assert r["policy_logits_equal"] and r["policy_logprobs_equal"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("model", MODELS)
def test_reference_is_built_in_its_dtype_and_equals_from_pretrained_in_it(results, world, model):
    r = results[world, model]
    assert r["ref_dtypes"] == ["torch.bfloat16"] and not r["ref_requires_grad"]
    assert r["ref_mismatches"] == []
    assert r["ref_logprobs_equal"], r["ref_logprobs_max_diff"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("model", MODELS)
def test_cpu_offload_works_on_cpu_and_changes_no_number(results, world, model):
    r = results[world, model]
    assert r["ref_offload_logprobs_equal"] and r["ref_offload_on_host"]
    assert r["policy_offload_mismatches"] == []
    assert r["policy_step_changed"] == r["policy_trainable"] > 0  # the step moved every trainable tensor


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("model", MODELS)
def test_lora_gradients_equal_single_process_peft(results, world, model):
    r = results[world, model]
    assert r["lora_names_match"]
    assert r["lora_grad_max"] > 1e-3  # both A and B get real gradients (B was made non-zero)
    assert r["lora_grad_max_diff"] <= 1e-5 * max(1.0, r["lora_grad_max"]), r["lora_grad_max_diff"]
    ours, theirs = r["lora_grad_norm"]
    assert abs(ours - theirs) <= 1e-5 * theirs  # actor/grad_norm covers exactly the adapters
    num_opt, num_adapters = r["lora_optimizer_tensors"]
    assert num_opt == num_adapters > 0  # Adam state for adapters only
    assert r["lora_base_mismatches"] == []  # the frozen base loads through the peft-wrapped names
    assert r["lora_disabled_equals_base"] and r["lora_enabled_differs"]  # the KL reference is the base
    # fsdp.param_dtype=bfloat16: frozen base in bf16, trainable adapters in fp32
    assert r["lora_bf16_dtypes"] == [("torch.bfloat16", False, False), ("torch.float32", True, True)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_moe_and_hybrid_policies_load_bit_identical_and_lora_skips_the_experts(results, world, family):
    """The stacked experts are read from the file's layout (Qwen3-VL-MoE: transposed; Qwen3.5-MoE: one tensor
    per expert), each rank its own experts, into exactly what `from_pretrained` holds. LoRA adapts the
    nn.Linear layers only: attention (and Qwen3.5's linear-attention projections, the shared expert), never
    the routed experts (3-D parameters) or the router, and matches single-process PEFT."""
    r = results[world, family]
    assert r["policy_mismatches"] == [] and r["policy_checked"] >= 60
    assert r["policy_logits_equal"] and r["policy_logprobs_equal"]
    assert r["lora_names_match"] and r["lora_grad_max_diff"] <= 1e-5 * max(1.0, r["lora_grad_max"])
    assert r["lora_base_mismatches"] == [] and r["lora_disabled_equals_base"]
    kinds = {t.rsplit(".", 1)[-1] for t in r["lora_targets"]}
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= kinds
    assert not any(".experts." in t or t.endswith("mlp.gate") for t in r["lora_targets"])
    if family != "qwen3_vl_moe":
        assert {"in_proj_qkv", "in_proj_z", "out_proj"} <= kinds
    if family == "qwen3_5_moe":
        assert {"gate_proj", "up_proj", "down_proj", "shared_expert_gate"} <= kinds  # the shared expert
