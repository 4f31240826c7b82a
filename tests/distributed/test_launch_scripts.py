"""The launch scripts start real ranks that get the config and the overrides: each script runs its real
`python -m spmd_grpo.launch ... -m spmd_grpo.train CONFIG ...` line under torchrun (2 ranks, gloo).

Slurm cannot exist here, so `srun` and `scontrol` are the stand-ins of tests/conftest.py (`slurm_shims`) on
PATH, on a one-node allocation, and the NPU script's CANN `set_env.sh` files are empty. The job's
SLURM_EXPORT_ENV is NONE, as `sbatch --export=NONE` leaves it: srun then passes its tasks the SLURM_*
variables only (the python on PATH among what is lost) unless the script asks for `--export=ALL`. The GPU template is
run through a real 2-node training in tests/engine/test_launch.py. An unknown key
given on the script's command line must come back as the config error naming it, once, from the launcher's
check of `spmd_grpo.train`'s command line (what torchrun hands every rank), with exit code 2 and no
torchrun failure report: that proves the config path and the overrides reached it (after the NPU script's
own `trainer.device=npu worker.rollout.sleep_level=1`, which are valid keys and which the command line may
set again: a key given twice is refused).

A config error only the ranks find (here a reward file that fails to import only under torchrun, standing
in for a file one node lacks) is said once, by rank 0, and the launcher exits 2 without torchrun's
`ChildFailedError` report: the other rank, which waits before speaking, is stopped by torchrun first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, checkpoint_stand_in, free_port, torchrun_command

UNKNOWN = "trainer.set_by_the_launch_script"


@pytest.fixture(scope="module")
def slurm_env(slurm_shims, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cann")
    for script in ("toolkit/set_env.sh", "nnal/atb/set_env.sh"):
        (root / script).parent.mkdir(parents=True, exist_ok=True)
        (root / script).write_text("")
    return {
        "PATH": f"{slurm_shims}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "VENV": "",  # the test's own interpreter is on PATH
        "NPROC_PER_NODE": "2",
        "OMP_NUM_THREADS": "1",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "127.0.0.1",
        "SLURM_NNODES": "1",
        "SLURM_EXPORT_ENV": "NONE",
        "ASCEND_TOOLKIT_HOME": str(root / "toolkit"),
        "ASCEND_NNAL_HOME": str(root / "nnal"),
    }


@pytest.mark.parametrize("script", ["launch/local.sh", "launch/slurm/train_npu.sbatch"])
def test_script_reaches_every_rank_with_config_and_overrides(script, slurm_env):
    env = {**os.environ, **slurm_env, "PORT": str(free_port())}
    # The NPU script's sleep_level given again: the user's value replaces its default, not a key set twice.
    again = ["worker.rollout.sleep_level=2"] if script.endswith(".sbatch") else []
    proc = subprocess.run(
        ["bash", script, "configs/smoke.yaml", *again, f"{UNKNOWN}=1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert out.count(f"config error: unknown config key {UNKNOWN}") == 1, out[-3000:]
    assert "ChildFailedError" not in out and "Traceback" not in out, out[-3000:]
    if script.endswith(".sbatch"):
        assert "job 4242: 1 nodes x 2 ranks, rendezvous 127.0.0.1:" in out, out[-3000:]


RANKS_ONLY_REWARD = """import os
if "TORCHELASTIC_RUN_ID" in os.environ:
    raise ImportError("this module fails on the ranks only")


def fn(samples):
    return []
"""


def test_a_config_error_only_the_ranks_find_is_said_once_with_exit_2(tmp_path):
    checkpoint_stand_in(tmp_path / "model")  # enough to validate
    (tmp_path / "reward.py").write_text(RANKS_ONLY_REWARD)
    cmd, env = torchrun_command(
        ["-m", "spmd_grpo.train", "configs/smoke.yaml", f"worker.actor.model.model_path={tmp_path / 'model'}",
         f"worker.reward.reward_function={tmp_path / 'reward.py'}:fn", f"trainer.output_dir={tmp_path}"],
        launcher="spmd_grpo.launch",
    )  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    (line,) = [line for line in out.splitlines() if line.strip()]  # nothing else, torchrun's lines included
    assert line.startswith("config error: worker.reward.reward_function") and "fails on the ranks" in line, (
        out
    )
    assert "ChildFailedError" not in out and "Traceback" not in out, out[-3000:]
