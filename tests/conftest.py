"""Shared fixtures: tiny random checkpoints of each model family (built once, cached) and a real torchrun launcher."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("SPMD_GRPO_CACHE", REPO / ".cache"))

# The suite imports torch, transformers and DCP (about 430k objects the cyclic garbage collector tracks). With
# CPython's default thresholds (700, 10, 10) the collector ran about 2,500 times over the unit tier and rescanned
# that heap in each full pass: 3.4 s of CPU. Collecting less often, and freezing the heap once collection is
# done, leaves 1.0 s. Objects the tests create are collected as usual.
gc.set_threshold(10_000, 10, 10)


def pytest_collection_finish(session) -> None:
    gc.freeze()


def tiny_model(tie_word_embeddings: bool = False, **spec_kwargs) -> Path:
    """Directory of a tiny random model for this spec (`family=` picks it; Qwen2.5-VL by default), built on
    first use and cached."""
    from spmd_grpo.tools.make_tiny_model import TinyModelSpec, cached_tiny_model

    return cached_tiny_model(CACHE, TinyModelSpec(tie_word_embeddings=tie_word_embeddings, **spec_kwargs))


@pytest.fixture(scope="session")
def tiny_untied() -> Path:
    return tiny_model(tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_tied() -> Path:
    return tiny_model(tie_word_embeddings=True)


@pytest.fixture(scope="session")
def processor():
    """The default tiny model's processor, shared: loading one costs more than most unit tests."""
    import transformers

    return transformers.AutoProcessor.from_pretrained(tiny_model())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(
    args: list[str], nproc: int = 2, timeout: int = 600, env: dict | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc_per_node nproc ARGS` (gloo on CPU); with `check`, fail the test with the
    output's tail when it exits non-zero."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        *args,
    ]
    # Jobs are run by path; PYTHONPATH lets them import `tests.jobs.common`.
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath}
    full_env.update(env or {})
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"torchrun exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}")
    return proc


CHECKPOINT_JOB = "tests/jobs/checkpoint_roundtrip.py"


@pytest.fixture(scope="session")
def saved_checkpoints(tmp_path_factory):
    """`saved_checkpoints(model_dir)` -> directory with `run/` (checkpoints of steps 1 and 2, saved at world 2
    by tests/jobs/checkpoint_roundtrip.py) and `save.pt` (what the job recorded): one launch per model for
    the whole session, shared by the checkpoint and export tests."""
    cache: dict[Path, Path] = {}

    def get(model_dir: Path) -> Path:
        if model_dir not in cache:
            work = tmp_path_factory.mktemp("ckpt")
            torchrun(
                [CHECKPOINT_JOB, str(model_dir), str(work / "run"), str(work / "save.pt"), "--phase", "save"]
            )
            cache[model_dir] = work
        return cache[model_dir]

    return get
