"""torchrun job: the gradient of one mini-batch must not depend on micro-batch size or world size.

    torchrun --nproc_per_node W tests/jobs/grad_invariance.py MODEL_DIR OUT.pt --micro M

Builds the same global batch of 8 multimodal samples on every rank (fixed seeds; responses of different
lengths, old/ref logprobs perturbed so clipping and KL are active), gives each rank its contiguous share,
accumulates the gradient with `mini_batch_backward`, and rank 0 saves the full (unsharded) gradient.
"""

from __future__ import annotations

import argparse

import torch
from PIL import Image

from spmd_grpo.config import ActorConfig, AlgorithmConfig, FSDPConfig, ModelConfig
from spmd_grpo.distributed import init_distributed
from spmd_grpo.model import build_policy, clip_grad_norm
from spmd_grpo.rollout import Prompt, Sample
from spmd_grpo.update import compute_logprobs, mini_batch_backward

NUM_SAMPLES = 8


def make_samples(processor, vocab_limit: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(1234)
    samples = []
    for i in range(NUM_SAMPLES):
        image = Image.new("RGB", (56, 56 + 28 * (i % 2)), ((40 * i) % 255, 100, 200))
        content = [{"type": "image"}, {"type": "text", "text": f"Which color? {i}"}]
        text = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True
        )
        enc = processor(text=[text], images=[image], return_tensors="pt")
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
                "",
                "stop",
                enc["pixel_values"],
                enc["image_grid_thw"],
            )
        )
    return samples


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--micro", type=int, required=True)
    ap.add_argument("--loss-agg-mode", default="token-mean")
    args = ap.parse_args()
    from transformers import AutoProcessor

    world = init_distributed("cpu")
    processor = AutoProcessor.from_pretrained(args.model_dir)
    actor = ActorConfig(
        model=ModelConfig(model_path=args.model_dir),
        fsdp=FSDPConfig(param_dtype="float32"),
        micro_batch_size_per_device_for_update=args.micro,
        micro_batch_size_per_device_for_experience=args.micro,
        loss_agg_mode=args.loss_agg_mode,
        clip_ratio_high=0.28,
        entropy_coef=0.01,
    )
    alg = AlgorithmConfig(use_kl_loss=True, kl_coef=0.1)
    policy = build_policy(actor, world)
    samples = make_samples(processor, vocab_limit=256)
    pad_id = processor.tokenizer.pad_token_id
    gen = torch.Generator().manual_seed(99)
    current = compute_logprobs(policy, samples, actor, 1.0, pad_id)
    old = [c + 0.3 * torch.randn(c.shape, generator=gen) for c in current]
    ref = [c + 0.5 * torch.randn(c.shape, generator=gen) for c in current]
    advantages = torch.randn(NUM_SAMPLES, generator=gen)

    share = NUM_SAMPLES // world.world_size
    mine = slice(world.rank * share, (world.rank + 1) * share)
    mini_batch_backward(
        policy, samples[mine], old[mine], ref[mine], advantages[mine], actor, alg, 16, 1.0, pad_id, world
    )
    grads = {n: p.grad.full_tensor() for n, p in policy.named_parameters() if p.grad is not None}
    # The clipping norm must be the GLOBAL norm over all shards (same on every rank, any world size).
    grads["__clip_grad_norm__"] = torch.tensor(clip_grad_norm(policy, max_norm=1e9))
    if world.rank == 0:
        torch.save(grads, args.out)


if __name__ == "__main__":
    main()
    # Tear the process group down before the interpreter exits: gloo's threads otherwise race the exit
    # ("terminate called without an active exception", exit -6, seen as a flaky test).
    from spmd_grpo.distributed import barrier, destroy

    barrier()
    destroy()
