"""torchrun job: the gradient of one mini-batch must not depend on micro-batch size or world size.

    torchrun --nproc_per_node W tests/jobs/grad_invariance.py MODEL_DIR OUT.pt --micro 8,1 --modes token-mean,...

Builds the same global batch of 8 multimodal samples on every rank (fixed seeds; responses of different
lengths, old/ref logprobs perturbed so clipping and KL are active), gives each rank its contiguous share,
and for every (loss aggregation mode, micro-batch size) accumulates the gradient with `mini_batch_backward`
in the same process (one torchrun launch for all of them). Rank 0 saves {(mode, micro): full gradient}.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from PIL import Image

from spmd_grpo.config import ActorConfig, FSDPConfig, ModelConfig
from spmd_grpo.distributed import init_distributed
from spmd_grpo.model import build_policy, clip_grad_norm
from spmd_grpo.rollout import Prompt, Sample
from spmd_grpo.update import UpdateSpec, compute_logprobs, mini_batch_backward
from tests.jobs.common import encode, run_job

NUM_SAMPLES = 8


def make_samples(processor, vocab_limit: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(1234)
    samples = []
    for i in range(NUM_SAMPLES):
        image = Image.new("RGB", (56, 56 + 28 * (i % 2)), ((40 * i) % 255, 100, 200))
        enc = encode(processor, [image], f"Which color? {i}")
        length = 3 + (5 * i) % 9  # 3..11 tokens: uneven micro-batches
        response = torch.randint(0, vocab_limit, (length,), generator=gen).tolist()
        prompt = Prompt(uid=i // 2, prompt_token_ids=[], images=[image])
        samples.append(
            Sample(
                prompt,
                i % 2,
                enc["input_ids"][0].tolist(),
                response,
                [0.0] * length,
                pixel_values=enc["pixel_values"],
                image_grid_thw=enc["image_grid_thw"],
            )
        )
    return samples


def gradient(policy, samples: list[Sample], spec: UpdateSpec, world) -> dict[str, torch.Tensor]:
    """Full gradient of this rank's share of the batch under `spec` (old/ref logprobs and advantages are
    drawn from fixed seeds around the current logprobs, so clipping and the KL term are active)."""
    gen = torch.Generator().manual_seed(99)
    current = compute_logprobs(policy, samples, spec)
    for s, c in zip(samples, current, strict=True):
        s.old_logprobs = c + 0.3 * torch.randn(c.shape, generator=gen)
    for s, c in zip(samples, current, strict=True):
        s.ref_logprobs = c + 0.5 * torch.randn(c.shape, generator=gen)
    advantages = torch.randn(NUM_SAMPLES, generator=gen)
    for s, a in zip(samples, advantages.tolist(), strict=True):
        s.advantage = a
    share = NUM_SAMPLES // world.world_size
    for p in policy.parameters():
        p.grad = None
    mini_batch_backward(policy, samples[world.rank * share : (world.rank + 1) * share], spec, world)
    grads = {n: p.grad.full_tensor() for n, p in policy.named_parameters() if p.grad is not None}
    # The clipping norm must be the GLOBAL norm over all shards (same on every rank, any world size).
    grads["__clip_grad_norm__"] = torch.tensor(clip_grad_norm(policy, max_norm=1e9))
    return grads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--micro", required=True, help="comma-separated micro-batch sizes")
    ap.add_argument("--modes", default="token-mean", help="comma-separated loss aggregation modes")
    args = ap.parse_args()
    from transformers import AutoProcessor

    world = init_distributed("cpu")
    processor = AutoProcessor.from_pretrained(args.model_dir)
    actor = ActorConfig(model=ModelConfig(model_path=args.model_dir), fsdp=FSDPConfig(param_dtype="float32"))
    policy = build_policy(actor, world)
    samples = make_samples(processor, vocab_limit=256)
    base = UpdateSpec(
        temperature=1.0,
        pad_token_id=processor.tokenizer.pad_token_id,
        max_response_length=16,
        mini_batch_size=NUM_SAMPLES // world.world_size,
        micro_batch_size=1,
        experience_micro_batch_size=1,
        clip_ratio_high=0.28,
        entropy_coef=0.01,
        use_kl_loss=True,
        kl_coef=0.1,
    )
    out = {}
    for mode in args.modes.split(","):
        for micro in map(int, args.micro.split(",")):
            spec = dataclasses.replace(
                base, loss_agg_mode=mode, micro_batch_size=micro, experience_micro_batch_size=micro
            )
            out[(mode, micro)] = gradient(policy, samples, spec, world)
    if world.rank == 0:
        torch.save(out, args.out)


if __name__ == "__main__":
    run_job(main)
