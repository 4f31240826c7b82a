"""Config: strict keys and types, dotted overrides, cross-field rules, and the CLI's exit code 2."""

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from spmd_grpo.config.checks import ConfigError
from spmd_grpo.config.loader import last_wins, load_config
from spmd_grpo.config.schema import Config
from spmd_grpo.config.validate import ignored_settings, validate
from spmd_grpo.config.workers import OptimConfig
from spmd_grpo.run.preflight import check_model_path

REPO = Path(__file__).resolve().parents[2]
BASE = ["worker.actor.model.model_path=/models/x"]


def test_defaults_and_overrides():
    cfg = load_config(
        None, [*BASE, "data.max_prompt_length=1024", "worker.rollout.n=8", "worker.actor.optim.lr=1e-6"]
    )
    assert isinstance(cfg, Config)
    assert cfg.data.max_prompt_length == 1024 and cfg.worker.rollout.n == 8
    assert cfg.worker.actor.optim.lr == 1e-6 and isinstance(cfg.worker.actor.optim.lr, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.data.max_prompt_length = 3


def test_yaml_then_override(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump({"worker": {"rollout": {"n": 4}, "actor": {"model": {"model_path": "m"}}}})
    )
    cfg = load_config(path, ["worker.rollout.n=2"])
    assert cfg.worker.rollout.n == 2 and cfg.worker.actor.model.model_path == "m"


def test_a_mapping_override_merges_into_its_section(tmp_path):
    """`section={key: value}` sets those keys only: the YAML's lr and an earlier override of the section
    stay (it once replaced the whole section, silently resetting lr to the default)."""
    path = tmp_path / "c.yaml"
    path.write_text("worker:\n  actor:\n    optim:\n      lr: 3.0e-5\n")
    cfg = load_config(path, ["worker.actor.optim.betas=[0.8,0.9]", "worker.actor.optim={weight_decay: 0.0}"])
    assert cfg.worker.actor.optim == dataclasses.replace(
        OptimConfig(), lr=3e-5, betas=(0.8, 0.9), weight_decay=0.0
    )
    nested = load_config(path, ["worker.actor={optim: {min_lr_ratio: 0.5}, ppo_epochs: 2}"])
    assert nested.worker.actor.optim.lr == 3e-5 and nested.worker.actor.optim.min_lr_ratio == 0.5
    assert nested.worker.actor.ppo_epochs == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["worker.rollout.n=2", "worker.rollout.n=4"],
            "command line: worker.rollout.n is set twice ('worker.rollout.n=2', then 'worker.rollout.n=4'); "
            "a key may be given once, as in a YAML section",
        ),
        (  # the same key inside a mapping
            ["worker.actor.optim.lr=1e-5", "worker.actor={optim: {lr: 2e-5}}"],
            "command line: worker.actor.optim.lr is set twice",
        ),
        (  # null would reset the section's keys to their defaults
            ["worker.actor.optim=null"],
            "worker.actor.optim: must be a dictionary or an instance of OptimConfig, got None",
        ),
    ],
)
def test_the_command_line_refuses_a_key_twice_as_yaml_does(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_last_wins_is_how_programs_compose_overrides():
    composed = last_wins(["a.b=1", "c=2", "a.b=3"])
    assert composed == ["a.b=3", "c=2"]


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "worker.rollout.tensor_paralel_size=2",
            "unknown config key worker.rollout.tensor_paralel_size; did you mean worker.rollout.tensor_parallel_size?",
        ),
        ("data.max_promt_length=3", "did you mean data.max_prompt_length?"),
        ("worker.rolout.n=3", "unknown config key worker.rolout; did you mean worker.rollout?"),
        ("worker.rollout.n=eight", "worker.rollout.n: must be a valid integer, got 'eight'"),
        ("worker.rollout.n=true", "worker.rollout.n: must be a valid integer, got True"),
        ("worker.rollout.sleep_level=3", "worker.rollout.sleep_level: must be 1 or 2, got 3"),
        ("trainer=5", "trainer: must be a dictionary or an instance of TrainerConfig, got 5"),
        (  # a union: each alternative named
            "worker.actor.shared_prompt=sometimes",
            "worker.actor.shared_prompt: must be a valid boolean or 'auto', got 'sometimes'",
        ),
        (  # the alternative the value matched in type: its own error, at its index
            "worker.actor.model.lora.target_modules=[q_proj,'v proj']",
            "worker.actor.model.lora.target_modules[1]: is not a module name (a.b.c), got 'v proj'",
        ),
        ("worker.actor.optim.lr=1e39", "worker.actor.optim.lr: is beyond float32, got '1e39'"),
    ],
)
def test_bad_keys_and_types(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*BASE, override])
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (
            ["data.rollout_batch_size=3"],
            2,
            "data.rollout_batch_size (3) must be divisible by the world size (2)",
        ),
        (
            ["worker.rollout.tensor_parallel_size=4"],
            2,
            "tensor_parallel_size (4) must divide the world size (2)",
        ),
        (
            ["worker.actor.global_batch_size=6"],
            4,
            "global_batch_size (6) must be divisible by the world size (4)",
        ),
        (
            ["data.rollout_batch_size=4", "worker.rollout.n=3", "worker.actor.global_batch_size=8"],
            2,
            "data.rollout_batch_size * worker.rollout.n (12) must be divisible by worker.actor.global_batch_size (8)",
        ),
        (
            ["worker.actor.micro_batch_size_per_device_for_update=3"],
            2,
            "worker.actor.global_batch_size / world size (8) must be divisible by "
            "worker.actor.micro_batch_size_per_device_for_update (3)",
        ),
        (["data.max_response_length=0"], 1, "data.max_response_length: must be greater than 0, got 0"),
        (["worker.actor.clip_ratio_dual=0.5"], 1, "clip_ratio_dual: must be greater than 1"),
    ],
)
def test_cross_field_rules(overrides, world, message):
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, [*BASE, *overrides]), world)
    assert message in str(e.value)


def test_every_shipped_config_validates(tmp_path, monkeypatch):
    """Hub ids (model, data set) are accepted as they are; a local model path must hold config.json."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.chdir(REPO)  # the configs name their prompt template relative to the repository root
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    configs = sorted((REPO / "configs").glob("*.yaml"))
    assert configs, "no configs shipped"
    for path in configs:
        cfg = load_config(path)
        if not cfg.worker.actor.model.model_path:  # smoke.yaml: filled in by spmd_grpo.smoke
            cfg = load_config(path, [f"worker.actor.model.model_path={tmp_path}"])
        world = cfg.worker.rollout.tensor_parallel_size * 4
        validate(cfg, world if "smoke" not in path.name else 2)


def test_duplicate_yaml_keys_name_the_key_file_and_lines(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("worker:\n  rollout:\n    n: 4\n    temperature: 1.0\n    n: 8\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == (
        f"{path}: duplicate key 'n' at line 5 (first at line 3); a key may appear once per section"
    )
    with pytest.raises(ConfigError) as e:
        load_config(None, ["worker.rollout={n: 4, n: 8}"])
    assert str(e.value).startswith("command-line override 'worker.rollout={n: 4, n: 8}': duplicate key 'n'")


@pytest.mark.parametrize("text", [".nan", ".inf", "-.inf", "nan", "inf", "1e999"])
def test_floats_must_be_finite_everywhere(text):
    for key in ("worker.actor.optim.lr", "algorithm.rollout_correction.rollout_rs_threshold_lower"):
        with pytest.raises(ConfigError, match=f"^{key}: must be a finite number, got"):
            load_config(None, [f"{key}={text}"])


def test_hub_ids_and_local_paths(tmp_path, monkeypatch):
    """`owner/name` is a hub id unless `owner` is a local directory; offline, the hub cache must hold it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    key = "worker.actor.model.model_path"

    def check(model_path):
        check_model_path(key, model_path)

    check("Qwen/Qwen2.5-VL-7B-Instruct")
    (tmp_path / "models").mkdir()
    with pytest.raises(
        ConfigError, match=f"^{key} must be an existing checkpoint directory .* no such directory"
    ):
        check("models/qwen")  # `models/` is here: a local path that does not exist, not a hub id
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="not in the local Hugging Face cache and HF_HUB_OFFLINE is set"):
        check("Qwen/Qwen2.5-VL-7B-Instruct")
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen2.5-VL-7B-Instruct" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    check("Qwen/Qwen2.5-VL-7B-Instruct")


def test_derived_values_in_one_place():
    cfg = load_config(
        None,
        [*BASE, "data.max_prompt_length=100", "data.max_response_length=28", "data.rollout_batch_size=8"],
    )
    assert cfg.max_model_len == 128 and cfg.num_train_groups == 8 and cfg.total_steps(5) == 5
    dapo = load_config(
        None,
        [
            *BASE,
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.train_batch_size=4",
            "trainer.max_steps=3",
        ],
    )
    assert dapo.num_train_groups == 4 and dapo.total_steps(5) == 3
    off = load_config(None, [*BASE, "algorithm.filter_groups.train_batch_size=4"])
    assert off.num_train_groups == off.data.rollout_batch_size  # train_batch_size counts only with DAPO on


def _run_cli(tmp_path, argv, world_size):
    # WORLD_SIZE=2 with no second rank: if the CLI tried to create a process group it would wait for the
    # missing peer (until timeout) instead of exiting at once.
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29599",
    }
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "spmd_grpo.train", *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc, time.monotonic() - start


@pytest.mark.parametrize(
    "yaml_text, overrides, expected",
    [
        (
            "worker:\n  rollout:\n    temperatur: 0.7\n",
            [],
            "unknown config key worker.rollout.temperatur; did you mean worker.rollout.temperature?",
        ),
        ("worker:\n  rollout:\n    n: lots\n", [], "worker.rollout.n: must be a valid integer, got 'lots'"),
        (
            "data:\n  rollout_batch_size: 5\n",
            [],
            "data.rollout_batch_size (5) must be divisible by the world size (2)",
        ),
    ],
    ids=["typo", "wrong-type", "not-divisible"],
)
def test_cli_config_error_exits_2_with_one_line(tmp_path, yaml_text, overrides, expected):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "worker:\n  actor:\n    model:\n      model_path: m\n" + yaml_text
        if "worker:" not in yaml_text
        else yaml_text.replace("worker:\n", "worker:\n  actor:\n    model:\n      model_path: m\n", 1)
    )
    proc, _ = _run_cli(tmp_path, [str(cfg), *overrides], world_size=2)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"config error: {expected}"], proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_configuration_reference_is_generated_from_the_fields():
    """docs/configuration.md is what `make docs` prints: a field added, renamed or re-documented without
    regenerating the page fails here."""
    from spmd_grpo.tools.config_docs import render

    page = (REPO / "docs" / "configuration.md").read_text()
    assert page == render(), "docs/configuration.md is stale: run `make docs`"
    for key in ("worker.rollout.limit_videos", "data.video_fps", "algorithm.norm_adv_by_std_in_grpo"):
        section, _, name = key.rpartition(".")
        assert f"## `{section}`" in page and f"| `{name}` |" in page, key


def test_null_for_a_section_is_refused_naming_the_dotted_key(tmp_path):
    """`worker.actor={optim: null}` once reset the YAML's optimizer settings to the defaults and exited 0; a
    section left empty in the file (its keys commented out) is refused alike rather than guessed at."""
    path = tmp_path / "c.yaml"
    path.write_text("worker:\n  actor:\n    optim:\n      lr: 1.0e-3\n")
    for override in ("worker.actor={optim: null}", "worker={actor: {optim: null}}"):
        with pytest.raises(ConfigError, match=r"^worker\.actor\.optim: must be a dictionary .* got None$"):
            load_config(path, [*BASE, override])
    merged = load_config(path, [*BASE, "worker.actor={optim: {weight_decay: 0.0}}"])
    assert merged.worker.actor.optim.lr == 1e-3 and merged.worker.actor.optim.weight_decay == 0.0
    path.write_text("trainer:\n")
    with pytest.raises(ConfigError, match=r"^trainer: must be a dictionary .* got None$"):
        load_config(path, BASE)


def test_yaml_merge_keys_load_as_safe_load_does(tmp_path):
    """`<<: *base` brings a mapping's keys in (and a plain key may override one); a plain key twice is
    still refused."""
    text = (
        "worker:\n  rollout:\n"
        "    val_override: &sampling {temperature: 0.5, top_p: 0.9, top_k: 5}\n"
        "    <<: *sampling\n"
        "    top_k: 7\n"
    )
    expected = yaml.safe_load(text)["worker"]["rollout"]
    path = tmp_path / "c.yaml"
    path.write_text(text)
    rollout = load_config(path, BASE).worker.rollout
    assert (
        (rollout.temperature, rollout.top_p, rollout.top_k)
        == (0.5, 0.9, 7)
        == tuple(expected[k] for k in ("temperature", "top_p", "top_k"))
    )
    assert rollout.val_override.top_k == 5
    path.write_text("worker:\n  actor:\n    optim:\n      lr: 1.0e-3\n      lr: 2.0e-3\n")
    with pytest.raises(ConfigError, match="duplicate key 'lr' at line 5"):
        load_config(path, BASE)


@pytest.mark.parametrize(
    "device, overrides, ignored",
    [
        ("cpu", ["worker.actor.fsdp.offload_optimizer=true"], ["offload_optimizer", "enable_sleep_mode"]),
        ("cuda", ["worker.actor.fsdp.offload_optimizer=true"], []),
        ("cuda", ["worker.actor.fsdp.offload_optimizer=true", "worker.actor.fsdp.offload_params=true"],
         ["offload_optimizer"]),
    ],
)  # fmt: skip
def test_settings_with_nothing_to_do_on_the_device_are_named(device, overrides, ignored):
    notes = ignored_settings(load_config(None, overrides), device)
    assert [n.split(" ")[0].split(".")[-1] for n in notes] == ignored, notes
