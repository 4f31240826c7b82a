"""What a start does with its run directory (spmd_grpo/run/start.py), in process on real files: a new run into a
directory holding a run is refused before anything is written; a resume whose config changes what the saved
state means is refused with the override that allows it, other changes are reported; a directory whose
checkpoints are all damaged is not silently restarted; the CLI turns each refusal into one line and exit 2."""

from __future__ import annotations

import json
import logging
import re
import warnings
from pathlib import Path

import pytest

from spmd_grpo.config.checks import ConfigError
from spmd_grpo.config.loader import last_wins, load_config
from spmd_grpo.run.lineage import abandon_branch, agree_on_start
from spmd_grpo.run.manifest import file_entries, shares, write_manifest
from spmd_grpo.run.saved_config import (
    MEANING_CHANGING,
    ConfigChange,
    diff_configs,
    dump_yaml,
    meaning_changes,
    plain_config,
)
from spmd_grpo.run.start import plan_start
from spmd_grpo.run.verify import verified_plan
from spmd_grpo.telemetry.loggers import JsonlLogger
from spmd_grpo.train import main
from tests.conftest import ONE_CPU_RANK, checkpoint_stand_in, fake_checkpoint

BASE = ["worker.actor.model.model_path=/models/x", "trainer.experiment_name=run"]


@pytest.fixture(autouse=True)
def _quiet_dcp():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def _cfg(tmp_path: Path, *overrides: str):
    return load_config(None, last_wins([*BASE, f"trainer.output_dir={tmp_path}", *overrides]))


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------------ diff
def test_diff_is_key_by_key_and_only_meaning_changing_keys_are_refused(tmp_path):
    saved = plain_config(_cfg(tmp_path, "worker.rollout.n=4", "trainer.max_steps=10"))
    new = plain_config(
        _cfg(
            tmp_path,
            "worker.rollout.n=8",
            "trainer.max_steps=20",
            "worker.actor.optim.lr=5e-7",
            "trainer.resume=none",  # not compared
            "trainer.allow_config_change=[worker.rollout.n]",  # not compared
        )
    )
    changes = diff_configs(saved, new)
    assert [str(c) for c in changes] == [
        "trainer.max_steps 10 -> 20",
        "worker.actor.optim.lr 1e-06 -> 5e-07",
        "worker.rollout.n 4 -> 8",
    ]
    assert [c.key for c in meaning_changes(changes, ())] == ["worker.rollout.n"]
    assert meaning_changes(changes, ("worker.rollout.n",)) == []
    # A key only one side has (a schema that changed) is a change, shown as absent.
    del saved["data"]["seed"]
    assert str(diff_configs(saved, new)[0]) == "data.seed (absent) -> 1"
    assert diff_configs(saved, saved) == []


def test_every_meaning_changing_key_exists():
    keys = set(plain_config_keys())
    assert set(MEANING_CHANGING) <= keys, set(MEANING_CHANGING) - keys
    assert "worker.actor.optim.lr" not in MEANING_CHANGING and "trainer.max_steps" not in MEANING_CHANGING


def plain_config_keys() -> list[str]:
    from spmd_grpo.run.saved_config import flatten

    return list(flatten(plain_config(load_config(None, BASE))))


# ------------------------------------------------------------------------------------------------ (b)
def test_a_new_run_into_a_directory_holding_a_run_is_refused_and_nothing_is_written(tmp_path):
    run = tmp_path / "run"
    assert plan_start(_cfg(tmp_path, "trainer.resume=none")).checkpoint is None  # no directory yet: new run
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "rank0.log").write_text("x\n")  # logs alone are not a run (only appended to)
    assert plan_start(_cfg(tmp_path, "trainer.resume=none")).lines() == [f"start: new run in {run}"]
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    before = _tree(run)
    with pytest.raises(ConfigError) as e:
        plan_start(_cfg(tmp_path, "trainer.resume=none"))
    assert str(e.value) == (
        f"{run} already holds a run (metrics.jsonl) and trainer.resume=none starts a new one: "
        "trainer.resume=auto continues that run; for a new run pick another trainer.experiment_name or "
        "trainer.output_dir (or remove the directory)"
    )
    assert _tree(run) == before


def test_another_runs_checkpoint_is_refused_into_a_held_directory_and_compared_when_forking(tmp_path):
    other = fake_checkpoint(tmp_path / "other", 3, cfg=_cfg(tmp_path, "worker.rollout.n=4"))
    (tmp_path / "run").mkdir()
    plan = plan_start(_cfg(tmp_path, f"trainer.resume={other}", "worker.rollout.n=4", "trainer.max_steps=9"))
    assert plan.checkpoint == other and plan.saved_config == other / "config.yaml"
    assert [str(c) for c in plan.changes] == ["trainer.max_steps null -> 9"]
    (tmp_path / "run" / "config.yaml").write_text("{}\n")
    with pytest.raises(ConfigError, match="already holds a run .config.yaml.; starting from another run's"):
        plan_start(_cfg(tmp_path, f"trainer.resume={other}", "worker.rollout.n=4"))


# ------------------------------------------------------------------------------------------------ (a)
def test_resume_refuses_a_meaning_change_names_the_override_and_reports_the_rest(tmp_path):
    run = tmp_path / "run"
    saved_cfg = _cfg(tmp_path, "worker.rollout.n=4", "data.train_files=builtin:color")
    fake_checkpoint(run, 2, cfg=saved_cfg)
    newest = fake_checkpoint(run, 4, cfg=saved_cfg)
    changed = ["worker.rollout.n=8", "data.train_files=/data/other.parquet", "worker.actor.optim.lr=5e-7"]
    with pytest.raises(ConfigError) as e:
        plan_start(_cfg(tmp_path, *changed))
    message = str(e.value)
    assert message.startswith(f"resuming {newest} with a config that changes what its saved state means")
    assert '"builtin:color" -> "/data/other.parquet"' in message and "worker.rollout.n 4 -> 8 (" in message
    assert message.endswith(
        "To continue with the new values add "
        "trainer.allow_config_change=[data.train_files,worker.rollout.n]; "
        "for a new run pick another trainer.experiment_name or trainer.output_dir"
    )
    assert "optim.lr" not in message

    allowed = "trainer.allow_config_change=[data.train_files,worker.rollout.n]"
    plan = plan_start(_cfg(tmp_path, *changed, allowed))
    assert plan.checkpoint == newest and plan.reset_data_position
    assert plan.lines() == [
        f"start: resuming {newest} (config compared with {newest / 'config.yaml'}: 3 changes)",
        'resume: data.train_files "builtin:color" -> "/data/other.parquet"',
        "resume: worker.actor.optim.lr 1e-06 -> 5e-07",
        "resume: worker.rollout.n 4 -> 8",
        "resume: the saved data position is dropped (the data changed): sampling starts over",
    ]
    with pytest.raises(ConfigError, match="allow_config_change: unknown config key worker.rollout.nn"):
        plan_start(_cfg(tmp_path, "trainer.allow_config_change=[worker.rollout.nn]"))
    # The image limit filters the rows the data position indexes: its change once passed the diff and
    # failed in the sampler's resume, after vLLM had loaded.
    with pytest.raises(ConfigError, match=r"worker.rollout.limit_images 1 -> 2 \(the saved data position"):
        plan_start(
            _cfg(
                tmp_path,
                "worker.rollout.n=4",
                "data.train_files=builtin:color",
                "worker.rollout.limit_images=2",
            )
        )


def test_a_changed_video_limit_or_video_sampling_is_refused_like_the_image_limit(tmp_path):
    """Rows with more videos than limit_videos are skipped and a video's sampling sets its prompt's length
    (the length filter): either change moved the data position and failed after vLLM had loaded."""
    saved = ["worker.rollout.limit_videos=1", "data.video_max_frames=8"]
    fake_checkpoint(tmp_path / "run", 2, cfg=_cfg(tmp_path, *saved))
    for change, says in [
        ("worker.rollout.limit_videos=2", "worker.rollout.limit_videos 1 -> 2 (the saved data position"),
        ("data.video_max_frames=16", "data.video_max_frames 8 -> 16 (the saved data position"),
    ]:
        overrides = [o for o in saved if o.split("=")[0] != change.split("=")[0]]
        with pytest.raises(ConfigError, match=re.escape(says)):
            plan_start(_cfg(tmp_path, *overrides, change))
    assert plan_start(_cfg(tmp_path, *saved)).changes == ()  # the control


def _policy_checkpoint(run: Path, step: int, cfg, lora_rank: int, tied_head: bool = False) -> Path:
    """A checkpoint whose DCP entries are a policy's: LoRA adapters only (`lora_rank` > 0) or whole weights;
    `tied_head`: also the output head, which LoRA checkpoints of tied-embedding models held until the save
    dropped it."""
    import torch
    import torch.distributed.checkpoint as dcp

    ckpt = run / "checkpoints" / f"global_step_{step}"
    ckpt.mkdir(parents=True)
    layer = "hf.model.language_model.layers.0.self_attn.q_proj"
    model = (
        {f"{layer}.lora_A.default.weight": torch.zeros(lora_rank, 64),
         f"{layer}.lora_B.default.weight": torch.zeros(64, lora_rank)}
        if lora_rank else {f"{layer}.weight": torch.zeros(64, 64)}
    )  # fmt: skip
    if tied_head:
        model["hf.lm_head.weight"] = torch.zeros(32, 64)
    dcp.save({"model": model}, checkpoint_id=str(ckpt), no_dist=True)
    torch.save({}, ckpt / "scheduler.pt")
    dump_yaml(cfg, ckpt / "config.yaml")
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": step}))
    return ckpt


@pytest.mark.parametrize("saved, wanted", [(8, 0), (0, 8), (8, 16)])
def test_lora_and_full_checkpoints_resumed_the_other_way_are_one_line_naming_the_way_out(
    tmp_path, saved, wanted
):
    """Even with the change allowed (as the diff's refusal suggests), adapters cannot be loaded into a
    fully fine-tuned policy, nor whole weights into adapters, nor rank-8 adapters into rank-16 ones: one line
    before anything is built, saying why and what to do (export, start from the merged model)."""
    rank = "worker.actor.model.lora.rank"
    ckpt = _policy_checkpoint(tmp_path / "run", 3, _cfg(tmp_path, f"{rank}={saved}"), saved)
    with pytest.raises(ConfigError) as e:
        plan_start(_cfg(tmp_path, f"{rank}={wanted}", f"trainer.allow_config_change=[{rank}]"))
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{ckpt} holds "), message
    if saved == 0:
        assert f"fully fine-tuned weights, and {rank}=8 trains adapters" in message, message
        assert f"python -m spmd_grpo.export {ckpt} OUT" in message and f"resume it with {rank}=0" in message
    else:
        assert "LoRA adapters of rank 8" in message, message
        assert f"python -m spmd_grpo.export {ckpt} ADAPTER_OUT --merged MERGED_OUT" in message, message
        assert "worker.actor.model.model_path=MERGED_OUT" in message and f"{rank}=8" in message, message
    assert plan_start(_cfg(tmp_path, f"{rank}={saved}")).checkpoint == ckpt  # the control


def test_a_lora_checkpoint_holding_a_tied_head_is_still_adapters_for_resume_and_export(tmp_path):
    """LoRA checkpoints of tied-embedding models saved the frozen output head beside the adapters (the input
    embedding under a second name, which `ignore_frozen_params` kept): a resume with the same rank was refused
    as full fine-tuning and the export wrote adapters and head as a model. They are adapters."""
    from spmd_grpo.run.export_lora import adapter_keys

    rank = "worker.actor.model.lora.rank"
    ckpt = _policy_checkpoint(tmp_path / "run", 3, _cfg(tmp_path, f"{rank}=8"), 8, tied_head=True)
    assert plan_start(_cfg(tmp_path, f"{rank}=8")).checkpoint == ckpt
    module = "base_model.model.model.language_model.layers.0.self_attn.q_proj"
    assert sorted(adapter_keys(ckpt).values()) == [f"{module}.lora_A.weight", f"{module}.lora_B.weight"]


def test_old_checkpoint_without_config_is_compared_with_the_run_dirs(tmp_path):
    run = tmp_path / "run"
    fake_checkpoint(run, 1)
    dump_yaml(_cfg(tmp_path, "worker.actor.model.model_path=/models/a"), run / "config.yaml")
    with pytest.raises(ConfigError, match=r'model_path "/models/a" -> "/models/x" \(the saved weights'):
        plan_start(_cfg(tmp_path))
    (run / "config.yaml").unlink()
    plan = plan_start(_cfg(tmp_path))  # nothing to compare with: said so, not silent
    assert plan.lines()[0].endswith("(no saved config to compare with: changes are not checked)")


# ----------------------------------------------------------------------------------- no usable checkpoint
def test_auto_restarts_a_run_without_checkpoint_but_refuses_another_runs_config(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    dump_yaml(_cfg(tmp_path, "data.max_response_length=64"), run / "config.yaml")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    plan = plan_start(_cfg(tmp_path, "data.max_response_length=64", "worker.actor.optim.lr=2e-6"))
    assert plan.checkpoint is None and plan.restart
    assert [str(c) for c in plan.changes] == ["worker.actor.optim.lr 1e-06 -> 2e-06"]
    assert plan.lines()[0].startswith(
        f"start: {run} holds no complete checkpoint: the run restarts at step 0"
    )
    with pytest.raises(ConfigError, match=f"restarting the run in {run} with a config that changes"):
        plan_start(_cfg(tmp_path, "data.max_response_length=128"))


def test_all_checkpoints_damaged_is_an_error_not_a_silent_restart(tmp_path):
    run = tmp_path / "run"
    ckpt = fake_checkpoint(run, 2)
    (ckpt / ".metadata").write_bytes(b"torn")
    with pytest.raises(ConfigError, match=f"every checkpoint in {run / 'checkpoints'} is damaged"):
        plan_start(_cfg(tmp_path))
    with pytest.raises(ValueError, match=f"is damaged: {ckpt}/.metadata"):  # by path: the file is named
        plan_start(_cfg(tmp_path, f"trainer.resume={ckpt}"))


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_refusal_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("{}\n")
    checkpoint_stand_in(
        tmp_path / "model"
    )  # the config checks want a model directory before the run directory
    smoke = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"
    with pytest.raises(SystemExit) as e:
        main(
            [
                str(smoke),
                *last_wins([*BASE, f"worker.actor.model.model_path={tmp_path / 'model'}"]),
                f"trainer.output_dir={tmp_path}",
                "trainer.resume=none",
            ]
        )
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"config error: {tmp_path / 'run'} already holds a run")


def test_config_change_str():
    assert str(ConfigChange("a.b", [1, 2], None)) == "a.b [1, 2] -> null"


# ------------------------------------------------------------------------------------------------ lineage
def test_resuming_an_earlier_checkpoint_sets_the_later_branch_aside_and_auto_then_follows_it(tmp_path):
    """Steps 1..4 saved at 2 and 4; resume from global_step_2 by path: global_step_4 (and a damaged 5) are
    an abandoned branch, moved aside, not deleted; the rows of steps 3..4 leave metrics.jsonl. The new branch
    trains 3 and saves it; `auto` then continues from the new 3, not the old 4, and metrics hold 1, 2, 3 once."""
    run = tmp_path / "run"
    for step in (2, 4, 5):
        fake_checkpoint(run, step)
    (run / "checkpoints" / "global_step_5" / "scheduler.pt").unlink()  # damaged: also after the resumed one
    (run / "checkpoints" / "latest").write_text("global_step_5")
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(1, 6)))

    plan = plan_start(_cfg(tmp_path, f"trainer.resume={run / 'checkpoints' / 'global_step_2'}"))
    assert [p.name for p in plan.abandoned] == ["global_step_4", "global_step_5"]
    assert "global_step_4, global_step_5 of the old branch are set aside" in plan.lines()[-1]
    moved_to = abandon_branch(agree_on_start(plan, ONE_CPU_RANK), ONE_CPU_RANK)
    assert moved_to == run / "abandoned" / "after_step_2"
    assert sorted(p.name for p in moved_to.iterdir()) == ["global_step_4", "global_step_5"]
    assert (moved_to / "global_step_4" / "trainer_state.json").is_file()  # kept whole
    assert (run / "checkpoints" / "latest").read_text() == "global_step_2"
    JsonlLogger(run, start_step=2)  # what the resumed run's loggers do
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3}\n')
    fake_checkpoint(run, 3)

    again = plan_start(_cfg(tmp_path, "trainer.resume=auto"))
    assert again.checkpoint == run / "checkpoints" / "global_step_3" and again.abandoned == ()
    JsonlLogger(run, start_step=3)
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    rolled = (run / "metrics.rolledback.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in rolled] == [3, 4, 5]

    # A second detour from the same step keeps the first abandoned branch: a new directory beside it.
    fake_checkpoint(run, 4)
    plan = plan_start(_cfg(tmp_path, f"trainer.resume={run / 'checkpoints' / 'global_step_2'}"))
    assert abandon_branch(plan, ONE_CPU_RANK) == run / "abandoned" / "after_step_2.1"
    assert (moved_to / "global_step_4").is_dir()


def test_auto_and_another_runs_checkpoint_abandon_nothing(tmp_path):
    run = tmp_path / "run"
    for step in (1, 2):
        fake_checkpoint(run, step)
    assert plan_start(_cfg(tmp_path, "trainer.resume=auto")).abandoned == ()
    other = fake_checkpoint(tmp_path / "other", 1)
    plan = plan_start(_cfg(tmp_path, "trainer.experiment_name=fork", f"trainer.resume={other}"))
    assert plan.checkpoint == other and plan.abandoned == ()


# ---------------------------------------------------------------------------------- checksums after start
def _with_manifest(ckpt: Path) -> Path:
    """`ckpt` (fake_checkpoint) with the manifest a save writes: every file but trainer_state.json."""
    names = [p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()]
    write_manifest(ckpt, file_entries(ckpt, [n for n in names if n != "trainer_state.json"]))
    return ckpt


def _flip_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


def test_shares_balance_bytes_largest_first_and_split_alike_everywhere():
    items = [("a", 10, ""), ("b", 70, ""), ("c", 30, ""), ("d", 30, ""), ("e", 20, ""), ("f", 40, "")]
    got = [[name for name, _, _ in share] for share in shares(items, 3)]
    # b(70) -> 0; f(40) -> 1; c(30) -> 2; d(30) -> 2 (30 < 40); e(20) -> 1 (40 < 60); a(10) -> 1 (ranks 1 and
    # 2 both hold 60: the tie goes to the lower rank).
    assert got == [["b"], ["f", "e", "a"], ["c", "d"]]
    assert [sum(s for _, s, _ in share) for share in shares(items, 3)] == [70, 70, 60]
    assert shares(items, 1) == [sorted(items, key=lambda it: (-it[1], it[0]))]
    assert shares(items[:1], 4) == [[items[0]], [], [], []]  # more ranks than files: some read nothing


def test_a_corrupted_file_is_found_after_the_start_and_auto_plans_the_previous_checkpoint(tmp_path, caplog):
    """The size checks before the process group pass a flipped byte (same size); the checksums after it find
    it: `auto` names the checkpoint once and takes the previous one, with that one's config diff and the
    damaged one as its abandoned branch; by path it is an error naming the file; all damaged: an error."""
    run = tmp_path / "run"
    older = _with_manifest(fake_checkpoint(run, 2, cfg=_cfg(tmp_path, "worker.actor.optim.lr=2e-6")))
    newest = _with_manifest(fake_checkpoint(run, 3, cfg=_cfg(tmp_path)))
    (run / "checkpoints" / "latest").write_text("global_step_3")
    assert verified_plan(plan_start(_cfg(tmp_path)), _cfg(tmp_path), ONE_CPU_RANK).checkpoint == newest
    shard = next(newest.glob("*.distcp"))
    _flip_byte(shard)

    plan = plan_start(_cfg(tmp_path))  # sizes and headers only: the flipped byte passes
    assert plan.checkpoint == newest and plan.changes == () and plan.abandoned == ()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="spmd_grpo"):
        chosen = verified_plan(plan, _cfg(tmp_path), ONE_CPU_RANK)
    assert chosen.checkpoint == older and chosen.saved_config == older / "config.yaml"
    assert [str(c) for c in chosen.changes] == ["worker.actor.optim.lr 2e-06 -> 1e-06"]
    assert chosen.abandoned == (newest,)  # moved aside before training, as for any resume of an earlier one
    skipped = [r.getMessage() for r in caplog.records if "skipping damaged" in r.getMessage()]
    assert len(skipped) == 1 and skipped[0].startswith(
        f"rank 0: skipping damaged checkpoint {newest}: {shard}: CRC-32 "
    ), skipped
    assert skipped[0].endswith("(corrupted)")

    by_path = _cfg(tmp_path, f"trainer.resume={newest}")
    with pytest.raises(ValueError, match=re.escape(f"trainer.resume='{newest}' is damaged: {shard}: CRC-32")):
        verified_plan(plan_start(by_path), by_path, ONE_CPU_RANK)

    _flip_byte(older / "scheduler.pt")
    with pytest.raises(ConfigError, match=f"every checkpoint in {run / 'checkpoints'} is damaged"):
        verified_plan(plan_start(_cfg(tmp_path)), _cfg(tmp_path), ONE_CPU_RANK)
