"""Video rows: qwen-vl-utils' sampling and pixel rules (defaults read from the package), decoding on demand,
bad videos skipped and named at load, the processor's own resize of our frames the identity (every family),
and a mixed row set (text-only, multi-image, video, image + video) loaded from parquet.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from qwen_vl_utils import vision_process as q

from spmd_grpo.config.schema import DataConfig
from spmd_grpo.data.dataset import load_dataset
from spmd_grpo.data.images import BadRow
from spmd_grpo.data.prompts import processor_sizes, with_video_metadata
from spmd_grpo.data.synthetic import write_parquet
from spmd_grpo.data.videos import VideoRules, decode_video, encode_video
from tests.conftest import tiny_model

SMALL = {"video_min_pixels": 3136, "video_max_pixels": 12544}
RED, GREEN, BLUE = (250, 0, 0), (0, 250, 0), (0, 0, 250)


def _video(colors, size=(56, 84), fps=2) -> bytes:
    return encode_video([Image.new("RGB", size, c) for c in colors], fps=fps)


def test_defaults_are_the_installed_qwen_vl_utils_rules():
    rules = VideoRules.of(DataConfig(), 32)
    assert (rules.fps, rules.min_frames, rules.max_frames) == (q.FPS, q.FPS_MIN_FRAMES, q.FPS_MAX_FRAMES)
    assert rules.min_pixels == q.VIDEO_MIN_TOKEN_NUM * 32 * 32
    assert rules.max_pixels == q.VIDEO_MAX_TOKEN_NUM * 32 * 32
    assert rules.total_pixels == int(q.MODEL_SEQ_LEN * 32 * 32 * 0.9)
    assert rules.frame_factor == q.FRAME_FACTOR
    cfg = DataConfig(video_fps=1.0, video_max_frames=8, video_total_pixels=10**6)
    assert (VideoRules.of(cfg, 28).fps, VideoRules.of(cfg, 28).max_frames) == (1.0, 8)


def test_frames_sampled_at_fps_within_the_frame_bounds_and_resized_to_factor_multiples():
    # 12 frames at 6 fps = 2 s; 2 fps -> 4 frames at qwen-vl-utils' linspace indices.
    colors = [(20 * i, 0, 0) for i in range(12)]
    rules = VideoRules.of(DataConfig(**SMALL), 28)
    video = decode_video({"bytes": _video(colors, size=(50, 70), fps=6), "path": None}, None, rules)
    nframes = q.smart_nframes({"fps": 2.0, "min_frames": 4, "max_frames": 768}, 12, 6.0)
    assert video.frames.shape[0] == nframes == 4
    assert video.metadata["frames_indices"] == np.linspace(0, 11, 4).round().astype(int).tolist()
    assert video.metadata | {"frames_indices": None} == {
        "fps": 6.0, "frames_indices": None, "total_num_frames": 12, "duration": 2.0, "video_backend": "pyav"
    }  # fmt: skip
    t, h, w, _ = video.frames.shape
    assert (h % 28, w % 28) == (0, 0) and 3136 <= h * w <= 12544
    # the right frames: frame 11's red level (220) is the last one's
    assert abs(int(video.frames[-1, h // 2, w // 2, 0]) - 220) < 12
    assert video.for_vllm()[1]["do_sample_frames"] is False


@pytest.mark.parametrize(
    "entry, reason",
    [
        (b"not a video", "undecodable video"),
        ({"bytes": None, "path": "/nonexistent/clip.mp4"}, "undecodable video"),
        (_video([RED]), "video cannot be sampled"),  # one frame: less than one temporal patch
    ],
)
def test_bad_videos_raise_bad_row(entry, reason):
    with pytest.raises(BadRow, match=reason):
        decode_video(entry, None, VideoRules.of(DataConfig(**SMALL), 28))


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_the_processors_own_video_resize_is_the_identity(family):
    processor = transformers.AutoProcessor.from_pretrained(tiny_model(family=family))
    factor = processor.image_processor.patch_size * processor.image_processor.merge_size
    sizes = processor_sizes(DataConfig(**SMALL), processor, limit_videos=1)
    assert sizes.factor == factor
    video = decode_video(_video([RED, GREEN, BLUE, RED], size=(90, 130)), None, sizes.video)
    t, h, w, _ = video.frames.shape
    patch = factor // 2

    def grid(kwargs):
        call = with_video_metadata(kwargs, [video]) if "videos_kwargs" in kwargs else kwargs
        text = processor.video_token
        enc = processor(text=[text], videos=[video.frames], return_tensors="pt", **call)
        return enc["video_grid_thw"][0].tolist()

    assert grid(sizes.processor_kwargs()) == [t // 2, h // patch, w // patch]
    # Negative control: with the processor's own video bounds the frames are resized again.
    assert grid({}) != [t // 2, h // patch, w // patch]


def test_a_mixed_row_set_loads_with_bad_videos_named(processor, tmp_path, caplog):
    image = Image.new("RGB", (56, 56), GREEN)
    good = _video([RED, GREEN, BLUE, RED])
    rows = [
        {"problem": "What is 2 + 2?", "answer": "4"},  # text-only
        {"problem": "<image><image>Same color?", "answer": "yes", "images": [image, image]},
        {"problem": "<video>Last color?", "answer": "0", "videos": [good]},
        {"problem": "<image>Is this<video>the same?", "answer": "no", "images": [image], "videos": [good]},
        {"problem": "<video>Broken?", "answer": "1", "videos": [b"garbage"]},
        {"problem": "<video>One frame?", "answer": "1", "videos": [_video([RED])]},
        {"problem": "No marker.", "answer": "1", "videos": [good]},
        {"problem": "<video><video>Two?", "answer": "1", "videos": [good, good]},
        {"problem": "<video>Too long?", "answer": "1", "videos": [_video([RED] * 40, size=(112, 112))]},
    ]
    path = write_parquet(rows, tmp_path / "mixed.parquet")
    cfg = replace(DataConfig(), train_files=str(path), max_bad_fraction=0.9, max_prompt_length=200, **SMALL)
    with caplog.at_level(logging.WARNING):
        examples = load_dataset(cfg, processor, limit_videos=1, limit_images=2)
    assert [e.index for e in examples] == [0, 1, 2, 3]
    log = caplog.text
    assert f"skipped {path} row 4: undecodable video" in log
    assert f"skipped {path} row 5: video cannot be sampled" in log
    assert f"skipped {path} row 6: <video> markers do not match videos (0 markers, 1 videos)" in log
    assert f"skipped {path} row 7: more videos than worker.rollout.limit_videos (2 > 1)" in log
    too_long = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("filtered"))
    assert too_long.startswith("filtered 1 of 5 prompts, "), too_long
    assert "(row 8: " in too_long and "video (" in too_long and ": 40 frames of 112x112)" in too_long, (
        too_long
    )
    assert (
        "data.video_max_frames, data.video_fps, data.video_max_pixels or data.video_total_pixels" in too_long
    )
    # Every prompt too long: the error names the video, the lengths and the keys that shorten them.
    named = write_parquet(
        [
            {
                "problem": "<video>Color?",
                "answer": "1",
                "videos": [{"bytes": None, "path": str(tmp_path / "clip.mp4")}],
            }
        ],
        tmp_path / "long.parquet",
    )
    (tmp_path / "clip.mp4").write_bytes(_video([RED] * 40, size=(112, 112)))
    with pytest.raises(ValueError) as e:
        load_dataset(replace(cfg, train_files=str(named)), processor, limit_videos=1)
    message = str(e.value)
    assert message.startswith(
        f"no usable examples in {named} (data.max_prompt_length=200): too long: 1 of 1"
    ), message
    assert (
        "(row 0: " in message and f"tokens (video {tmp_path / 'clip.mp4'}: 40 frames of 112x112)" in message
    )
    assert (
        "raise data.max_prompt_length, or shorten the videos' prompts" in message and "video_fps" in message
    )
    video_row, both = examples[2], examples[3]
    first, second = video_row.videos, video_row.videos
    assert first[0].frames is not second[0].frames  # decoded on demand, nothing kept
    assert np.array_equal(first[0].frames, second[0].frames) and len(both.images) == len(both.videos) == 1
    assert examples[0].videos == [] and examples[1].videos == []
    ids = processor.tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"])
    assert [both.prompt_token_ids.count(i) for i in ids] == [1, 1]
    # num_prompt_tokens counts the processor's expansion: 2 temporal patches x (84/28 x 56/28) tokens
    assert video_row.num_prompt_tokens == len(video_row.prompt_token_ids) - 1 + 2 * 3 * 2


def test_the_loader_the_trainer_and_vllm_get_one_set_of_sizes(processor, tmp_path):
    """`processor_sizes` is made once and handed down: the loader resizes and samples with it, the trainer's
    processor call (`attach_video_inputs`) then leaves the loader's image and frames as they are, and its
    expansion is the prompt length the loader counted; vLLM gets `processor_kwargs()` (read back from real
    engines in tests/engine/test_engine_parity.py)."""
    from spmd_grpo.data.samples import Prompt, Sample
    from spmd_grpo.rollout.generate import attach_video_inputs

    row = {
        "problem": "<image>Is this<video>the same?",
        "answer": "no",
        "images": [Image.new("RGB", (150, 90))],
    }
    path = write_parquet(
        [row | {"videos": [_video([RED, GREEN, BLUE, RED], size=(90, 130))]}], tmp_path / "p.parquet"
    )
    # images above the tiny processor's own bound (262144 pixels): its default call would shrink them
    cfg = DataConfig(
        train_files=str(path), min_pixels=270000, max_pixels=320000, max_prompt_length=1024, **SMALL
    )
    sizes = processor_sizes(cfg, processor, limit_videos=1)
    (example,) = load_dataset(cfg, processor, limit_videos=1, sizes=sizes)
    assert example.source.sizes is sizes
    images, videos = example.images, example.videos
    sample = Sample(Prompt(0, example.prompt_token_ids, images=images, videos=videos), 0, [], [], [])
    attach_video_inputs([sample], processor, sizes, torch.float32)
    patch = sizes.factor // 2
    ((_, h, w),) = sample.image_grid_thw.tolist()
    assert (w * patch, h * patch) == images[0].size and 270000 <= images[0].width * images[0].height <= 320000
    t, fh, fw, _ = videos[0].frames.shape
    assert sample.video_inputs["video_grid_thw"].tolist() == [[t // 2, fh // patch, fw // patch]]
    merged = (h * w + t // 2 * (fh // patch) * (fw // patch)) // 4  # tokens after the 2 x 2 merge
    assert example.num_prompt_tokens == len(example.prompt_token_ids) - 2 + merged
    # The control: a call with other image bounds (the processor's own) resizes the loader's image again.
    other = Sample(sample.prompt, 0, [], [], [])
    attach_video_inputs([other], processor, replace(sizes, min_pixels=3136, max_pixels=262144), torch.float32)
    assert other.image_grid_thw.tolist() != sample.image_grid_thw.tolist()


def test_second_per_grid_ts_is_the_value_the_engine_reads(processor, tmp_path):
    """vLLM casts every floating output of its processor to the engine's dtype (as `BatchFeature.to(dtype)`)
    and reads Qwen2.5-VL's video mrope time positions from that `second_per_grid_ts`: a bf16 engine places a
    61-frame 30 fps clip sampled to 4 frames (2 x 61 / 120 = 1.016667 s per temporal patch) at 1.015625 s,
    which moves the time positions by one from the 32nd temporal patch on (x 4 tokens per second, in
    float64 as vLLM, truncated). The trainer's positions must come from the engine's value: `attach_video_inputs` rounds it
    to the rollout dtype and the batch carries it in float32."""
    from spmd_grpo.data.samples import Prompt, Sample
    from spmd_grpo.rollout.generate import attach_video_inputs

    row = {
        "problem": "<video>Which colour?",
        "answer": "0",
        "images": [],
        "videos": [_video([RED] * 61, fps=30)],
    }
    path = write_parquet([row], tmp_path / "v.parquet")
    cfg = DataConfig(train_files=str(path), max_prompt_length=1024, **SMALL)
    sizes = processor_sizes(cfg, processor, limit_videos=1)
    (example,) = load_dataset(cfg, processor, limit_videos=1, sizes=sizes)
    assert example.videos[0].frames.shape[0] == 4
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        sample = Sample(Prompt(0, example.prompt_token_ids, videos=example.videos), 0, [], [], [])
        attach_video_inputs([sample], processor, sizes, dtype)
        seconds[dtype] = sample.video_inputs["second_per_grid_ts"]
        assert seconds[dtype].dtype == torch.float32
    assert seconds[torch.float32].item() == pytest.approx(2 * 61 / 120, rel=1e-6)
    assert seconds[torch.bfloat16].item() == 1.015625  # what a bf16 engine's processor hands its model
