"""Mrope positions over video tokens (`models.video_rope`): vLLM's rule, checked against hand-computed values;
transformers 5.19's `get_rope_index` gives other positions after a video (the reason the module exists)."""

from __future__ import annotations

import torch
import transformers

from spmd_grpo.models.video_rope import video_rope_index
from tests.conftest import tiny_model


def test_text_after_a_video_continues_after_its_last_temporal_position():
    config = transformers.AutoConfig.from_pretrained(tiny_model())  # Qwen2.5-VL: 4 tokens per second
    assert config.vision_config.tokens_per_second == 4
    t, v = 5, config.video_token_id  # a text token and the video pad
    ids = torch.tensor([[t, t, *[v] * 8, t, t]])  # a video of grid (2, 4, 4): 2 x 2 x 2 merged tokens
    grid, seconds = torch.tensor([[2, 4, 4]]), torch.tensor([1.0])  # 2 frames at 2 fps per temporal patch
    mask = torch.ones_like(ids)
    positions = video_rope_index(config, ids, mask, None, grid, seconds, frames_split=False)[:, 0]
    assert positions.tolist() == [
        [0, 1, 2, 2, 2, 2, 6, 6, 6, 6, 7, 8],  # time: 0 and 1 x 4 tokens/s x 1 s, then max + 1
        [0, 1, 2, 2, 3, 3, 2, 2, 3, 3, 7, 8],
        [0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 7, 8],
    ]
    hf = transformers.Qwen2_5_VLModel(config)
    hf_positions, _ = hf.get_rope_index(
        ids, mm_token_type_ids=2 * (ids == v).int(), video_grid_thw=grid, second_per_grid_ts=seconds,
        attention_mask=mask,
    )  # fmt: skip
    assert hf_positions[0, 0, -2:].tolist() == [4, 5]  # transformers 5.19: start + max(h, w) / merge


def test_the_time_scale_is_applied_in_float64_as_vllm_does():
    """vLLM truncates index x tokens_per_second x second_per_grid_ts taken in float64; in float32 the product
    can round up to the next integer. 2 frames per temporal patch sampled at 5.106383 fps: the processor's
    float32 second_per_grid_ts is 0.39166665, and temporal patch 30 is at 30 x 4 x 0.39166665 = 46.99999809."""
    config = transformers.AutoConfig.from_pretrained(tiny_model())  # 4 tokens per second, merge 2
    seconds = torch.tensor([2 / 5.106383], dtype=torch.float32)
    ids = torch.tensor([[5, *[config.video_token_id] * 31]])  # a video of grid (31, 2, 2): one token a patch
    grid = torch.tensor([[31, 2, 2]])
    positions = video_rope_index(config, ids, torch.ones_like(ids), None, grid, seconds, frames_split=False)
    scale = float(seconds) * config.vision_config.tokens_per_second
    assert positions[0, 0, 1:].tolist() == [1 + int(i * scale) for i in range(31)]  # vLLM's float64 rule
    assert positions[0, 0, -1] == 1 + 46


def test_qwen3_vl_splits_a_video_into_one_patch_runs_between_timestamps():
    config = transformers.AutoConfig.from_pretrained(tiny_model(family="qwen3_vl"))
    t, v = 5, config.video_token_id
    ids = torch.tensor([[t, *[v] * 4, t, t, *[v] * 4, t, 0, 0]])  # two temporal patches, right padding
    mask = (torch.arange(ids.shape[1]) < 12).long()[None]
    grid = torch.tensor([[2, 4, 4]])
    positions = video_rope_index(config, ids, mask, None, grid, None, frames_split=True)[:, 0]
    assert positions[0].tolist() == [0, 1, 1, 1, 1, 3, 4, 5, 5, 5, 5, 7, 0, 0]
    assert positions[1].tolist() == [0, 1, 1, 2, 2, 3, 4, 5, 5, 6, 6, 7, 0, 0]
