"""torchrun job: ranks whose micro-batches hold different modalities make the same collective calls.

    torchrun --nproc_per_node 2 tests/jobs/mixed_modalities.py MODEL_DIR [MODEL_DIR ...] OUT_PREFIX
        [--without-idle-tower] [--without-idle-video]

For each case (padded or packed layout) x (trained or frozen vision tower), each rank holds 4 samples of
its own composition: in the first scenario prompts with 0, 1 or 3 images (rank 1 text-only) in a run
without videos; in the second, drawn per rank, text-only, 1 image, 3 images, a video, or an image and a
video in one prompt, in a run that allows videos (every forward runs the tower on video input),
then runs what a training step runs: the forward-only logprob pass (one sample per micro-batch, so one
rank's micro-batch is text-only while the other's holds images) and the update's backward, once with one
sample per micro-batch and once with token-budget micro-batches where rank 1 holds one sample and pads with
three zero-weight micro-batches. Each rank then recomputes every one of its samples alone in a plain
single-process model (`from_pretrained`, no FSDP) and writes `OUT_PREFIX.rank<r>.json`: per model directory
(each is run in turn, in one launch) and per case the largest logprob difference and whether the gradient is
finite.

`--without-idle-tower` replaces `PolicyModule._idle_tower` by a zero that runs no tower (the mechanism
removed): the job must then fail in a collective instead of finishing. `--without-idle-video` removes only
the dummy video call (a micro-batch without a video beside one with a video): the second scenario must fail.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random

import torch
from PIL import Image

from spmd_grpo.actor.logprob_pass import compute_logprobs
from spmd_grpo.actor.micro_batches import collate_samples, micro_batches
from spmd_grpo.actor.spec import UpdateSpec
from spmd_grpo.actor.update import mini_batch_backward
from spmd_grpo.config.workers import ActorConfig, FSDPConfig, ModelConfig
from spmd_grpo.data.samples import Prompt, Sample
from spmd_grpo.models.build import build_policy
from spmd_grpo.models.policy import PolicyModule, unsamplable_token_ids
from spmd_grpo.parallel.collectives import init_distributed
from spmd_grpo.rollout.generate import attach_video_inputs
from tests.jobs.common import chat_text, encode, encode_with_videos, make_video, run_job, video_setup

NUM_SAMPLES = 4
SCENARIOS = {"one_rank_text_only": False, "random": True}  # scenario -> whether the run allows videos
MIXES = [(0, 0), (1, 0), (3, 0), (0, 1), (1, 1)]  # (images, videos) of one prompt


def compositions(scenario: str, rank: int) -> list[tuple[int, int]]:
    """(images, videos) per sample of this rank's 4 samples. The random draw (seed 17) gives rank 0
    [(1, 1), (0, 1), (3, 0), (3, 0)] and rank 1 [(1, 0), (0, 0), (0, 1), (3, 0)]: every mix, and slots where
    one rank has a video and the other none."""
    if scenario == "one_rank_text_only":
        return [(0, 0), (1, 0), (3, 0), (0, 0)] if rank == 0 else [(0, 0)] * 4
    rng = random.Random(17 + rank)
    return [rng.choice(MIXES) for _ in range(NUM_SAMPLES)]


def make_samples(processor, counts: list[tuple[int, int]], rank: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(100 + rank)
    sizes = video_setup(processor)
    samples = []
    for i, (k, v) in enumerate(counts):
        images = [
            Image.new("RGB", (56 + 28 * (j % 2), 56), (60 * i + 20 * j, 90, 30 * rank)) for j in range(k)
        ]
        videos = [make_video([(40 * f, 30 * i, 90 * rank) for f in range(4)], sizes.video) for _ in range(v)]
        text = f"Rank {rank} sample {i}: how many images?"
        prompt = Prompt(uid=i, prompt_token_ids=[], images=images, videos=videos)
        if videos:  # the trainer's call (`attach_video_inputs`), with the text placed in the chat
            sample = Sample(prompt, 0, [], [], [])
            attach_video_inputs([sample], processor, sizes, torch.float32)
            enc = encode_with_videos(processor, images, videos, text, sizes)
        elif images:
            enc = encode(processor, images, text)
            sample = Sample(prompt, 0, [], [], [], pixel_values=enc["pixel_values"])
            sample.image_grid_thw = enc["image_grid_thw"]
        else:  # a text-only prompt: no image processor call at all, as the data loader does
            enc = processor(text=[chat_text(processor, 0, text)], return_tensors="pt")
            sample = Sample(prompt, 0, [], [], [])
        length = 2 + (3 * i + rank) % 6
        sample.prompt_ids = enc["input_ids"][0].tolist()
        sample.response_ids = torch.randint(0, 256, (length,), generator=gen).tolist()
        sample.rollout_logprobs, sample.advantage = [0.0] * length, float(i % 3 - 1)
        samples.append(sample)
    return samples


def reference_logprobs(model_dir: str, samples: list[Sample], pad_id: int) -> list[torch.Tensor]:
    """Each sample alone through the unsharded model: the single-process reference."""
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    model = PolicyModule(hf, unsamplable_token_ids(hf.config)).eval()
    with torch.no_grad():
        return [model(collate_samples([s], pad_id))[0][0, : len(s.response_ids)] for s in samples]


def run_case(policy, samples: list[Sample], spec: UpdateSpec, world, reference) -> dict:
    logprobs = compute_logprobs(policy, samples, spec)
    diff = max((a - b).abs().max().item() for a, b in zip(logprobs, reference, strict=True))
    for s, lp in zip(samples, logprobs, strict=True):
        s.old_logprobs = lp
    finite, micro_batches_used = True, []
    # One sample per micro-batch on both ranks; then token-budget micro-batches of one sample each where rank 1
    # holds a single sample: it pads with zero-weight micro-batches while rank 0's hold images.
    padding = dataclasses.replace(spec, dynamic_batching=True, max_token_len_for_update=1)
    for budget_spec, mine in ((spec, samples), (padding, samples if world.rank == 0 else samples[:1])):
        for p in policy.parameters():
            p.grad = None
        mini_batch_backward(policy, mine, budget_spec, world)
        parts = micro_batches(mine, budget_spec, for_update=True, padded=not policy.padding_free)
        micro_batches_used.append([len(p) for p in parts])  # an empty part: a zero-weight padding micro-batch
        grads = [p.grad.full_tensor() for p in policy.parameters() if p.grad is not None]
        finite &= bool(grads) and all(torch.isfinite(g).all().item() for g in grads)
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    return {"logprob_diff_max": diff, "grad_finite": finite, "micro_batch_sizes": micro_batches_used,
            "images": [len(s.prompt.images) for s in samples], "lengths": lengths,
            "videos": [len(s.prompt.videos) for s in samples]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dirs", nargs="+")
    ap.add_argument("out_prefix")
    ap.add_argument("--without-idle-tower", action="store_true")
    ap.add_argument("--without-idle-video", action="store_true")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated (default: all)")
    args = ap.parse_args()
    idle_tower = PolicyModule._idle_tower
    if args.without_idle_tower:
        PolicyModule._idle_tower = lambda self, device, encode: torch.zeros((), device=device)
    if args.without_idle_video:
        PolicyModule._idle_tower = lambda self, device, encode: (
            torch.zeros((), device=device)
            if encode == self.hf.model.get_video_features
            else idle_tower(self, device, encode)
        )
    world = init_distributed("cpu", timeout_s=60)
    out = {model_dir: run_model(model_dir, args.scenarios.split(","), world) for model_dir in args.model_dirs}
    with open(f"{args.out_prefix}.rank{world.rank}.json", "w") as f:
        json.dump(out, f)


def run_model(model_dir: str, scenarios: list[str], world) -> dict:
    """Every case of `scenarios` for one model: case name -> `run_case`'s result."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    pad_id = processor.tokenizer.pad_token_id
    spec = UpdateSpec(
        temperature=1.0, pad_token_id=pad_id, max_response_length=8, mini_batch_size=NUM_SAMPLES,
        micro_batch_size=1, experience_micro_batch_size=1,
    )  # fmt: skip
    out = {}
    for scenario in scenarios:
        videos = SCENARIOS[scenario]
        samples = make_samples(processor, compositions(scenario, world.rank), world.rank)
        reference = reference_logprobs(model_dir, samples, pad_id)
        spec = dataclasses.replace(spec, videos=videos)
        for frozen in (False, True):
            actor = ActorConfig(
                model=ModelConfig(model_path=model_dir, freeze_vision_tower=frozen),
                fsdp=FSDPConfig(param_dtype="float32"),
            )
            policy = build_policy(actor, world)
            # Accelerators' layout, one gather per forward: where a rank that skips the tower mismatches
            # the others' collectives (on the CPU the default gathers once per pass).
            policy.gather_once_per_pass = False
            for packed in (False, True):
                policy.padding_free = packed
                case = f"{scenario}-{'frozen' if frozen else 'trained'}-{'packed' if packed else 'padded'}"
                out[case] = run_case(policy, samples, spec, world, reference)
    return out


if __name__ == "__main__":
    run_job(main)
