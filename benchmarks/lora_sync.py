"""LoRA weight sync, merged vs adapter-only: bytes moved per step, seconds per sync, generation seconds.

    OMP_NUM_THREADS=2 .venv/bin/torchrun --nproc_per_node 1 benchmarks/lora_sync.py --mode merged|adapter \
        [--rank 16] [--steps 3] [--dtype bfloat16] [--out result.json]

One rank (world 1, gloo, CPU) holds a LoRA policy (rank `--rank` on every language-model linear layer of the
generated Qwen2.5-VL of sync_memory.py, `.cache/bench_model_100m`, frozen base in `--dtype`) and an
in-process vLLM engine built as the trainer builds it (`RolloutEngine.from_config`) with
`worker.rollout.lora_sync=--mode`. The first push carries the base (not timed). Then each step perturbs the
adapters (a stand-in for an optimizer step: every adapter tensor moves, so each push is a new version),
pushes through `rollout_mode` (timed: `sync_s`, bytes: `sync_bytes`) and generates 16 text prompts x 64
tokens (`ignore_eos`, the same lengths in both modes; timed: `gen_s`). Printed: the means over the steps.
Run once per mode (one vLLM engine per process).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from memtools import ensure_model  # noqa: E402
from sync_memory import BENCH_SPEC, DEFAULT_MODEL_DIR  # noqa: E402

from spmd_grpo.config.loader import load_config  # noqa: E402
from spmd_grpo.data.prompts import processor_sizes  # noqa: E402
from spmd_grpo.models.build import build_policy  # noqa: E402
from spmd_grpo.models.lora import lora_layers  # noqa: E402
from spmd_grpo.parallel.collectives import init_distributed  # noqa: E402
from spmd_grpo.rollout.engine import RolloutEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["merged", "adapter"], required=True)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers import AutoProcessor
    from vllm import SamplingParams

    world = init_distributed("cpu")
    ensure_model(DEFAULT_MODEL_DIR, BENCH_SPEC, world.rank)
    cfg = load_config(
        None,
        [
            f"worker.actor.model.model_path={DEFAULT_MODEL_DIR}",
            f"worker.actor.model.lora.rank={args.rank}",
            f"worker.actor.model.lora.alpha={2 * args.rank}",
            f"worker.actor.fsdp.param_dtype={args.dtype}",
            f"worker.rollout.dtype={args.dtype}",
            f"worker.rollout.lora_sync={args.mode}",
            "data.max_prompt_length=128",
            "data.max_response_length=64",
        ],
    )
    policy = build_policy(cfg.worker.actor, world)
    processor = AutoProcessor.from_pretrained(DEFAULT_MODEL_DIR)
    sizes = processor_sizes(cfg.data, processor, cfg.worker.rollout.limit_videos)
    tied = bool(policy.config.tie_word_embeddings)
    engine = RolloutEngine.from_config(cfg, world, tie_word_embeddings=tied, sizes=sizes)
    prompts = [{"prompt_token_ids": [1 + (7 * i + j) % 200 for j in range(24)]} for i in range(16)]
    params = [SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, seed=i) for i in range(16)]
    with engine.rollout_mode(policy, 0):  # the base (and the first adapters): not timed
        engine.generate(prompts, params)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for version in range(1, args.steps + 1):
        with torch.no_grad():
            for _, layer in lora_layers(policy):
                for w in (layer.lora_A["default"].weight, layer.lora_B["default"].weight):
                    local = w.to_local()
                    local.add_(0.01 * torch.randn(local.shape, generator=gen))
        with engine.rollout_mode(policy, version):
            start = time.perf_counter()
            engine.generate(prompts, params)
            gen_s = time.perf_counter() - start
        rows.append(
            {"sync_s": engine.stats.last_sync_s, "sync_bytes": engine.stats.last_sync_bytes, "gen_s": gen_s}
        )
    result = {
        "mode": args.mode,
        "rank": args.rank,
        "dtype": args.dtype,
        "num_params": sum(p.numel() for p in policy.parameters()),
        **{k: statistics.mean(r[k] for r in rows) for k in rows[0]},
    }
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result))
    engine.shutdown()


if __name__ == "__main__":
    main()
