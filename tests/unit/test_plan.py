"""`--dry-run` plans a production job on one CPU process without weights or network."""

import dataclasses
from pathlib import Path

import pytest

from spmd_grpo.config.loader import load_config
from spmd_grpo.dry_run.plan import dry_run
from spmd_grpo.train import main as train_main

REPO = Path(__file__).resolve().parents[2]


def test_7b_geo3k_plan_for_4_nodes_x_8():
    cfg = load_config(REPO / "configs" / "qwen2_5_vl_7b_geo3k_grpo.yaml")
    plan = dry_run(cfg, nnodes=4, nproc_per_node=8)
    assert "world 32" in plan
    assert "8.29B parameters" in plan  # Qwen2.5-VL-7B-Instruct, built on the meta device
    assert "16 x TP 2" in plan and "[[0, 1], [2, 3]" in plan
    assert "rank 0: prompts 0..15" in plan and "rank 31: prompts 496..511" in plan
    assert "20 mini-batch(es) of 4 per rank" in plan
    assert "~16384 prompt + response tokens each (token budget)" in plan  # dynamic batching on
    assert "activations (estimate: 16384 tokens' layer inputs kept" in plan  # min(4 x 4096, 16384 + 4096)
    training = next(line for line in plan.splitlines() if "peak while training" in line)
    rollout = next(line for line in plan.splitlines() if "rollout: trainer state" in line)
    assert training.endswith("-> fits") and rollout.endswith("-> fits")
    assert "concurrent max-length" in plan


@pytest.mark.parametrize(
    "nproc, owners",
    [
        (1, "(rank 0: prompts 0..511);"),
        (2, "(rank 0: prompts 0..255; rank 1: prompts 256..511);"),
    ],
)
def test_the_prompt_owners_name_each_rank_of_a_small_world_once(nproc, owners):
    """At world 1 the plan named a rank 1 and rank 0 twice; at world 2 rank 1 twice."""
    cfg = load_config(
        REPO / "configs" / "qwen2_5_vl_7b_geo3k_grpo.yaml", ["worker.rollout.tensor_parallel_size=1"]
    )
    assert owners in dry_run(cfg, nnodes=1, nproc_per_node=nproc)


def test_fixed_count_micro_batches_are_planned_padded_to_the_longest():
    cfg = load_config(
        REPO / "configs" / "qwen2_5_vl_7b_geo3k_grpo.yaml",
        ["worker.actor.dynamic_batching=false", "worker.actor.shared_prompt=false"],  # 4 whole sequences
    )
    plan = dry_run(cfg, nnodes=1, nproc_per_node=8)
    assert "x 4 micro-batches of 4 x 1 epoch(s)" in plan and "input_ids [4, 4096]" in plan
    assert "activations (estimate: 16384 tokens' layer inputs kept" in plan


def test_a_token_budget_micro_batch_is_planned_at_its_budget_plus_one_sequence():
    """Balanced parts are not capped at the budget (as verl's): one can hold one more max-length sequence."""
    cfg = load_config(REPO / "configs" / "qwen2_5_vl_7b_geo3k_grpo.yaml")
    plan = dry_run(cfg, nnodes=1, nproc_per_node=8)  # 16 samples per rank and mini-batch
    assert "activations (estimate: 20480 tokens' layer inputs kept" in plan


def test_32b_on_8_devices_is_flagged_too_tight_for_training():
    cfg = load_config(
        REPO / "configs" / "qwen2_5_vl_7b_geo3k_grpo.yaml",
        [
            "worker.actor.model.model_path=Qwen/Qwen2.5-VL-32B-Instruct",
            "worker.rollout.tensor_parallel_size=4",
        ],
    )
    plan = dry_run(cfg, nnodes=1, nproc_per_node=8, device_memory_gb=80)
    assert "33.45B parameters" in plan
    assert "TOO TIGHT" in next(line for line in plan.splitlines() if "peak while training" in line)


def test_dry_run_cli_rejects_a_world_the_config_cannot_split(capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # in-process: a subprocess would pay torch's import again (seconds)
    with pytest.raises(SystemExit) as e:
        train_main(
            ["configs/qwen2_5_vl_7b_geo3k_grpo.yaml", "--dry-run", "--nnodes", "3", "--nproc-per-node", "7"]
        )
    assert e.value.code == 2
    assert (
        capsys.readouterr().err.strip()
        == "config error: data.rollout_batch_size (512) must be divisible by the world size (21)"
    )


def test_32b_config_fits_80gb_on_8_nodes_x_8_in_every_phase():
    cfg = load_config(REPO / "configs" / "qwen2_5_vl_32b_geo3k_grpo.yaml")
    plan = dry_run(cfg, nnodes=8, nproc_per_node=8, device_memory_gb=80)
    phases = [line for line in plan.splitlines() if line.startswith(("  load", "  peak while", "  rollout:"))]
    assert len(phases) == 3, plan
    assert all(line.endswith("fits") or "-> fits;" in line for line in phases), phases
    # The load phase never holds the whole model: ~2 GiB of shards + a slice, not 124.6 GiB of fp32.
    assert "policy shard 1.95" in plan and "the previous way: 124.6 GiB" in plan


@pytest.mark.parametrize(
    "config, params",
    [
        ("qwen3_vl_8b_geo3k_grpo.yaml", "8.77B parameters"),
        ("qwen2_vl_7b_geo3k_grpo.yaml", "8.29B parameters"),
    ],
)
def test_other_family_configs_fit_80gb_on_8_nodes_x_8(config, params):
    """Qwen3-VL-8B and Qwen2-VL-7B from the built-in published architectures; the counts are the published
    model sizes (8.77B, 8.29B), so a wrong table entry shows here."""
    plan = dry_run(load_config(REPO / "configs" / config), nnodes=8, nproc_per_node=8, device_memory_gb=80)
    assert "world 64" in plan and params in plan, plan
    phases = [line for line in plan.splitlines() if line.startswith(("  load", "  peak while", "  rollout:"))]
    assert len(phases) == 3 and all(line.endswith("fits") or "-> fits;" in line for line in phases), phases


def _phases(plan: str) -> list[str]:
    return [line for line in plan.splitlines() if line.startswith(("  load", "  peak while", "  rollout:"))]


@pytest.mark.parametrize(
    "config, nproc, memory_gb",
    [("qwen2_5_vl_72b_geo3k_grpo_lora.yaml", 8, 80), ("qwen2_5_vl_7b_geo3k_grpo_lora.yaml", 1, 24)],
)
def test_lora_configs_fit_72b_on_one_node_and_7b_on_one_24gb_device(config, nproc, memory_gb):
    """LoRA: the frozen base in bf16, fp32 adapters with adapter-only gradients and Adam state, no reference
    model; 72B fits 1 x 8 x 80 GB and 7B 1 x 1 x 24 GB. The same configs without LoRA do not."""
    cfg = load_config(REPO / "configs" / config)
    plan = dry_run(cfg, nnodes=1, nproc_per_node=nproc, device_memory_gb=memory_gb)
    phases = _phases(plan)
    assert len(phases) == 3 and all(line.endswith("fits") or "-> fits;" in line for line in phases), plan
    for item in (
        "policy: frozen base bfloat16 shard",
        "policy: LoRA adapters fp32 shard",
        "gradients fp32 shard (adapters only)",
        "AdamW states fp32 shard (adapters only)",
        "reference: none (the policy with its adapters disabled)",
    ):
        assert item in plan, item
    assert "LoRA: rank 16" in plan
    full = load_config(REPO / "configs" / config, ["worker.actor.model.lora.rank=0"])
    full_phases = _phases(dry_run(full, nnodes=1, nproc_per_node=nproc, device_memory_gb=memory_gb))
    assert not all(line.endswith("fits") or "-> fits;" in line for line in full_phases), full_phases


def test_dry_run_plans_the_shared_prompt_layout():
    """The plan states the shared layout's tokens per group (geometry3k 7B: prompt 2048, response 2048, n 5)
    and, when it is on, a fixed-count micro-batch's activations count each of its groups' prompt once."""
    base = ["worker.actor.dynamic_batching=false", "worker.actor.micro_batch_size_per_device_for_update=4"]
    cfg = load_config(REPO / "configs" / "qwen2_5_vl_7b_geo3k_grpo.yaml", base)
    npu = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, device="npu"))
    plans = {(on, c.trainer.device): dry_run(dataclasses.replace(c, worker=dataclasses.replace(c.worker, actor=dataclasses.replace(
        c.worker.actor, shared_prompt=on))), nnodes=1, nproc_per_node=8) for on in ("auto", True) for c in (cfg, npu)}  # fmt: skip
    d, n = cfg.data, cfg.worker.rollout.n
    tokens = f"holds {d.max_prompt_length + n * d.max_response_length} tokens instead of "
    off = plans["auto", "npu"]
    assert "shared_prompt=auto): off on Ascend NPUs" in off and tokens in off
    on = [plans["auto", "auto"], plans[True, "npu"], plans[True, "auto"]]
    assert "shared_prompt=auto): on;" in on[0] and all("shared_prompt=true): on;" in plan for plan in on[1:])
    micro = 4 * (d.max_prompt_length + d.max_response_length)  # 4 samples of at most 2 groups when shared
    shared = 2 * d.max_prompt_length + 4 * d.max_response_length
    assert f"estimate: {micro} tokens'" in off and all(f"estimate: {shared} tokens'" in plan for plan in on)


QWEN3_VL_30B = REPO / "configs" / "qwen3_vl_30b_a3b_geo3k_grpo.yaml"
MOE_235B = "worker.actor.model.model_path=Qwen/Qwen3-VL-235B-A22B-Instruct"
LORA = ["worker.actor.model.lora.rank=16", "worker.actor.model.lora.alpha=32", "worker.actor.optim.lr=1e-5"]


@pytest.mark.parametrize("ep", [1, 2, 8])
def test_the_shipped_30b_a3b_config_fits_one_node_of_8_x_80gb_at_any_ep(ep):
    plan = dry_run(
        load_config(QWEN3_VL_30B, [f"worker.actor.fsdp.expert_parallel_size={ep}"]),
        nnodes=1,
        nproc_per_node=8,
    )
    assert "31.07B parameters" in plan and f"a layer gathers {128 // ep} experts" in plan, plan
    phases = _phases(plan)
    assert len(phases) == 3 and all(line.endswith("fits") or "-> fits;" in line for line in phases), plan
    assert ("all-to-all buffers" in plan) == (ep > 1) and "DOES NOT FIT" not in plan


def test_expert_memory_per_ep_rank_scales_1_over_ep_and_a_ranks_shard_stays_experts_over_world():
    """Qwen3-VL-30B-A3B: 48 layers x 128 experts x (gate_up 2 x 768 x 2048 + down 2048 x 768). An EP rank holds
    128/EP experts, FSDP-sharded over 8/EP ranks: its shard is experts / 8 at every EP; what a rank gathers
    per layer is 128/EP experts."""
    from spmd_grpo.dry_run.counts import GiB, batches, count_parameters, model_config
    from spmd_grpo.dry_run.memory import train_memory

    per_layer = 128 * 3 * 2048 * 768
    model = count_parameters(model_config("Qwen/Qwen3-VL-30B-A3B-Instruct")[0])
    assert (model.layer_expert, model.num_expert) == (per_layer, 48 * per_layer)
    for ep in (1, 2, 4, 8):
        cfg = load_config(QWEN3_VL_30B, [f"worker.actor.fsdp.expert_parallel_size={ep}"])
        items = train_memory(cfg, model, batches(cfg, 8))
        master = next(v for k, v in items.items() if k.startswith("policy fp32 master shard, experts"))
        assert master == 4 * 48 * per_layer / 8  # the same at every EP
        assert f"E/EP = {128 // ep} per EP rank, FSDP over {8 // ep}" in " ".join(items)
        gathered = next(v for k, v in items.items() if k.startswith("gathered bf16 layer"))
        assert gathered == 2 * 2 * (model.layer_params - per_layer + per_layer / ep)
        plan = dry_run(cfg, nnodes=1, nproc_per_node=8)
        held = f"({48 * per_layer / ep / 1e9:.2f}B parameters, {16 * 48 * per_layer / ep / GiB:.1f} GiB at 16 bytes"
        assert held in plan, plan
    # all-to-all at EP > 1: the experience micro-batch (32768 + 4096 tokens) x top-8 x hidden 2048 bf16, x 4
    assert items[next(k for k in items if k.startswith("all-to-all"))] == 4 * 36864 * 8 * 2048 * 2


def test_an_expert_parallel_size_that_does_not_divide_the_experts_is_refused(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    world_24 = ["data.rollout_batch_size=480", "worker.actor.global_batch_size=240"]
    argv = [
        str(QWEN3_VL_30B),
        *world_24,
        "worker.actor.fsdp.expert_parallel_size=12",
        "--dry-run",
        "--nnodes",
        "3",
    ]
    with pytest.raises(SystemExit) as e:
        train_main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "config error: worker.actor.fsdp.expert_parallel_size=12 must divide the model's 128 experts "
        "(Qwen/Qwen3-VL-30B-A3B-Instruct: text_config.num_experts)"
    )
    with pytest.raises(SystemExit) as e:
        train_main(
            ["configs/qwen3_vl_8b_geo3k_grpo.yaml", "worker.actor.fsdp.expert_parallel_size=2", "--dry-run"]
        )
    assert e.value.code == 2 and "is a dense model (no experts to shard); set 1" in capsys.readouterr().err


def test_the_fewest_nodes_for_235b_a22b_are_the_arithmetics():
    """Qwen3-VL-235B-A22B (235.67B parameters) on 8 x 80 GiB nodes, the 30B config's recipe otherwise.
    Full fine-tuning: 16 bytes per parameter / world, plus the activations (12288 tokens x hidden 4096 x 94
    layers in bf16) and the logits chunk, must stay within 72 GiB: 56 ranks leave 16 x 235.67B / 56 = 62.8 GiB
    + 8.8 + 1.2 = 72.8 GiB, 64 ranks 54.9 + 8.8 + 1.2 + the gathered layer. LoRA: one node cannot hold the bf16
    base shard (2 x 235.67B / 8 = 54.9 GiB) beside vLLM's 48 GiB, nor can vLLM at TP 8 (54.9 GiB of weights);
    two nodes hold 27.4 + 48 = 75.4 GiB, vLLM at TP 16."""
    from spmd_grpo.dry_run.counts import GiB, count_parameters, model_config
    from spmd_grpo.dry_run.fewest_nodes import fewest_nodes

    n = count_parameters(model_config("Qwen/Qwen3-VL-235B-A22B-Instruct")[0]).num_params
    assert round(n / 1e9, 2) == 235.67
    fixed = (12288 * 4096 * 2 * 94 + 4 * 1024 * 151936 * 2) / GiB
    assert 16 * n / 56 / GiB + fixed > 0.9 * 80 > 16 * n / 64 / GiB + fixed
    assert 2 * n / 8 / GiB + 48 > 80 > 2 * n / 16 / GiB + 48
    full, lines = fewest_nodes(str(QWEN3_VL_30B), [MOE_235B])
    assert {c.nodes for c in full} == {8} and len(lines) == 8, lines
    assert lines[6].startswith("nodes 7 (world 56): best EP") and "training" in lines[6], lines
    lora, lines = fewest_nodes(str(QWEN3_VL_30B), [MOE_235B, *LORA])
    assert {(c.nodes, c.tp) for c in lora} == {(2, 16)} and {c.ep for c in lora} == {1, 2, 4, 8, 16}, lines


def test_the_moe_throughput_benchmark_runs_the_shipped_config_planned_to_fit_and_its_cpu_run_validates(
    tmp_path,
):
    """benchmarks/moe_step_throughput.py: its 8-GPU command trains the shipped 30B-A3B config as the file says
    (run control only), which `--dry-run` plans to fit 1 x 8 x 80 GB; its `--tiny` CPU command is valid for 2
    ranks. Its metrics reader runs on the shipped config's engine test (tests/engine/test_shipped_configs.py)."""
    from benchmarks.moe_step_throughput import CONFIG, command, overrides
    from spmd_grpo.config.validate import validate

    gpu = overrides(tiny=False, steps=3, output_dir=tmp_path)
    assert command(8, gpu)[-len(gpu) - 1 :] == [str(CONFIG), *gpu] and "--nproc_per_node" in command(8, gpu)
    assert all(o.startswith("trainer.") for o in gpu), gpu
    assert "DOES NOT FIT" not in dry_run(load_config(CONFIG, gpu), nnodes=1, nproc_per_node=8)
    tiny = overrides(
        tiny=True, steps=3, output_dir=tmp_path, model_path="/tiny", extra=["trainer.max_steps=2"]
    )
    assert "trainer.max_steps=2" in tiny and "trainer.max_steps=3" not in tiny
    validate(load_config(CONFIG, tiny), 2)
