"""torchrun job (CUDA): vLLM sleep level 2 frees its memory; wake + push restores the policy's samples.

torchrun --nproc_per_node 1 tests/jobs/gpu_sleep.py MODEL_DIR OUT_JSON
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoProcessor

from spmd_grpo.config.loader import load_config
from spmd_grpo.data.prompts import processor_sizes
from spmd_grpo.data.samples import Prompt
from spmd_grpo.models.build import build_policy
from spmd_grpo.parallel.collectives import init_distributed
from spmd_grpo.rollout.engine import RolloutEngine
from spmd_grpo.rollout.generate import SamplingConfig, generate
from tests.jobs.common import run_job


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    world = init_distributed("cuda")
    cfg = load_config(None, [
        f"worker.actor.model.model_path={model_dir}", "worker.actor.fsdp.param_dtype=bfloat16",
        "worker.rollout.dtype=bfloat16", "worker.rollout.gpu_memory_utilization=0.3", "worker.rollout.sleep_level=2",
        "data.max_prompt_length=256", "data.max_response_length=256", "trainer.seed=0",
    ])  # fmt: skip
    rollout_cfg = cfg.worker.rollout
    policy = build_policy(cfg.worker.actor, world)
    sizes = processor_sizes(
        cfg.data, AutoProcessor.from_pretrained(model_dir), cfg.worker.rollout.limit_videos
    )
    tied = bool(policy.config.tie_word_embeddings)
    engine = RolloutEngine.from_config(cfg, world, tie_word_embeddings=tied, sizes=sizes)
    prompts = [Prompt(uid=0, prompt_token_ids=[1, 2, 3, 4, 5])]
    greedy = SamplingConfig(n=1, temperature=1e-5, top_p=1.0, top_k=1, max_tokens=8, seed=0)
    with engine.rollout_mode(policy, 0):
        before = generate(engine, prompts, greedy, step=0)[0].response_ids
        free_awake = torch.cuda.mem_get_info()[0]
    push_bytes, push_s = engine.stats.last_sync_bytes, engine.stats.last_sync_s
    free_asleep = torch.cuda.mem_get_info()[0]
    with engine.rollout_mode(policy, 0):  # level 2 dropped the weights: full push again
        after = generate(engine, prompts, greedy, step=0)[0].response_ids
    result = {
        "reserved_gb": rollout_cfg.gpu_memory_utilization
        * torch.cuda.get_device_properties(0).total_memory
        / 1e9,
        "freed_gb": (free_asleep - free_awake) / 1e9,
        "tokens_before_sleep": before,
        "tokens_after_wake": after,
        "push_gb_per_s": push_bytes / max(push_s, 1e-9) / 1e9,
    }
    Path(out).write_text(json.dumps(result))
    engine.shutdown()


if __name__ == "__main__":
    run_job(main)
