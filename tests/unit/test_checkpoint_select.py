"""Checkpoint bookkeeping without torchrun: completeness rule, `find_checkpoint`, pruning, same-step reruns,
and a save/load round trip of a small plain module in one process (DCP's no-process-group path)."""

from __future__ import annotations

import json
import logging
import os
import random
import warnings
import zlib
from pathlib import Path

import pytest
import torch
from torch import nn

from spmd_grpo.actor.optimizer import OptimizerBundle
from spmd_grpo.run.checkpoint import (
    UnreadableCheckpoint,
    load_checkpoint,
    load_or_fall_back,
    save_checkpoint,
)
from spmd_grpo.run.checkpoint_dirs import damaged_parts, find_checkpoint, missing_parts
from spmd_grpo.run.manifest import file_crc32
from tests.conftest import ONE_CPU_RANK, fake_checkpoint


@pytest.fixture(autouse=True)
def _quiet_dcp():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def make_bundle(seed: int) -> tuple[nn.Module, OptimizerBundle]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    return model, OptimizerBundle(opt, sched)


def train(model: nn.Module, optim: OptimizerBundle, steps: int) -> None:
    x = torch.linspace(-1, 1, 12).reshape(3, 4)
    for _ in range(steps):
        model(x).square().sum().backward()
        optim.optimizer.step()
        optim.scheduler.step()
        optim.optimizer.zero_grad()


def save(model, optim, run_dir: Path, step: int, save_limit: int = 0) -> Path:
    return save_checkpoint(
        run_dir,
        step,
        policy=model,
        optim=optim,
        trainer_state={"step": step, "sampler": {"epoch": 0, "position": step}},
        world=ONE_CPU_RANK,
        save_limit=save_limit,
        model_path="/models/base",
    )


def test_auto_picks_newest_complete_and_warns_about_the_rest(tmp_path, caplog):
    fake_checkpoint(tmp_path, "global_step_3")
    fake_checkpoint(tmp_path, "global_step_5")
    fake_checkpoint(tmp_path, "global_step_7", complete=False)  # killed after DCP, before trainer_state.json
    fake_checkpoint(tmp_path, "global_step_9.tmp")  # killed mid-save
    (tmp_path / "checkpoints" / "latest").write_text("global_step_5")
    with caplog.at_level(logging.WARNING, logger="spmd_grpo.run.checkpoint_dirs"):
        assert find_checkpoint(tmp_path, "auto") == tmp_path / "checkpoints" / "global_step_5"
    warned = [r.getMessage() for r in caplog.records if r.name == "spmd_grpo.run.checkpoint_dirs"]
    damage = "\n".join(w for w in warned if "unverified" not in w)  # these fakes have no manifest
    assert "global_step_9.tmp" in damage and "global_step_7" in damage and "trainer_state.json" in damage
    assert "global_step_5" not in damage and "global_step_3" not in damage


def test_auto_prefers_newest_over_a_stale_latest(tmp_path, caplog):
    fake_checkpoint(tmp_path, "global_step_10")
    fake_checkpoint(tmp_path, "global_step_2")  # numeric, not lexicographic order
    (tmp_path / "checkpoints" / "latest").write_text("global_step_2")
    with caplog.at_level(logging.WARNING, logger="spmd_grpo.run.checkpoint_dirs"):
        assert find_checkpoint(tmp_path, "auto").name == "global_step_10"
    assert "latest" in caplog.text


def test_none_and_nothing_to_resume(tmp_path):
    fake_checkpoint(tmp_path, "global_step_1")
    assert find_checkpoint(tmp_path, "none") is None
    assert find_checkpoint(tmp_path / "elsewhere", "auto") is None
    fake_checkpoint(tmp_path / "b", "global_step_4.tmp")
    assert find_checkpoint(tmp_path / "b", "auto") is None


def test_explicit_path_is_validated(tmp_path):
    good = fake_checkpoint(tmp_path, "global_step_4")
    assert find_checkpoint(tmp_path, str(good)) == good
    cases = {
        str(tmp_path / "nope"): "directory",
        str(fake_checkpoint(tmp_path, "global_step_6.tmp")): ".tmp",
        str(fake_checkpoint(tmp_path, "global_step_8", complete=False)): "trainer_state.json",
    }
    for path, what in cases.items():
        with pytest.raises(ValueError, match="missing") as e:
            find_checkpoint(tmp_path, path)
        assert path in str(e.value) and what in str(e.value)
    assert missing_parts(good) == []


def test_round_trip_prune_and_rerun(tmp_path):
    model, optim = make_bundle(0)
    root = tmp_path / "checkpoints"
    fake_checkpoint(tmp_path, "global_step_3.tmp")  # a killed save of step 3: replaced, never "pruned"
    for step in range(1, 5):
        train(model, optim, 1)
        save(model, optim, tmp_path, step, save_limit=2)
    names = sorted(p.name for p in root.iterdir())
    assert names == ["global_step_3", "global_step_4", "latest"]
    assert (root / "latest").read_text() == "global_step_4"
    assert not missing_parts(root / "global_step_4")
    state = json.loads((root / "global_step_4" / "trainer_state.json").read_text())
    assert state == {
        "step": 4,
        "sampler": {"epoch": 0, "position": 4},
        "world_size": 1,
        "model_path": "/models/base",
    }

    # Saving the same step again (a rerun) replaces the complete directory and leaves nothing behind.
    (root / "global_step_4" / "from_the_first_save").touch()
    save(model, optim, tmp_path, 4, save_limit=2)
    assert not (root / "global_step_4" / "from_the_first_save").exists()
    assert sorted(p.name for p in root.iterdir()) == names
    expected_torch, expected_python = torch.rand(3).tolist(), random.random()

    fresh, fresh_optim = make_bundle(1)
    loaded = load_checkpoint(
        find_checkpoint(tmp_path, "auto"), policy=fresh, optim=fresh_optim, world=ONE_CPU_RANK
    )
    assert loaded == state
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(optim.optimizer.state[p]["exp_avg"], fresh_optim.optimizer.state[q]["exp_avg"])
    assert fresh_optim.scheduler.last_epoch == optim.scheduler.last_epoch == 4
    assert fresh_optim.optimizer.param_groups[0]["lr"] == optim.optimizer.param_groups[0]["lr"]
    assert optim.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 5)
    # Same world size: the RNG streams continue where the save left them.
    assert torch.rand(3).tolist() == expected_torch and random.random() == expected_python


def test_mismatched_model_and_bad_trainer_state_fail_clearly(tmp_path):
    model, optim = make_bundle(0)
    train(model, optim, 1)
    with pytest.raises(TypeError):  # not JSON: fails before anything is written
        save_checkpoint(
            tmp_path,
            1,
            policy=model,
            optim=optim,
            trainer_state={"t": torch.zeros(1)},
            world=ONE_CPU_RANK,
            save_limit=0,
            model_path="m",
        )
    assert not (tmp_path / "checkpoints").exists()
    path = save(model, optim, tmp_path, 1)
    other = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2), nn.Linear(2, 2))
    opt = torch.optim.AdamW(other.parameters())
    bundle = OptimizerBundle(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    with pytest.raises(ValueError, match="lacks .* entries"):
        load_checkpoint(path, policy=other, optim=bundle, world=ONE_CPU_RANK)
    # another size of the same layers: DCP's size mismatch was read as damage ("its DCP shards failed to load")
    wider = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(wider.parameters())
    bundle = OptimizerBundle(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    with pytest.raises(ValueError) as e:
        load_or_fall_back(path, policy=wider, optim=bundle, world=ONE_CPU_RANK, auto=True)
    assert type(e.value) is ValueError, e.value  # not UnreadableCheckpoint: no checkpoint is damaged
    assert str(e.value) == (
        f"checkpoint {path} holds model.0.weight of shape [8, 4], this policy's is [16, 4]: it was saved from "
        "another model than worker.actor.model.model_path builds"
    )


class _Payload:
    """What a tampered checkpoint could carry: unpickling it would call `os.system`."""

    def __reduce__(self):
        import os

        return (os.system, ("echo pwned > /dev/null",))


@pytest.mark.parametrize("victim", ["scheduler.pt", "rng/rank0.pt"])
def test_a_pickled_payload_in_a_checkpoint_is_refused(tmp_path, victim):
    model, optim = make_bundle(0)
    train(model, optim, 1)
    path = save(model, optim, tmp_path, 1)
    torch.save({"state": _Payload()}, path / victim)
    with pytest.raises(ValueError, match=f"{victim}: refused to load"):
        load_checkpoint(path, policy=model, optim=optim, world=ONE_CPU_RANK)


DAMAGES = [
    "truncated shard",
    "bad json",
    "torn metadata",
    "flipped byte",
    "scheduler rewritten",
    "no rng file",
]


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_newest_checkpoint_is_named_and_the_previous_one_used(tmp_path, damage, caplog):
    model, optim = make_bundle(0)
    for step in (1, 2):
        train(model, optim, 1)
        save(model, optim, tmp_path, step)
    newest = tmp_path / "checkpoints" / "global_step_2"
    assert damaged_parts(newest) == []  # the control: as saved, its manifest matches
    if damage == "flipped byte":  # same size: only the checksum sees it
        shard = next(newest.glob("*.distcp"))
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
        culprit = shard.name
        assert find_checkpoint(tmp_path, "auto", checksums=False) == newest  # sizes alone pass it
    elif damage == "scheduler rewritten":
        torch.save({"other": torch.zeros(100)}, newest / "scheduler.pt")
        culprit = "scheduler.pt"
    elif damage == "no rng file":
        (newest / "rng" / "rank0.pt").unlink()
        culprit = "rng/rank0.pt"
    elif damage == "truncated shard":
        shard = next(newest.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:10])
        culprit = shard.name
    elif damage == "bad json":
        (newest / "trainer_state.json").write_text('{"step": 2,')
        culprit = "trainer_state.json"
    else:
        (newest / ".metadata").write_bytes((newest / ".metadata").read_bytes()[:20])
        culprit = ".metadata"
    with caplog.at_level(logging.WARNING):
        assert find_checkpoint(tmp_path, "auto") == tmp_path / "checkpoints" / "global_step_1"
    assert f"skipping damaged checkpoint {newest}" in caplog.text and culprit in caplog.text
    with pytest.raises(ValueError, match=f"is damaged: {newest}/{culprit}".replace(".", r"\.")):
        find_checkpoint(tmp_path, str(newest))
    # The checkpoint it falls back to loads (the step-1 state).
    fresh, fresh_optim = make_bundle(1)
    assert (
        load_checkpoint(
            find_checkpoint(tmp_path, "auto"), policy=fresh, optim=fresh_optim, world=ONE_CPU_RANK
        )["step"]
        == 1
    )


def test_without_a_manifest_the_resume_warns_once_and_a_torn_file_falls_back(tmp_path, caplog):
    """Checkpoints saved before manifests: the one resumed is said to be unverified (once: by the rank that
    speaks; the others, `rank=None`, say nothing); a torn scheduler or RNG file (no size or checksum to
    compare with) is named as damage and the previous checkpoint is resumed; loading the torn one names it."""
    model, optim = make_bundle(0)
    for step in (1, 2):
        train(model, optim, 1)
        save(model, optim, tmp_path, step)
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        (root / f"global_step_{step}" / "manifest.json").unlink()
    newest = root / "global_step_2"

    def warnings_of(call) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="spmd_grpo.run"):
            call()
        return [
            r.getMessage()
            for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("spmd_grpo")
        ]

    assert warnings_of(lambda: find_checkpoint(tmp_path, "auto", rank=None)) == []  # not the speaking rank
    (warning,) = warnings_of(lambda: find_checkpoint(tmp_path, "auto", rank=0))
    assert warning.startswith(f"rank 0: resuming {newest} unverified: it has no manifest.json"), warning
    for victim in ("scheduler.pt", "rng/rank0.pt"):
        (newest / victim).write_bytes((root / "global_step_1" / victim).read_bytes()[:100])  # torn
        damage, latest, unverified = warnings_of(
            lambda: find_checkpoint(tmp_path, "auto", rank=0) == root / "global_step_1" or pytest.fail()
        )
        assert latest.startswith(f"rank 0: {root / 'latest'} names 'global_step_2'"), latest
        assert damage.startswith(
            f"rank 0: skipping damaged checkpoint {newest}: {newest / victim}: unreadable"
        )
        assert "global_step_1 unverified" in unverified
        with pytest.raises(ValueError, match=f"{newest / victim}: unreadable"):
            load_checkpoint(newest, policy=model, optim=optim, world=ONE_CPU_RANK)
        (newest / victim).write_bytes((root / "global_step_1" / victim).read_bytes())  # whole again
    # A shard zeroed in place (its size unchanged: nothing to see without a manifest) is resumed, fails in
    # DCP's load naming the checkpoint, and the previous checkpoint is loaded instead (trainer.resume=auto).
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(bytes(shard.stat().st_size))
    assert find_checkpoint(tmp_path, "auto", rank=None) == newest
    with pytest.raises(UnreadableCheckpoint, match=f"{newest}: {shard} is unreadable \\(rank 0: "):
        load_or_fall_back(newest, policy=model, optim=optim, world=ONE_CPU_RANK, auto=False)
    fresh, fresh_optim = make_bundle(1)
    (fallback,) = warnings_of(
        lambda: (
            load_or_fall_back(newest, policy=fresh, optim=fresh_optim, world=ONE_CPU_RANK, auto=True)["step"]
            == 1
            or pytest.fail()
        )
    )
    assert fallback.startswith(f"rank 0: {newest} failed to load ({newest}: {shard} is unreadable"), fallback
    assert fallback.endswith(f"resuming the previous complete checkpoint {root / 'global_step_1'}"), fallback


def test_resume_takes_the_configs_optimizer_settings_and_the_saved_moments(tmp_path):
    """A changed lr, betas or weight decay takes effect on resume; torch's own load_state_dict would restore
    the saved ones (optimizer param_groups and the scheduler's base_lrs) silently."""
    model, optim = make_bundle(0)
    train(model, optim, 3)
    path = save_checkpoint(
        tmp_path,
        3,
        policy=model,
        optim=optim,
        trainer_state={"step": 3},
        world=ONE_CPU_RANK,
        save_limit=0,
        model_path="m",
        config={"worker": {"actor": {"optim": {"lr": 0.1}}}},
    )
    assert (path / "config.yaml").read_text() == "worker:\n  actor:\n    optim:\n      lr: 0.1\n"
    fresh = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(fresh.parameters(), lr=0.05, betas=(0.5, 0.6), weight_decay=0.3)
    bundle = OptimizerBundle(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1)))
    load_checkpoint(path, policy=fresh, optim=bundle, world=ONE_CPU_RANK)
    group = opt.param_groups[0]
    assert group["lr"] == bundle.scheduler.get_last_lr()[0] == pytest.approx(0.05 / 4)  # saved: 0.1 / 4
    assert (group["betas"], group["weight_decay"], group["initial_lr"]) == ((0.5, 0.6), 0.3, 0.05)
    assert bundle.scheduler.base_lrs == [0.05] and bundle.scheduler.last_epoch == 3
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(optim.optimizer.state[p]["exp_avg_sq"], opt.state[q]["exp_avg_sq"])
    train(fresh, bundle, 1)  # the schedule continues from the saved position with the new base lr
    assert group["lr"] == pytest.approx(0.05 / 5)


def test_a_missing_rng_file_of_another_rank_is_named_without_a_manifest(tmp_path):
    """A checkpoint saved at world 2 before manifests existed: rank 1's RNG file missing is damage, named."""
    ckpt = fake_checkpoint(tmp_path, 3, state={"step": 3, "world_size": 2})
    (ckpt / "rng").mkdir()
    torch.save({}, ckpt / "rng" / "rank0.pt")
    assert damaged_parts(ckpt) == [f"{ckpt / 'rng' / 'rank1.pt'}: missing"]
    torch.save({}, ckpt / "rng" / "rank1.pt")
    assert damaged_parts(ckpt) == []


def test_crc32_of_a_file_is_zlibs_over_its_bytes(tmp_path):
    """Chunked reading gives the one-shot CRC (a file larger than one chunk, and an empty one)."""
    data = os.urandom((16 << 20) + 12345)
    (tmp_path / "f").write_bytes(data)
    (tmp_path / "e").write_bytes(b"")
    assert file_crc32(tmp_path / "f") == zlib.crc32(data) and file_crc32(tmp_path / "e") == 0
