"""torchrun job (CUDA): routing replay from vLLM on a tiny MoE model (worker.actor.moe.routing_replay=rollout).

    torchrun --nproc_per_node 1 tests/jobs/routed_experts.py MODEL_DIR OUT_JSON [--dtype bfloat16]

Builds the policy and the engine from a run config (`enable_return_routed_experts`, Model Runner V2), pushes
the policy, generates with images, and computes the trainer's old logprobs twice: replaying vLLM's routes
(`rollout`) and with the trainer's own routing (`none`). Writes OUT_JSON:
  route_shapes        per sample: (routes rows, decoder layers, top-k) and the sequence length
  route_diff_rollout  fraction of the trainer's own top-k decisions that differ from vLLM's (old pass)
  diff_replay_max     max |vLLM - trainer| logprob per response token, trainer replaying vLLM's routes
  diff_own_max        the same with the trainer's own routes
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from spmd_grpo.actor.logprob_pass import compute_logprobs
from spmd_grpo.actor.spec import UpdateSpec
from spmd_grpo.config.loader import load_config
from spmd_grpo.models.build import build_policy
from spmd_grpo.parallel.collectives import init_distributed
from spmd_grpo.rollout.engine import RolloutEngine
from spmd_grpo.rollout.generate import SamplingConfig, attach_pixel_values, generate
from tests.jobs.common import run_job
from tests.jobs.engine_parity import make_prompts


def _max_diff(samples, logprobs) -> float:
    return max(
        (torch.tensor(s.rollout_logprobs) - lp).abs().max().item()
        for s, lp in zip(samples, logprobs, strict=True)
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out_json")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    from transformers import AutoProcessor

    from spmd_grpo.data.prompts import processor_sizes

    world = init_distributed("cuda")
    processor = AutoProcessor.from_pretrained(args.model_dir)
    overrides = [f"worker.actor.model.model_path={args.model_dir}", "trainer.device=cuda", "trainer.seed=0",
                 f"worker.actor.fsdp.param_dtype={args.dtype}", f"worker.rollout.dtype={args.dtype}",
                 "worker.rollout.enable_sleep_mode=false", "worker.actor.moe.routing_replay=rollout"]  # fmt: skip
    cfg = load_config(None, overrides)
    policy = build_policy(cfg.worker.actor, world)
    sizes = processor_sizes(cfg.data, processor, cfg.worker.rollout.limit_videos)
    engine = RolloutEngine.from_config(
        cfg, world, tie_word_embeddings=bool(policy.config.tie_word_embeddings), sizes=sizes
    )
    eos = (processor.tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    sampling = SamplingConfig(
        n=2, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=12, seed=0, stop_token_ids=eos
    )
    with engine.rollout_mode(policy, 0):
        samples = generate(engine, make_prompts(processor, world.rank, 2), sampling, step=0)
    attach_pixel_values(samples, processor.image_processor, sizes)
    spec = UpdateSpec.from_config(cfg, world_size=1, pad_token_id=processor.tokenizer.pad_token_id)
    replayed = compute_logprobs(policy, samples, spec)
    diff = policy.moe.take_metrics()["diff/old"].tolist()
    routes = [s.routes for s in samples]
    own = compute_logprobs(policy, samples, dataclasses.replace(spec, routing_replay="none"))
    for s, r in zip(samples, routes, strict=True):
        s.routes = r
    result = {
        "route_shapes": [
            [list(r.shape) if r is not None else None, len(s.prompt_ids) + len(s.response_ids)]
            for s, r in zip(samples, routes, strict=True)
        ],
        "num_layers": policy.moe.num_layers,
        "top_k": policy.moe.top_k,
        "route_diff_rollout": diff[0] / max(diff[1], 1.0),
        "diff_replay_max": _max_diff(samples, replayed),
        "diff_own_max": _max_diff(samples, own),
    }
    with open(args.out_json, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    run_job(main)
