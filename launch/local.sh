#!/bin/bash
# spmd_grpo on one machine, no scheduler. From the repository root:
#
#   launch/local.sh configs/qwen2_5_vl_7b_geo3k_grpo.yaml [section.key=value ...]
#
# Knobs: NPROC_PER_NODE (ranks, default 8: one per GPU/NPU), VENV (environment to activate, default .venv;
# empty: use the current one). The device comes from the config's `trainer.device` (auto: npu, cuda or cpu).
# On Ascend pass `trainer.device=npu worker.rollout.sleep_level=1` and source CANN first (see
# launch/slurm/train_npu.sbatch for the environment).
set -euo pipefail

VENV=${VENV-.venv}
if [[ -n $VENV ]]; then
    set +eu
    # shellcheck source=/dev/null
    source "$VENV/bin/activate"
    set -eu
fi

# spmd_grpo.launch is torchrun (same options) whose exit code is 128 + signal when the job was signalled.
exec python -m spmd_grpo.launch --standalone --nproc_per_node "${NPROC_PER_NODE:-8}" -m spmd_grpo.train "$@"
