"""Image features encoded once per prompt and reused for all its samples (`UpdateSpec.image_features`).

The vision tower runs on each distinct image once per pass; the features are attached to every sample of the
prompt and handed to the language model as precomputed encoder outputs. Under FSDP2 every rank must call the
vision blocks the same number of times, so a rank with fewer images (or none) encodes a tiny dummy image.
"""

from __future__ import annotations

import torch
from torch import nn

from spmd_grpo.actor.spec import UpdateSpec
from spmd_grpo.data.samples import Sample
from spmd_grpo.models.inputs import ImageBatch, dummy_image
from spmd_grpo.parallel.collectives import all_reduce_max


@torch.no_grad()
def encode_images(model: nn.Module, samples: list[Sample], spec: UpdateSpec) -> None:
    """Run the vision tower once per prompt for the whole step and attach the features to its samples.

    Only where `spec.image_features` is per_step (decided by `UpdateSpec.from_config`: a frozen vision
    tower, no videos, a family whose language model takes only the tower's final output, not Qwen3-VL, see
    `Family.reusable_image_features`): the n samples of a prompt and every
    trainer pass of the step (old logprobs, reference, update) then feed the language model these features
    instead of re-encoding the pixels, which gives the same logprobs. The reference model's tower holds the
    same (frozen, initial) weights, so it takes the policy's features, cast to its own dtype. With a trained
    tower nothing is attached here: each forward-only pass encodes once per prompt with its own model
    (`image_features` per_pass: the reference's tower is its initial one, the policy's is fixed
    during the pass) and the update re-encodes in every forward, as the gradient needs.

    Collective: every rank runs the tower the same number of times (the MAX over ranks of its chunks of
    `experience_micro_batch_size` prompts; a rank with fewer encodes a dummy image), as FSDP requires.

    Memory: the features stay on the device for the step, [image tokens, H] per prompt in the compute dtype.
    Qwen2.5-VL-7B (H = 3584), ~1000 tokens per geometry3k image: 3584 x 1000 x 2 B = 7.2 MB per image in
    bf16, 115 MB for 16 prompts per rank; the pixels they replace are re-encoded three times or more per step
    without reuse (old, reference, each update epoch).
    """
    if spec.image_features == "per_step":
        attach_image_features(model, samples, spec)


@torch.no_grad()
def attach_image_features(model: nn.Module, samples: list[Sample], spec: UpdateSpec) -> None:
    """`model`'s vision features of each prompt's images, encoded once (collective, see `encode_images`)
    and attached to every sample of the prompt."""
    prompts: dict[int, list[Sample]] = {}  # keyed by the pixel tensor its samples share
    for s in samples:
        if s.pixel_values is not None:
            prompts.setdefault(id(s.pixel_values), []).append(s)
    groups = list(prompts.values())
    size = spec.experience_micro_batch_size
    chunks = [groups[i : i + size] for i in range(0, len(groups), size)]
    num_calls = int(all_reduce_max(torch.tensor([float(len(chunks))])).item())
    device = model.compute_device
    for k in range(num_calls):
        if k >= len(chunks):
            model(dummy_image(model.config).to(device))
            continue
        firsts = [g[0] for g in chunks[k]]
        images = ImageBatch(
            torch.cat([s.pixel_values for s in firsts]), torch.cat([s.image_grid_thw for s in firsts])
        )
        features = model(images.to(device))
        for group, s in zip(chunks[k], firsts, strict=True):
            mine, features = features[: len(s.image_grid_thw)], features[len(s.image_grid_thw) :]
            for sample in group:
                sample.image_features = tuple(mine)
