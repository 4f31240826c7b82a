"""The records that flow through a step: a `Prompt` (what a rank rolls out) and a `Sample` (one response to
it, with everything later phases add: rewards, advantages, old/reference logprobs, image inputs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image


@dataclass
class Prompt:
    """One prompt as the engine and the trainer see it."""

    uid: int  # global index of the prompt in this step's batch: groups are keyed by it
    prompt_token_ids: list[int]  # chat-templated, ONE <|image_pad|> per image (vLLM expands it)
    images: list[Image.Image] = field(default_factory=list)
    ground_truth: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # data_source, problem text, ...
    videos: list = field(
        default_factory=list
    )  # data.videos.Video: sampled frames + metadata, ONE <|video_pad|> each


@dataclass
class Sample:
    """One sampled response, and every per-sample result of the step that concerns it."""

    prompt: Prompt
    sample_index: int  # 0..n-1 within the prompt's group
    prompt_ids: list[int]  # expanded by vLLM: one pad token per merged image patch
    response_ids: list[int]
    rollout_logprobs: list[float]  # vLLM's processed logprobs of the sampled tokens
    response_text: str = ""
    finish_reason: str = "length"  # "stop" | "length"
    pixel_values: torch.Tensor | None = None  # trainer-side, same processor settings as vLLM
    image_grid_thw: torch.Tensor | None = None
    video_inputs: dict[str, torch.Tensor] | None = None
    """Trainer-side video inputs of the prompt: `pixel_values_videos`, `video_grid_thw` and, for Qwen2.5-VL,
    `second_per_grid_ts` (the processor's outputs, same settings as vLLM's)."""
    image_features: tuple[torch.Tensor, ...] | None = None
    """Vision-tower output per image, shared by the prompt's samples for one step (actor.image_features.encode_images)."""
    gen_batch: int = 0  # which generation batch of the step produced it (DAPO may need several)
    group_index: int = -1  # GRPO group key for the advantage (the prompt uid unless regrouped)
    scores: dict[str, float] = field(default_factory=dict)  # reward outputs (overall, accuracy, ...)
    advantage: float = 0.0
    old_logprobs: torch.Tensor | None = None  # [len(response_ids)] float32, trainer's, before the update
    ref_logprobs: torch.Tensor | None = None  # [len(response_ids)] float32, reference model's
    routes: torch.Tensor | None = None
    """MoE models: [tokens, decoder layers, top-k] int16, the experts each token used, for the trainer passes
    to compare with or replay (worker.actor.moe.routing_replay): vLLM's (`rollout`; it may omit the last
    token), else the old-logprob pass's. -1 where a layer is dense."""

    def reward_input(self) -> dict[str, Any]:
        """What a reward function receives for this sample (see algorithm/reward.py's batch interface)."""
        return {
            "response": self.response_text,
            "response_length": len(self.response_ids),
            "ground_truth": self.prompt.ground_truth,
            "uid": self.prompt.uid,
            "sample_index": self.sample_index,
            **self.prompt.extra,
        }
