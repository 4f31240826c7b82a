"""Checkpoint / resume under real torchrun (gloo, CPU, FSDP2 policy, AdamW): exact resume at the same world
size, resharded resume at another one, an expert-parallel MoE checkpoint resumed without expert
parallelism, and a corrupted shard found by the checksums the ranks verify together after the start (the
previous checkpoint taken on every rank). The job is tests/jobs/checkpoint_roundtrip.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from spmd_grpo.config.loader import load_config
from spmd_grpo.run.checkpoint_dirs import damaged_parts
from spmd_grpo.run.manifest import file_entries, listed_files, shares, write_manifest
from spmd_grpo.run.saved_config import dump_yaml
from tests.conftest import CHECKPOINT_JOB, tiny_model, torchrun
from tests.jobs.checkpoint_roundtrip import verify_overrides


@pytest.fixture(scope="module")
def saved(tiny_untied, saved_checkpoints):
    """World 2: two optimizer steps, saved after each (save_limit=1), then the uninterrupted step 3."""
    work = saved_checkpoints(tiny_untied)
    return work, torch.load(work / "save.pt", weights_only=False)


def corrupted_run(saved, tiny_untied) -> tuple[Path, Path]:
    """A run directory holding the saved step-2 checkpoint twice, as global_step_2 and global_step_4 (each
    with the config of the job's `--verify` start, so that nothing changed), with one byte flipped in the
    newest one's shard that rank 1 of 2 checksums (rank 0 never reads it). Returns (run dir, that shard)."""
    work, _ = saved
    run = work / "corrupted" / "run"
    cfg = load_config(None, verify_overrides(tiny_untied, run))
    for step in (2, 4):
        ckpt = shutil.copytree(
            work / "run" / "checkpoints" / "global_step_2", run / "checkpoints" / f"global_step_{step}"
        )
        dump_yaml(cfg, ckpt / "config.yaml")
        entries = json.loads((ckpt / "manifest.json").read_text())["files"]
        write_manifest(ckpt, {**entries, **file_entries(ckpt, ["config.yaml"])})
    (run / "checkpoints" / "latest").write_text("global_step_4")
    newest = run / "checkpoints" / "global_step_4"
    rank0, rank1 = shares(listed_files(newest), 2)
    name = next(name for name, _, _ in rank1 if name.endswith(".distcp"))
    assert name not in {n for n, _, _ in rank0}
    data = bytearray((newest / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (newest / name).write_bytes(bytes(data))
    return run, newest / name


@pytest.fixture(scope="module")
def resumed(saved, tiny_untied, saved_checkpoints) -> dict:
    """{(case, nproc): what the resume recorded}, one launch per world size for both cases: "dense" (the
    Qwen2.5-VL checkpoint) and "moe" (Qwen3-VL-MoE saved at expert_parallel_size=2, resumed at 1); and
    ("verify", nproc): the start on `corrupted_run` (the job's `--verify`), with the corrupted shard."""
    moe = tiny_model(family="qwen3_vl_moe")
    cases = {"dense": (tiny_untied, saved[0]), "moe": (moe, saved_checkpoints(moe))}
    run, shard = corrupted_run(saved, tiny_untied)
    out = {"corrupted": (run, shard)}
    for nproc in (2, 1):
        job = [CHECKPOINT_JOB, "--phase", "resume"]
        job += ["--verify", str(tiny_untied), str(run), str(run.parent / f"verify{nproc}.pt")]
        for model_dir, work in cases.values():
            job += ["--case", str(model_dir), str(work / "run"), str(work / f"resume{nproc}.pt"), "0", "1"]
        torchrun(job, nproc=nproc)
        for case, (_, work) in cases.items():
            out[case, nproc] = torch.load(work / f"resume{nproc}.pt", weights_only=False)
        out["verify", nproc] = torch.load(run.parent / f"verify{nproc}.pt", weights_only=False)
    return out


def assert_same_training_state(ref: dict, got: dict) -> None:
    for key in ("params", "exp_avg", "exp_avg_sq"):
        assert ref[key].keys() == got[key].keys() and ref[key], key
        for name, t in ref[key].items():
            assert torch.equal(t, got[key][name]), f"{key} {name}"
    assert got["adam_step"] == ref["adam_step"]
    assert set(ref["adam_step"].values()) == {2.0}
    assert got["lr"] == ref["lr"] and got["scheduler_last_epoch"] == ref["scheduler_last_epoch"] == 2


def test_saved_directory_layout(saved):
    work, _ = saved
    root = work / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["global_step_2", "latest"]  # step 1 pruned
    assert (root / "latest").read_text() == "global_step_2"
    files = {p.relative_to(root / "global_step_2").as_posix() for p in (root / "global_step_2").rglob("*")}
    assert {".metadata", "scheduler.pt", "trainer_state.json", "rng/rank0.pt", "rng/rank1.pt"} <= files
    assert sum(f.endswith(".distcp") for f in files) == 2  # one shard file per rank
    # The manifest lists every file both ranks wrote (each checksummed its own), and they match it.
    ckpt = root / "global_step_2"
    listed = set(json.loads((ckpt / "manifest.json").read_text())["files"])
    assert listed == {f for f in files if (ckpt / f).is_file()} - {"trainer_state.json", "manifest.json"}
    assert damaged_parts(ckpt) == []
    copy = shutil.copytree(ckpt, work / "damaged" / "checkpoints" / "global_step_2")
    (copy / "rng" / "rank1.pt").unlink()  # rank 1's RNG file: named, not passed over
    assert damaged_parts(copy) == [f"{copy / 'rng' / 'rank1.pt'}: missing"]


def test_resume_same_world_continues_exactly(saved, resumed, tiny_untied):
    _, ref = saved
    got = resumed["dense", 2]
    state = got["trainer_state"]
    assert state["step"] == 2 and state["policy_version"] == 2 and state["world_size"] == 2
    assert state["sampler"]["position"] == 2 and state["model_path"] == str(tiny_untied)
    assert_same_training_state(ref["at_save"], got["at_save"])
    assert got["next_prompts"] == ref["next_prompts"]  # the data order continues where it stopped
    assert got["rng_probe"] == ref["rng_probe"]  # RNG streams restored
    # One more identical step: bitwise the uninterrupted run (same world size, same reduction order).
    for name, t in ref["params_after"].items():
        assert torch.equal(t, got["params_after"][name]), name
    assert any(not torch.equal(t, ref["at_save"]["params"][n]) for n, t in ref["params_after"].items())


def test_resume_at_world_one_reshards(saved, resumed):
    _, ref = saved
    got = resumed["dense", 1]
    assert got["world_size"] == 1 and got["trainer_state"]["world_size"] == 2
    assert_same_training_state(ref["at_save"], got["at_save"])
    assert got["next_prompts"] == ref["next_prompts"]
    # A different world size reduces gradients in another order: equal up to rounding.
    for name, t in ref["params_after"].items():
        torch.testing.assert_close(got["params_after"][name], t, rtol=0, atol=1e-5, msg=name)


def test_lora_checkpoint_holds_adapters_only_and_resumes_at_world_one(
    tiny_untied, tiny_tied, saved_checkpoints
):
    """LoRA: the checkpoint holds the adapters and their Adam state, nothing of the frozen base; a resume at
    another world size restores them exactly (the base comes from model_path). Also with tied embeddings:
    the frozen head is the input embedding under a second name, which `ignore_frozen_params` left in the
    state dict, so the head was saved whole and the checkpoint read as full fine-tuning (a resume with the
    same config refused, the export a model of adapters and head)."""
    import torch.distributed.checkpoint as dcp

    from spmd_grpo.models.lora import is_adapter_name
    from spmd_grpo.run.checkpoint_dirs import saved_lora_rank

    works = {model: saved_checkpoints(model, lora_rank=4) for model in (tiny_untied, tiny_tied)}
    job = [CHECKPOINT_JOB, "--phase", "resume"]  # both models in one launch
    for model, work in works.items():
        job += ["--case", str(model), str(work / "run"), str(work / "resume1.pt"), "4", "1"]
    torchrun(job, nproc=1)
    for work in works.values():
        ref = torch.load(work / "save.pt", weights_only=False)
        ckpt = work / "run/checkpoints/global_step_2"
        keys = list(dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
        model_keys = [k for k in keys if k.startswith("model.")]
        optim_keys = [k for k in keys if k.startswith("optim.state.")]
        assert model_keys and all(is_adapter_name(k) for k in model_keys), [
            k for k in model_keys if not is_adapter_name(k)
        ][:5]
        assert optim_keys and all(is_adapter_name(k) for k in optim_keys), optim_keys[:5]
        assert len(optim_keys) == 3 * len(model_keys)  # exp_avg, exp_avg_sq, step per adapter tensor
        assert saved_lora_rank(ckpt) == 4  # what a resume's start checks against lora.rank
        assert set(ref["at_save"]["exp_avg"]) == {
            hf for hf in ref["at_save"]["params"] if is_adapter_name(hf)
        }
        got = torch.load(work / "resume1.pt", weights_only=False)
        assert_same_training_state(ref["at_save"], got["at_save"])
        for name, t in ref["params_after"].items():
            torch.testing.assert_close(got["params_after"][name], t, rtol=0, atol=1e-5, msg=name)
        moved = [n for n, t in ref["params_after"].items() if not torch.equal(t, ref["at_save"]["params"][n])]
        assert moved and all(is_adapter_name(n) for n in moved)  # only adapters train


@pytest.mark.parametrize("nproc", [2, 1])
def test_expert_parallel_checkpoint_resumes_without_expert_parallelism(saved_checkpoints, resumed, nproc):
    """Saved at expert_parallel_size=2 (each rank 4 of the 8 experts, 2-D DTensors), resumed at EP=1 on 2
    ranks (experts FSDP-sharded by rows) and on 1: the same weights, Adam moments and schedule, and the
    next step agrees to rounding (another reduction order)."""
    ref = torch.load(saved_checkpoints(tiny_model(family="qwen3_vl_moe")) / "save.pt", weights_only=False)
    got = resumed["moe", nproc]
    assert got["trainer_state"]["world_size"] == 2 and got["world_size"] == nproc
    assert any(n.endswith("experts.gate_up_proj") for n in ref["at_save"]["exp_avg"])
    assert_same_training_state(ref["at_save"], got["at_save"])
    for name, t in ref["params_after"].items():
        torch.testing.assert_close(got["params_after"][name], t, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("nproc", [2, 1])
def test_a_corrupted_shard_is_found_by_the_rank_that_reads_it_and_every_rank_falls_back(resumed, nproc):
    """The flipped byte keeps the shard's size, so every rank's plan before the process group takes the
    newest checkpoint; after it the ranks checksum their shares (at 2 ranks the shard is rank 1's alone),
    rank 0 names it once, and every rank takes the previous checkpoint, the damaged one its abandoned branch."""
    run, shard = resumed["corrupted"]
    got = resumed["verify", nproc]
    assert got["world_size"] == nproc and len(got["views"]) == nproc
    ckpts = run / "checkpoints"
    for rank, (planned, chosen, abandoned, changes, said) in enumerate(got["views"]):
        assert planned == ckpts / "global_step_4", rank  # sizes and headers only
        assert chosen == ckpts / "global_step_2" and abandoned == (ckpts / "global_step_4",), rank
        assert changes == [], rank
        skipped = [line for line in said if "skipping damaged" in line]
        if rank == 0:
            assert len(skipped) == 1, said
            assert skipped[0].startswith(f"rank 0: skipping damaged checkpoint {ckpts / 'global_step_4'}: ")
            assert f"{shard}: CRC-32 " in skipped[0] and skipped[0].endswith("(corrupted)"), skipped
        else:
            assert skipped == [], said  # rank 0 says it, once
