"""The launch scripts start real ranks that get the config and the overrides: each script runs its real
`python -m spmd_grpo.launch ... -m spmd_grpo.train CONFIG ...` line under torchrun (2 ranks, gloo).

Slurm cannot exist here, so `srun` and `scontrol` are the stand-ins of tests/conftest.py (`slurm_shims`) on
PATH, and the NPU script's CANN `set_env.sh` files are empty. The GPU template is run through a real 2-node
training in tests/engine/test_launch.py. An unknown key given on `launch/local.sh`'s command line must come
back as the config error naming it, once, from the launcher's check of `spmd_grpo.train`'s command line (what
torchrun hands every rank), with exit code 2 and no torchrun failure report: that proves the config path and
the overrides reached it.

The NPU template runs on 2 "nodes" of 1 rank as a `--dry-run` (each rank plans the job and exits 0, no
process group), which needs the two torchrun agents to meet first: the allocation's first host is 0.0.0.0,
this machine under a name torchrun does not recognise as its own (as a node whose Slurm name resolves to
another interface than its host name), so only the template's explicit `is_host` makes node 0 host the
rendezvous store; and the job runs with `SLURM_EXPORT_ENV=NONE`, as `sbatch --export=NONE` leaves it, under
which srun passes its tasks nothing but the SLURM_* variables unless told `--export=ALL` (the python on PATH
would be gone). The overrides carry a mapping with a space and a list (quoting through the script, srun and
torchrun) and set `worker.rollout.sleep_level` again after the script's own `trainer.device=npu
worker.rollout.sleep_level=1` (a key given twice is refused); each rank's plan shows `trainer.device=npu`.

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
        "ASCEND_TOOLKIT_HOME": str(root / "toolkit"),
        "ASCEND_NNAL_HOME": str(root / "nnal"),
    }


def test_local_script_reaches_the_ranks_with_config_and_overrides(slurm_env):
    env = {**os.environ, **slurm_env}
    proc = subprocess.run(
        ["bash", "launch/local.sh", "configs/smoke.yaml", f"{UNKNOWN}=1"],
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


def test_npu_template_two_nodes_meet_with_the_job_environment_and_quoted_overrides(slurm_env):
    env = {
        **os.environ,
        **slurm_env,
        "SLURM_JOB_NODELIST": "0.0.0.0,0.0.0.0",
        "SLURM_NNODES": "2",
        "NPROC_PER_NODE": "1",
        "SLURM_EXPORT_ENV": "NONE",
        "PORT": str(free_port()),
        "RDZV_JOIN_TIMEOUT": "60",
    }
    overrides = [
        "worker.actor.optim={weight_decay: 0.0}",
        "trainer.logger=[console,jsonl]",
        "worker.rollout.sleep_level=2",
    ]
    proc = subprocess.run(
        ["bash", "launch/slurm/train_npu.sbatch", "configs/qwen2_5_vl_7b_geo3k_grpo.yaml", *overrides, "--dry-run",
         "--nnodes", "2", "--nproc-per-node", "1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "job 4242: 2 nodes x 1 ranks, rendezvous 0.0.0.0:" in out, out[-3000:]
    assert out.count("plan: 2 nodes x 1 devices = world 2") == 2, out[-3000:]  # one per rank
    assert out.count("off on Ascend NPUs") == 2, out[-3000:]  # the template's trainer.device=npu


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
