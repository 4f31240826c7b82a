"""Shared fixtures: tiny random checkpoints of each model family (built once, cached) and a real torchrun launcher."""

from __future__ import annotations

import gc
import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from spmd_grpo.parallel.collectives import World, free_port

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("SPMD_GRPO_CACHE", REPO / ".cache"))

# The suite imports torch, transformers and DCP (about 430k objects the cyclic garbage collector tracks). With
# CPython's default thresholds (700, 10, 10) the collector ran about 2,500 times over the unit tier and rescanned
# that heap in each full pass: 3.4 s of CPU. Collecting less often, and freezing the heap once collection is
# done, leaves 1.0 s. Objects the tests create are collected as usual.
gc.set_threshold(10_000, 10, 10)


def pytest_collection_finish(session) -> None:
    gc.freeze()


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config) -> None:
    """Once the session is over: collect once (a finalizer's error still reaches pytest's unraisable-exception
    report, which collects next), then freeze what is left, which pytest's own collections and the
    interpreter's at shutdown would otherwise rescan: 0.6 s of the unit tier's exit."""
    gc.collect()
    gc.freeze()


# A test's tier is its folder: `make test-fast` runs tests/unit, `make test-dist` tests/distributed, and so on.
# A marker written in a file could be forgotten or wrong (a torchrun test in the fast tier); the folder cannot.
TIERS = {"unit": None, "distributed": "dist", "engine": "engine", "gpu": "gpu"}
TESTS = Path(__file__).resolve().parent
UNIT_BUDGET_S = 30.0  # `make test-fast`, the tier a developer runs after every edit


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        folder = Path(str(item.path)).resolve().relative_to(TESTS).parts[0]
        if folder not in TIERS:
            raise pytest.UsageError(
                f"{item.nodeid}: tests live in tests/{{{','.join(TIERS)}}}/, the tier folders"
            )
        wrong = {m.name for m in item.iter_markers()} & (set(TIERS.values()) - {None, TIERS[folder]})
        if wrong:
            raise pytest.UsageError(f"{item.nodeid} is marked {sorted(wrong)} but lives in tests/{folder}/")
        if TIERS[folder]:
            item.add_marker(TIERS[folder])


_SESSION_START: list[float] = []


def pytest_sessionstart(session) -> None:
    import time

    _SESSION_START.append(time.perf_counter())


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """The unit tier's own duration against its budget, whenever only unit tests ran (`make test-fast`)."""
    reports = [
        r for key in ("passed", "failed") for r in terminalreporter.stats.get(key, []) if r.when == "call"
    ]
    if not reports or any(not r.nodeid.startswith("tests/unit/") for r in reports):
        return
    import time

    elapsed = time.perf_counter() - _SESSION_START[0]
    verdict = "within" if elapsed <= UNIT_BUDGET_S else "OVER"
    terminalreporter.write_line(
        f"unit tier: {elapsed:.1f} s wall, {verdict} its {UNIT_BUDGET_S:.0f} s budget"
    )


def tiny_model(tie_word_embeddings: bool = False, **spec_kwargs) -> Path:
    """Directory of a tiny random model for this spec (`family=` picks it; Qwen2.5-VL by default), built on
    first use and cached."""
    from spmd_grpo.tools.make_tiny_model import TinyModelSpec, cached_tiny_model

    return cached_tiny_model(CACHE, TinyModelSpec(tie_word_embeddings=tie_word_embeddings, **spec_kwargs))


def checkpoint_stand_in(path: Path, config: str = '{"model_type": "qwen2_5_vl"}') -> Path:
    """A model directory the start-up checks accept without reading it (config.json, a tokenizer file, a chat
    template, a one-tensor weights file): for tests that stop before any model is built."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(config)
    (path / "tokenizer.json").write_text("{}")
    (path / "chat_template.jinja").write_text("{{ messages }}")
    import torch
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(1)}, path / "model.safetensors")
    return path


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


def torchrun_command(
    args: list[str], nproc: int = 2, *, launcher: str = "torch.distributed.run", env: dict | None = None
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of `torchrun --nproc_per_node nproc ARGS` on loopback (gloo on CPU), one
    thread per rank; `launcher="spmd_grpo.launch"` runs it through the project's launcher instead."""
    cmd = [sys.executable, "-m", launcher, "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), *args]  # fmt: skip
    # Jobs are run by path; PYTHONPATH lets them import `tests.jobs.common`.
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath}
    return cmd, {**full_env, **(env or {})}


def torchrun(
    args: list[str], nproc: int = 2, timeout: int = 600, env: dict | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc_per_node nproc ARGS` to the end; with `check`, fail the test with the output's
    tail when it exits non-zero."""
    cmd, full_env = torchrun_command(args, nproc, env=env)
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"torchrun exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}")
    return proc


# A world of one CPU process without a process group, for the functions that take a `World`.
ONE_CPU_RANK = World(rank=0, world_size=1, local_rank=0, device_type="cpu", backend="gloo")


def fake_checkpoint(
    run_dir: Path, step: int | str, *, complete: bool = True, cfg=None, state: dict | None = None
) -> Path:
    """`run_dir/checkpoints/global_step_{step}` (or `/<step>` for a name such as "global_step_3.tmp") with a real
    one-tensor DCP payload and an empty scheduler state; with `complete`, its trainer_state.json (`state`,
    default {"step": step} for a number); given `cfg`, its config.yaml."""
    import json

    import torch
    import torch.distributed.checkpoint as dcp

    d = run_dir / "checkpoints" / (f"global_step_{step}" if isinstance(step, int) else step)
    d.mkdir(parents=True)
    dcp.save({"x": torch.zeros(4)}, checkpoint_id=str(d), no_dist=True)
    torch.save({}, d / "scheduler.pt")
    if cfg is not None:
        from spmd_grpo.run.saved_config import dump_yaml

        dump_yaml(cfg, d / "config.yaml")
    if complete:
        default = {"step": step} if isinstance(step, int) else {}
        (d / "trainer_state.json").write_text(json.dumps(default if state is None else state))
    return d


CHECKPOINT_JOB = "tests/jobs/checkpoint_roundtrip.py"
SAVED_CASES = [  # (family, tied embeddings, LoRA rank, EP size): what the checkpoint and export tests read
    ("qwen2_5_vl", False, 0, 1),
    ("qwen2_5_vl", False, 4, 1),
    ("qwen2_5_vl", True, 0, 1),
    ("qwen2_5_vl", True, 4, 1),
    ("qwen2_vl", False, 0, 1),
    ("qwen3_vl", False, 0, 1),
    ("qwen3_vl_moe", False, 0, 2),
]


@pytest.fixture(scope="session")
def saved_checkpoints(tmp_path_factory):
    """`saved_checkpoints(model_dir, lora_rank=0)` -> directory with `run/` (checkpoints of steps 1 and 2, saved at world 2
    by tests/jobs/checkpoint_roundtrip.py) and `save.pt` (what the job recorded), shared by the checkpoint and
    export tests. The first call saves every case of SAVED_CASES in one launch (the MoE one at
    expert_parallel_size=2); another model gets its own."""
    cache: dict[tuple[Path, int], Path] = {}

    def save(cases: list[tuple[Path, int, int]]) -> None:
        job, works = [CHECKPOINT_JOB, "--phase", "save"], []
        for model_dir, lora_rank, ep in cases:
            works.append(tmp_path_factory.mktemp("ckpt"))
            job += [
                "--case",
                str(model_dir),
                str(works[-1] / "run"),
                str(works[-1] / "save.pt"),
                str(lora_rank),
                str(ep),
            ]
        torchrun(job)
        cache.update(
            ((model_dir, rank), work) for (model_dir, rank, _), work in zip(cases, works, strict=True)
        )

    def get(model_dir: Path, lora_rank: int = 0) -> Path:
        if not cache:
            save(
                [
                    (tiny_model(tie_word_embeddings=tied, family=family), rank, ep)
                    for family, tied, rank, ep in SAVED_CASES
                ]
            )
        if (model_dir, lora_rank) not in cache:
            save([(model_dir, lora_rank, 1)])
        return cache[model_dir, lora_rank]

    return get


# ------------------------------------------------------------------ training runs that share one launch
TRAINER_RUNS: dict[str, tuple[Path, Callable[[Path], list[str]]]] = {}
"""name -> (the registering test module, its arguments): see `trainer_run`."""


def trainer_run(name: str, module: str, arguments: Callable[[Path], list[str]]) -> str:
    """Register a run of the real entry point on 2 ranks (`torchrun -m spmd_grpo.train CONFIG [key=value ...]`)
    for the `trained` fixture and return its name. `arguments(work_dir)` gives `CONFIG [key=value ...]`,
    writing what the run reads into `work_dir` and pointing its output there; `module` is the registering
    module's `__file__`. Test modules register at import, so every run of the session is known before its
    first test starts."""
    assert name not in TRAINER_RUNS, f"trainer run {name} registered twice"
    TRAINER_RUNS[name] = (Path(module).resolve(), arguments)
    return name


def own_output(text: str, mark: str, i: int) -> str:
    """Part `i` of one stream of a launch that runs parts in turn: from `mark i` to `mark i+1` (each rank prints
    the marks)."""
    start, end = text.find(f"{mark} {i}\n"), text.find(f"{mark} {i + 1}\n")
    return text[max(start, 0) : end if end >= 0 else len(text)]


@pytest.fixture(scope="session")
def trained(request, tmp_path_factory):
    """`trained(name)` -> (work_dir, console) of a `trainer_run`. The first call trains, in one launch, every
    run registered by a module that has a selected test, one after the other (tests/jobs/train_in_turn.py):
    torch, transformers and vLLM start once for all of them instead of once per run. A run that fails ends
    the launch, and every test that asks for a run fails with its output."""
    from tests.jobs.train_in_turn import RUN_MARK

    results: dict[str, tuple[Path, str]] = {}
    failed: list[str] = []

    def get(name: str) -> tuple[Path, str]:
        if failed:
            pytest.fail(failed[0])
        if not results:
            modules = {Path(str(item.path)).resolve() for item in request.session.items}
            names = [n for n, (module, _) in TRAINER_RUNS.items() if module in modules]
            work = {n: tmp_path_factory.mktemp(n) for n in names}
            job = ["tests/jobs/train_in_turn.py"]
            for n in names:
                job += ["--train", *TRAINER_RUNS[n][1](work[n])]
            cmd, env = torchrun_command(job)
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
            if proc.returncode != 0:
                failed.append(f"torchrun exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}")
                pytest.fail(failed[0])
            for i, n in enumerate(names):
                results[n] = (
                    work[n],
                    own_output(proc.stdout, RUN_MARK, i) + own_output(proc.stderr, RUN_MARK, i),
                )
        return results[name]

    return get


# ------------------------------------------------------------------------------- Slurm, which cannot exist here
SCONTROL = r"""#!/bin/bash
# Test shim for `scontrol show hostnames LIST`: LIST is comma-separated, one host per entry.
if [[ $# -eq 3 && $1 == show && $2 == hostnames ]]; then
    tr ',' '\n' <<<"$3"
    exit 0
fi
echo "scontrol shim: unsupported: $*" >&2
exit 2
"""

SRUN = r"""#!/bin/bash
# Test shim for `srun [--export=ALL|NONE] --ntasks-per-node=1 --nodes=N [--kill-on-bad-exit=1] CMD...`: one copy
# of CMD per node. The environment each copy gets follows srun's rule: --export, else SLURM_EXPORT_ENV (which
# `sbatch --export=NONE` sets to NONE in the job), else ALL; NONE passes the SLURM_* variables only.
nodes=${SLURM_NNODES:-1}
kill_on_bad_exit=0
export_env=${SLURM_EXPORT_ENV:-ALL}
while [[ $# -gt 0 && $1 == -* ]]; do
    case $1 in
        --export=ALL | --export=NONE) export_env=${1#*=} ;;
        --nodes=*) nodes=${1#*=} ;;
        --ntasks-per-node=1) ;;
        --kill-on-bad-exit=1) kill_on_bad_exit=1 ;;
        *) echo "srun shim: unsupported option $1" >&2; exit 2 ;;
    esac
    shift
done
case $export_env in
    ALL) environment=(env) ;;
    NONE) mapfile -t slurm_vars < <(env | grep '^SLURM_'); environment=(env -i "${slurm_vars[@]}") ;;
    *) echo "srun shim: unsupported SLURM_EXPORT_ENV=$export_env" >&2; exit 2 ;;
esac
pids=()
for ((node = 0; node < nodes; node++)); do
    echo "srun shim: starting node $node of $nodes (export $export_env): $*" >&2
    "${environment[@]}" SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" &
    pids+=("$!")
done
rc=0
for ((left = nodes; left > 0; left--)); do
    wait -n
    code=$?
    if ((code > rc)); then rc=$code; fi
    if ((code != 0 && kill_on_bad_exit)); then kill "${pids[@]}" 2>/dev/null; fi
done
echo "srun shim: all $nodes copies exited, max exit code $rc" >&2
exit "$rc"
"""


def _write_executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


@pytest.fixture(scope="session")
def slurm_shims(tmp_path_factory) -> Path:
    """A folder to put first on PATH: `scontrol` and `srun` stand-ins with the interface the launch scripts use."""
    shims = tmp_path_factory.mktemp("slurm_bin")
    _write_executable(shims / "scontrol", SCONTROL)
    _write_executable(shims / "srun", SRUN)
    return shims
