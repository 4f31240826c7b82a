"""Mrope positions of sequences holding videos, as vLLM (and the original Qwen2-VL / Qwen2.5-VL code) computes
them: transformers 5.19's `get_rope_index` differs for videos.

Shapes: B sequences, L = padded length; positions [3, B, L] (temporal, height, width).

Each run of text tokens continues from the largest position so far + 1, each image or video placeholder run
gets the 3-D grid of its merged patches (t, h / merge, w / merge) offset by that start, the temporal index
scaled by `tokens_per_second x second_per_grid_ts` for Qwen2.5-VL videos (truncated to an integer; the
product is taken in float64, as vLLM takes it: in float32, index 30 x 4 tokens/s x 0.39166665 s (2 frames at
5.106383 fps) rounds up to 47.0 and truncates to 47 where vLLM's 46.99999809 truncates to 46). The
difference from transformers 5.19: after a vision run, transformers continues at start + max(h, w) / merge,
ignoring the time axis, where vLLM (and the reference code the models were trained with) continues at the
largest position of the run + 1, which for a video is its last temporal index when that exceeds the spatial
extent. Both agree for images (t = 1) and for Qwen3-VL (each frame is its own t = 1 run between timestamp
text). Measured on a tiny Qwen2.5-VL, fp32: with transformers' positions the trainer's logprobs of video
prompts differed from vLLM's by up to 2.3e-3 nats; with these, by fp32 rounding.
"""

from __future__ import annotations

import itertools

import torch


def video_rope_index(
    config,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor,
    second_per_grid_ts: torch.Tensor | None,
    *,
    frames_split: bool,
) -> torch.Tensor:
    """[3, B, L] positions of right-padded sequences (0 on padding). `frames_split`: each temporal patch of
    a video is its own placeholder run (Qwen3-VL), so its grid is split into t rows of one patch."""
    merge = config.vision_config.spatial_merge_size
    videos = video_grid_thw
    if frames_split:
        videos = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0)
        videos[:, 0] = 1
    if second_per_grid_ts is None or frames_split:
        scales = [1.0] * len(videos)
    else:
        per_second = getattr(config.vision_config, "tokens_per_second", 1.0)
        scales = [float(s) * per_second for s in second_per_grid_ts]
    grids = {config.image_token_id: iter(image_grid_thw if image_grid_thw is not None else ())}
    grids[config.video_token_id] = iter(zip(videos, scales, strict=True))
    positions = torch.zeros(3, *input_ids.shape, dtype=torch.long)
    for b in range(input_ids.shape[0]):
        ids = input_ids[b][attention_mask[b].bool()].tolist()
        parts, start = [], 0
        for token, run in itertools.groupby(ids):
            count = len(list(run))
            if token not in grids:
                parts.append(torch.arange(count).expand(3, -1) + start)
                start += count
                continue
            # One run of pad tokens is one image or video (the chat template puts vision start / end tokens
            # around each): its grid's merged patches, in (t, h, w) order.
            grid, scale = next(grids[token]) if token == config.video_token_id else (next(grids[token]), 1.0)
            t, h, w = (int(x) for x in grid)
            assert count == t * (h // merge) * (w // merge), f"{count} pad tokens for grid {(t, h, w)}"
            axes = (torch.arange(t), torch.arange(h // merge), torch.arange(w // merge))
            index = torch.stack(torch.meshgrid(*axes, indexing="ij")).reshape(3, -1)
            index[0] = (index[0].double() * scale).long()  # vLLM's float64 product (float32 misplaced some)
            parts.append(index + start)
            start = int(parts[-1].max()) + 1
        positions[:, b, attention_mask[b].bool()] = torch.cat(parts, dim=1)
    return positions.to(input_ids.device)
