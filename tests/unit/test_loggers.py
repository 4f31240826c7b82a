"""trainer.logger: the config key and its install hints, and each logger writing what a user then reads:
tensorboard event files read back with tensorboard's EventAccumulator, a wandb offline run's transaction
log read back record by record, metrics.jsonl, the console lines; swanlab and mlflow against stand-in
modules that record the calls (their packages are optional and not installed for the tests)."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from spmd_grpo.config.checks import ConfigError
from spmd_grpo.config.loader import load_config
from spmd_grpo.config.validate import validate
from spmd_grpo.run.saved_config import dump_yaml
from spmd_grpo.telemetry.loggers import build_loggers, markdown_table, mlflow_name

REPO = Path(__file__).resolve().parents[2]
BASE = ["worker.actor.model.model_path=/models/x"]
STEPS = {
    step: {
        "critic/score/mean": 0.1 * step,
        "actor/kl_loss": 0.01 * step,
        "timing_s/step": 1.5,
        "val-core/color/acc/mean@1": 0.25 * step,
    }
    for step in (1, 2, 3)
}
ROWS = [
    {
        "data_source": "color",
        "problem": "<image>Which colour?",
        "response": "2",
        "ground_truth": "2",
        "score": 1.0,
    },
    {
        "data_source": "color",
        "problem": "<image>Which colour?",
        "response": "a|b\nc",
        "ground_truth": "1",
        "score": 0.0,
    },
]


def _loggers(tmp_path: Path, names: str, start_step: int = 0, **kwargs):
    cfg = load_config(None, [*BASE, f"trainer.output_dir={tmp_path}", f"trainer.logger=[{names}]"])
    return cfg, build_loggers(cfg, 3, start_step=start_step, enabled=kwargs.get("enabled", True))


def _log_steps(loggers, steps=(1, 2, 3), scale: float = 1.0) -> None:
    for step in steps:
        loggers.log(step, {k: v * scale for k, v in STEPS[step].items()})
    loggers.log_table(steps[-1], ROWS)
    loggers.close()


# ----------------------------------------------------------------------------------------- config
def test_logger_list_parses_and_round_trips(tmp_path):
    cfg = load_config(None, [*BASE, "trainer.logger=[console,jsonl,tensorboard]"])
    assert cfg.trainer.logger == ("console", "jsonl", "tensorboard")
    assert load_config(None, BASE).trainer.logger == ("console", "jsonl")
    dump_yaml(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml").trainer.logger == cfg.trainer.logger


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.logger=wandb", "trainer.logger: must be a list, got 'wandb'"),
        (
            "trainer.logger=[console,wandbb]",
            "trainer.logger[1]: must be 'console', 'jsonl', 'tensorboard', 'wandb', 'swanlab' or "
            "'mlflow', got 'wandbb'",
        ),
    ],
)
def test_logger_bad_values(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*BASE, override])
    assert str(e.value) == message


def test_logger_twice():
    with pytest.raises(ConfigError, match=r"trainer.logger: lists a logger twice"):
        validate(load_config(None, [*BASE, "trainer.logger=[console,console]"]), 1)


def _without(monkeypatch, *missing: str) -> None:
    """find_spec answers None for `missing` (a package that is not installed), as it does for real."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a)
    )


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "swanlab", "mlflow"])
def test_missing_tracker_fails_at_preflight_with_install_hint(monkeypatch, name):
    """The package is looked for on the machine that trains (a `--dry-run` plans for another one)."""
    from spmd_grpo.run.preflight import check_loggers_installed

    _without(monkeypatch, name)
    cfg = load_config(None, [*BASE, f"trainer.logger=[console,{name}]"])
    validate(cfg, 1)
    with pytest.raises(ConfigError) as e:
        check_loggers_installed(cfg.trainer.logger)
    assert (
        str(e.value) == f"trainer.logger: {name!r} needs the {name} package: pip install 'spmd_grpo[{name}]'"
    )


CLI_WITHOUT_WANDB = """
import atexit, importlib.util, sys
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name == "wandb" else real(name, *a)
atexit.register(lambda: print(sorted(m for m in ("torch", "wandb") if m in sys.modules)))
from spmd_grpo.train import main
main(sys.argv[1:])
"""


def test_missing_tracker_cli_exits_2_with_one_line_and_imports_nothing_heavy(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    proc = subprocess.run(
        [sys.executable, "-c", CLI_WITHOUT_WANDB, *BASE, "trainer.logger=[console,wandb]"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "config error: trainer.logger: 'wandb' needs the wandb package: pip install 'spmd_grpo[wandb]'"
    ]
    assert proc.stdout.strip() == "[]"  # neither torch nor wandb was imported to check the config


# ------------------------------------------------------------------------------------ built in
def test_only_rank_0_logs(tmp_path):
    _, loggers = _loggers(tmp_path, "console,jsonl,tensorboard", enabled=False)
    assert loggers.loggers == []
    _log_steps(loggers)
    assert not (tmp_path / "run").exists()


def test_jsonl_rows_tables_and_resume(tmp_path):
    cfg, loggers = _loggers(tmp_path, "jsonl")
    _log_steps(loggers)
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": s, **STEPS[s]} for s in (1, 2, 3)]
    generations = [
        json.loads(line) for line in (cfg.run_dir / "val_generations.jsonl").read_text().splitlines()
    ]
    assert generations == [{"step": 3, **row} for row in ROWS]
    # Resumed from the checkpoint of step 1: steps 2 and 3 are redone, their old rows move aside.
    _, loggers = _loggers(tmp_path, "jsonl", start_step=1)
    loggers.log(2, STEPS[2])
    steps = [json.loads(line)["step"] for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert (cfg.run_dir / "metrics.rolledback.jsonl").read_text().count("\n") == 2
    # The validation generations of step 3 are redone too: moved aside, not duplicated.
    assert (cfg.run_dir / "val_generations.jsonl").read_text() == ""
    moved = (cfg.run_dir / "val_generations.rolledback.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in moved] == [3, 3]


def _strict_json(line: str) -> dict:
    def refuse(name: str) -> float:
        raise ValueError(f"not JSON: {name}")

    return json.loads(line, parse_constant=refuse)


def test_jsonl_rows_are_strict_json_with_a_non_finite_value(tmp_path):
    # A skipped optimizer step logs its non-finite grad norm: Python's `NaN` literal would make the row
    # unreadable to strict JSON readers (jq, JavaScript), so it is written as null.
    cfg, loggers = _loggers(tmp_path, "jsonl")
    loggers.log(
        1, {"actor/grad_norm": float("nan"), "actor/pg_loss": float("-inf"), "critic/score/mean": 0.5}
    )
    loggers.log_table(1, [{**ROWS[0], "score": float("inf")}])
    row = _strict_json((cfg.run_dir / "metrics.jsonl").read_text())
    assert row == {"step": 1, "actor/grad_norm": None, "actor/pg_loss": None, "critic/score/mean": 0.5}
    table = _strict_json((cfg.run_dir / "val_generations.jsonl").read_text())
    assert table == {"step": 1, **ROWS[0], "score": None}


def test_jsonl_rollback_after_a_torn_write_and_on_a_restart_at_step_0(tmp_path):
    cfg, loggers = _loggers(tmp_path, "jsonl")
    for step in (0, 1, 2, 3):
        loggers.log(step, STEPS[max(step, 1)])
    path = cfg.run_dir / "metrics.jsonl"
    with path.open("a") as f:
        f.write('{"step": 4, "critic/sco')  # killed in the middle of step 4's row
    _, loggers = _loggers(tmp_path, "jsonl", start_step=2)  # resumed from the checkpoint of step 2
    loggers.log(3, STEPS[3])
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 3]
    aside = (cfg.run_dir / "metrics.rolledback.jsonl").read_text().splitlines()
    assert aside[0].startswith('{"step": 3,') and aside[1] == '{"step": 4, "critic/sco'
    # No checkpoint to resume: the run restarts at step 0 and every earlier row (step 0's too) moves aside.
    _, loggers = _loggers(tmp_path, "jsonl", start_step=0)
    loggers.log(0, STEPS[1])
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0]
    assert len((cfg.run_dir / "metrics.rolledback.jsonl").read_text().splitlines()) == 2 + 4


def test_console_one_line_per_logged_step_and_no_bar_off_a_terminal(tmp_path, capsys):
    cfg = load_config(
        None, [*BASE, f"trainer.output_dir={tmp_path}", "trainer.logger=[console]", "trainer.log_every=2"]
    )
    loggers = build_loggers(cfg, 5, start_step=0, enabled=True)
    for step in range(0, 6):
        loggers.log(step, STEPS[1])
    loggers.log_table(5, ROWS)
    loggers.close()
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert [line.split(" | ")[0] for line in lines] == [
        "step 0/5",
        "step 1/5",
        "step 2/5",
        "step 4/5",
        "step 5/5",
    ]
    assert all("score 0.100" in line and "color/acc/mean@1 0.250" in line for line in lines)
    assert "grpo" not in out + err  # pytest's streams are not terminals: no progress bar


def test_console_line_shows_a_small_kl_and_the_generated_score(tmp_path, capsys):
    # A KL of 3e-6 (early training, the policy still near the reference) is not printed as 0; with DAPO
    # the console shows the score of everything generated beside the trained groups' score, as the jsonl
    # holds them.
    metrics = {"critic/score/mean": 0.5, "train/gen_score/mean": 0.125, "actor/kl_loss": 3e-6}
    cfg, loggers = _loggers(tmp_path, "console,jsonl")
    loggers.log(1, metrics)
    loggers.close()
    line = capsys.readouterr().out.strip()
    assert line == "step 1/3 | score 0.500 | gen_score 0.125 | kl 3.00e-06"
    row = json.loads((cfg.run_dir / "metrics.jsonl").read_text())
    assert row == {"step": 1, **metrics}


def test_markdown_table_and_mlflow_names():
    assert markdown_table(ROWS).splitlines()[-1] == "| color | <image>Which colour? | a\\|b<br>c | 1 | 0.0 |"
    assert markdown_table([]) == ""
    assert mlflow_name("val-core/color/acc/mean@1") == "val-core/color/acc/mean_at_1"
    assert mlflow_name("timing_s/update_actor") == "timing_s/update_actor"


# ------------------------------------------------------------------------------------- trackers
def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_event_files_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg, loggers = _loggers(tmp_path, "tensorboard")
    _log_steps(loggers)
    scalars = _scalars(cfg.run_dir / "tensorboard")
    assert set(scalars) == set(STEPS[1])  # verl's names are the tags
    for name in STEPS[1]:
        assert scalars[name] == [(s, pytest.approx(STEPS[s][name])) for s in (1, 2, 3)]
    acc = EventAccumulator(str(cfg.run_dir / "tensorboard"))
    acc.Reload()
    [text_tag] = acc.Tags()["tensors"]
    [event] = acc.Tensors(text_tag)
    assert event.step == 3 and "a\\|b<br>c" in event.tensor_proto.string_val[0].decode()


def test_tensorboard_resume_drops_the_redone_steps(tmp_path):
    cfg, loggers = _loggers(tmp_path, "tensorboard")
    _log_steps(loggers)
    _, loggers = _loggers(tmp_path, "tensorboard", start_step=1)
    _log_steps(loggers, steps=(2, 3), scale=10.0)
    scores = _scalars(cfg.run_dir / "tensorboard")["critic/score/mean"]
    assert scores == [(1, pytest.approx(0.1)), (2, pytest.approx(2.0)), (3, pytest.approx(3.0))]
    _, loggers = _loggers(tmp_path, "tensorboard", start_step=0)  # a restart at step 0 purges every step
    _log_steps(loggers, steps=(1,), scale=100.0)
    scores = _scalars(cfg.run_dir / "tensorboard")["critic/score/mean"]
    assert scores == [(1, pytest.approx(10.0))]


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a wandb transaction log (`run-<id>.wandb`): a 7-byte `:W&B` header, then LevelDB's log
    format (32 KiB blocks of chunks: crc32c, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, records, partial = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # block trailer (padding)
            pos += left
            continue
        partial += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(partial)
            partial = b""
    return records


def test_wandb_offline_run_dir_holds_the_history(tmp_path, monkeypatch):
    from wandb.proto import wandb_internal_pb2 as pb

    for key, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_ERROR_REPORTING": "false",
    }.items():
        monkeypatch.setenv(key, value)
    for key in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(key, str(tmp_path / key.lower()))
    cfg, loggers = _loggers(tmp_path, "wandb")
    _log_steps(loggers)
    [run_dir] = (cfg.run_dir / "wandb").glob("offline-run-*")
    [log] = run_dir.glob("run-*.wandb")
    history, run = {}, None
    for raw in _wandb_records(log):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            history[items["_step"]] = items
        elif record.WhichOneof("record_type") == "run":
            run = record.run
    assert (run.project, run.display_name) == ("spmd_grpo", "run")
    assert sorted(history) == [1, 2, 3]
    for step in (1, 2, 3):
        assert {k: history[step][k] for k in STEPS[step]} == pytest.approx(STEPS[step])
    assert history[3]["val/generations/_type"] == "table-file" and history[3]["val/generations/nrows"] == 2
    table = json.loads(next(run_dir.glob("files/media/table/val/generations_*.table.json")).read_text())
    assert table["columns"] == ["step", *ROWS[0]] and table["data"][1][3] == "a|b\nc"


class _Recorder(types.ModuleType):
    """A stand-in module: every attribute is a function that records its call."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.calls: list[tuple] = []

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return lambda *args, **kwargs: self.calls.append((attr, args, kwargs)) or (attr, args, kwargs)


def _recorded_run(tmp_path, monkeypatch, name: str):
    """Log the test steps through logger `name`, whose package is a recorder: (recorder, cfg, call names)."""
    recorder = _Recorder(name)
    monkeypatch.setitem(sys.modules, name, recorder)
    cfg, loggers = _loggers(tmp_path, name)
    _log_steps(loggers)
    return recorder, cfg, [c[0] for c in recorder.calls]


def test_swanlab_calls(tmp_path, monkeypatch):
    swanlab, cfg, names = _recorded_run(tmp_path, monkeypatch, "swanlab")
    assert names == ["init", "log", "log", "log", "Text", "Text", "log", "finish"]
    init = swanlab.calls[0][2]
    assert (init["project"], init["experiment_name"], init["logdir"]) == (
        "spmd_grpo",
        "run",
        str(cfg.run_dir / "swanlog"),
    )
    assert init["config"]["trainer"]["logger"] == ["swanlab"]  # plain values, as config.yaml
    assert swanlab.calls[1][1:] == ((STEPS[1],), {"step": 1})
    assert "response: a|b\nc" in swanlab.calls[5][1][0] and swanlab.calls[6][1][0]["val/generations"]


def test_mlflow_calls(tmp_path, monkeypatch):
    mlflow, _, names = _recorded_run(tmp_path, monkeypatch, "mlflow")
    assert names == [
        "set_experiment",
        "start_run",
        "log_params",
        "log_metrics",
        "log_metrics",
        "log_metrics",
        "log_text",
        "end_run",
    ]
    assert mlflow.calls[0][1] == ("spmd_grpo",) and mlflow.calls[1][2] == {"run_name": "run"}
    params = mlflow.calls[2][1][0]
    assert params["trainer.logger"] == "['mlflow']" and params["worker.rollout.n"] == "8"
    metrics = mlflow.calls[5][2]["step"], mlflow.calls[5][1][0]
    assert metrics == (3, {mlflow_name(k): v for k, v in STEPS[3].items()})
    assert "val-core/color/acc/mean_at_1" in metrics[1]
    text, artifact = mlflow.calls[6][1]
    assert json.loads(text) == ROWS and artifact == "val_generations/step_000003.json"


def test_config_yaml_logger_is_a_list(tmp_path):
    cfg = load_config(None, [*BASE, "trainer.logger=[console,tensorboard]"])
    dump_yaml(cfg, tmp_path / "c.yaml")
    assert yaml.safe_load((tmp_path / "c.yaml").read_text())["trainer"]["logger"] == [
        "console",
        "tensorboard",
    ]
