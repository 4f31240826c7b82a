"""The stack's versions: the installed (tested) one passes; anything outside the range stops the CLI with one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spmd_grpo.versions import (
    SUPPORTED,
    VersionError,
    check_versions,
    installed_versions,
    version_line,
)
from tests.conftest import REPO

GOOD = {"torch": "2.13.0", "transformers": "5.19.0", "vllm": "0.32.0"}


def test_installed_stack_is_in_range():
    found = installed_versions()
    assert set(SUPPORTED) <= set(found) and all(found[k] for k in SUPPORTED), found
    assert check_versions(found) == []
    assert version_line(found).startswith("versions: torch ")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"vllm": "0.11.0"}, "vllm 0.11.0 is outside the tested range >=0.32,<0.33"),
        ({"vllm": "0.33.1"}, "vllm 0.33.1 is outside the tested range >=0.32,<0.33"),
        ({"torch": "2.12.0+cu128"}, "torch 2.12.0+cu128 is outside the tested range >=2.13,<2.14"),
        ({"transformers": None}, "transformers is not installed"),
        ({"vllm-ascend": "0.31.0"}, "vllm-ascend 0.31.0 does not match vllm 0.32.0"),
    ],
)
def test_out_of_range_is_one_line(change, message, monkeypatch):
    monkeypatch.delenv("SPMD_GRPO_ALLOW_UNTESTED_VERSIONS", raising=False)
    with pytest.raises(VersionError) as e:
        check_versions({**GOOD, **change})
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_local_builds_of_a_tested_version_pass():
    assert check_versions({**GOOD, "torch": "2.13.0+cpu", "vllm": "0.32.0.post1"}) == []


def test_override_turns_the_error_into_a_warning(monkeypatch):
    monkeypatch.setenv("SPMD_GRPO_ALLOW_UNTESTED_VERSIONS", "1")
    assert check_versions({**GOOD, "vllm": "0.40.0"}) == [
        "vllm 0.40.0 is outside the tested range >=0.32,<0.33"
    ]


def test_cli_stops_before_any_work(tmp_path):
    """A fake `vllm` distribution of another version, first on the path: exit 2, one line, no traceback."""
    dist = tmp_path / "vllm-0.11.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.11.0\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(
        '{"model_type": "qwen2_5_vl"}'
    )  # the config is valid: the version stops the job
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    proc = subprocess.run(
        [sys.executable, "-m", "spmd_grpo.train", "configs/smoke.yaml", f"worker.actor.model.model_path={tmp_path / 'model'}"],
        cwd=REPO, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "version error: vllm 0.11.0 is outside the tested range >=0.32,<0.33 "
        "(see spmd_grpo/versions.py; SPMD_GRPO_ALLOW_UNTESTED_VERSIONS=1 to try anyway)"
    ]


# requirements/npu.txt (the Ascend install, not lockable by uv): each pin -> the tested range it must equal.
NPU_REQUIREMENTS = REPO / "requirements" / "npu.txt"
NPU_PIN_RANGE = {"vllm": "vllm", "vllm-ascend": "vllm", "torch": "torch", "torch-npu": "torch"}
NPU_PIN_RANGE |= {name: name for name in SUPPORTED}


def _agrees(specifier: str, low: str, high: str) -> bool:
    """The specifier admits exactly [low, high) on probes at and around both bounds."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    below = ".".join(map(str, (*Version(low).release[:-1], Version(low).release[-1] - 1)))
    probes = [below, f"{below}.9", low, f"{low}.0", f"{low}.9", f"{low}.1.post1", high, f"{high}.1"]
    spec = SpecifierSet(specifier)
    return all(
        spec.contains(p) == (Version(low) <= Version(Version(p).base_version) < Version(high)) for p in probes
    )


def _npu_pins() -> dict[str, str]:
    from packaging.requirements import Requirement

    lines = [line.split("#")[0].strip() for line in NPU_REQUIREMENTS.read_text().splitlines()]
    return {(req := Requirement(line)).name: str(req.specifier) for line in lines if line}


def test_npu_requirements_agree_with_the_tested_ranges():
    pins = _npu_pins()
    assert {"vllm-ascend", "torch-npu", *SUPPORTED} <= set(pins), pins
    for name, specifier in pins.items():
        assert name in NPU_PIN_RANGE, f"requirements/npu.txt pins {name}, which versions.py does not range"
        low, high = SUPPORTED[NPU_PIN_RANGE[name]]
        assert _agrees(specifier, low, high), f"{name}{specifier} in requirements/npu.txt != >={low},<{high}"


@pytest.mark.parametrize("drifted", [">=0.31,<0.33", ">=0.32,<0.34", "==0.32.0", ">=0.32", "==0.33.*"])
def test_a_drifted_npu_pin_is_caught(drifted):
    assert _agrees(">=0.32,<0.33", "0.32", "0.33") and _agrees("==0.32.*", "0.32", "0.33")
    assert not _agrees(drifted, "0.32", "0.33")


def test_pyproject_bounds_are_the_tested_ranges():
    """pip and uv install what the start-up check accepts: pyproject's bounds equal SUPPORTED."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["gpu"]]
    for name, (low, high) in SUPPORTED.items():
        (req,) = [r for r in requirements if r.name == name]
        assert {str(s) for s in req.specifier} == {f">={low}", f"<{high}"}, (name, str(req.specifier))
