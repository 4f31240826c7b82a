"""What the torchrun test jobs share: the teardown every job needs, and the chat prompts they build."""

from __future__ import annotations

from collections.abc import Callable

from PIL import Image


def run_job(main: Callable[[], None]) -> None:
    """Run a job's `main` under torchrun and tear the process group down. A job without vLLM then leaves
    without the interpreter's teardown: gloo's threads race it ("terminate called without an active
    exception", exit -6), seen as a flaky test, last in a fresh-clone CI run of the checkpoint job after every
    rank had finished its work and destroyed the group. A job with a vLLM engine needs that teardown: vLLM's
    CPU engine unlinks its shared-memory segments there (skipping it left `/dev/shm/-tp:0-[0-1]-cpushm_*`
    behind, and the next tensor-parallel engine failed with EEXIST). An exception from `main` still
    propagates (non-zero exit)."""
    import os
    import sys

    from spmd_grpo.parallel.collectives import barrier, destroy

    main()
    barrier()
    destroy()
    if "vllm" not in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def chat_text(processor, num_images: int, text: str, num_videos: int = 0) -> str:
    """The chat-templated user turn: `num_images` images, `num_videos` videos, then `text`, ready for the
    assistant's answer."""
    content = [{"type": "image"} for _ in range(num_images)] + [{"type": "video"} for _ in range(num_videos)]
    content.append({"type": "text", "text": text})
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


def encode(processor, images: list[Image.Image], text: str) -> dict:
    """HF processor output (input_ids with the images expanded, pixel_values, image_grid_thw) of one prompt."""
    return processor(text=[chat_text(processor, len(images), text)], images=images, return_tensors="pt")


VIDEO_DATA = {"video_min_pixels": 3136, "video_max_pixels": 12544, "video_max_frames": 4}
"""`data.video_*` of the test jobs' videos: 4 frames of 56 x 84 pixels stay a few tokens per temporal patch
(and vLLM profiles its start-up with a 4-frame video, not the largest 768-frame one)."""


def make_video(colors: list[tuple[int, int, int]], rules):
    """A 2-fps video of one solid colour per frame, through the data layer's encode and decode (`rules`:
    `data.videos.VideoRules`)."""
    from spmd_grpo.data.videos import decode_video, encode_video

    return decode_video(encode_video([Image.new("RGB", (56, 84), c) for c in colors]), None, rules)


def video_setup(processor):
    """The `data.prompts.ProcessorSizes` of a run with videos allowed (`VIDEO_DATA`), for `processor`."""
    from spmd_grpo.config.schema import DataConfig
    from spmd_grpo.data.prompts import processor_sizes

    return processor_sizes(DataConfig(**VIDEO_DATA), processor, 1)


def encode_with_videos(processor, images: list[Image.Image], videos: list, text: str, sizes) -> dict:
    """HF processor output of one prompt with `videos` (`data.videos.Video`; at least one) and `images`,
    the run's `sizes` (`video_setup`) and the videos' metadata: the expanded input_ids vLLM returns too."""
    from spmd_grpo.data.prompts import with_video_metadata

    chat = chat_text(processor, len(images), text, num_videos=len(videos))
    call = with_video_metadata(sizes.processor_kwargs(), videos)
    frames = [v.frames for v in videos]
    return processor(text=[chat], images=images or None, videos=frames, return_tensors="pt", **call)
