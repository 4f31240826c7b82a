"""Videos of a row: decode (a file path or encoded bytes) with PyAV, sample frames and resize them by
qwen-vl-utils' rules, so that vLLM and the trainer's processor get the same frames and neither resamples
nor resizes them again. A video that cannot be decoded, has no frames (or fewer than two) or no frame rate
raises `BadRow`: the row is skipped and named at load.

The rules are qwen_vl_utils.vision_process's `fetch_video` for a video file, with the defaults read from the
installed package (`VideoRules.of`):
  * nframes = `smart_nframes(fps, min_frames, max_frames)` of the source's frame count and rate: the video's
    duration x `fps`, clamped to [min_frames, max_frames] and to the frame count, floored to a multiple of
    FRAME_FACTOR (2, the temporal patch); frames at `linspace(0, total - 1, nframes)` rounded;
  * every frame resized by `smart_resize` to multiples of the factor within [min_pixels, max], where
    max = max(min(max_pixels, total_pixels / nframes x FRAME_FACTOR), 1.05 x min_pixels);
  * metadata as qwen-vl-utils returns it (source fps, sampled frame indices, source frame count), plus the
    duration vLLM's `VideoMetadata` takes. Qwen3-VL writes a timestamp before each temporal patch from it;
    Qwen2.5-VL's mrope time axis uses `second_per_grid_ts` computed from it (by the processor, both sides).

Deviations from qwen-vl-utils: frames are decoded with PyAV (qwen-vl-utils picks torchcodec, decord or
torchvision's reader; torchcodec is excluded from this environment, decord is not installed, and
torchvision 0.28's `read_video` is deprecated); the resize is PIL's bicubic on uint8 frames where
qwen-vl-utils resizes float tensors with torchvision's antialiased bicubic (pixel values may differ by a
few levels; both sides of this trainer get the same frames). Frames lists (a video given as images) and
`video_start`/`video_end` are not supported.
"""

from __future__ import annotations

import io
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from spmd_grpo.config.schema import DataConfig
from spmd_grpo.data.images import BadRow

VIDEO_MARKER = "<video>"


@dataclass(frozen=True)
class VideoRules:
    """qwen-vl-utils' frame sampling and per-frame / total pixel budgets, resolved for one model."""

    fps: float
    min_frames: int
    max_frames: int
    min_pixels: int
    max_pixels: int
    total_pixels: int
    factor: int  # pixels per token side (patch x merge)
    frame_factor: int  # frames per temporal patch

    @classmethod
    def of(cls, cfg: DataConfig, factor: int) -> VideoRules:
        """`data.video_*`, each None replaced by the installed qwen-vl-utils' default for this factor."""
        from qwen_vl_utils import vision_process as q

        def pick(value, default):
            return default if value is None else value

        return cls(
            fps=float(pick(cfg.video_fps, q.FPS)),
            min_frames=int(pick(cfg.video_min_frames, q.FPS_MIN_FRAMES)),
            max_frames=int(pick(cfg.video_max_frames, q.FPS_MAX_FRAMES)),
            min_pixels=int(pick(cfg.video_min_pixels, q.VIDEO_MIN_TOKEN_NUM * factor * factor)),
            max_pixels=int(pick(cfg.video_max_pixels, q.VIDEO_MAX_TOKEN_NUM * factor * factor)),
            total_pixels=int(pick(cfg.video_total_pixels, q.MODEL_SEQ_LEN * factor * factor * 0.9)),
            factor=factor,
            frame_factor=q.FRAME_FACTOR,
        )

    def processor_size(self) -> dict[str, int]:
        """The video processor's `size` under which its own resize of our frames is the identity: frames are
        already multiples of the factor, so bounds wide enough for any sampled video (Qwen3-VL's processor
        bounds all frames together, Qwen2-VL's each frame) leave them as they are."""
        per_frame = max(self.max_pixels, math.ceil(self.min_pixels * 1.05))
        return {
            "shortest_edge": self.factor * self.factor,
            "longest_edge": (self.max_frames + self.frame_factor) * per_frame,
        }


@dataclass
class Video:
    """One video's sampled, resized frames and the metadata vLLM and the processor need."""

    frames: np.ndarray  # [T, H, W, 3] uint8, T a multiple of the temporal patch
    metadata: dict[str, Any]  # fps (of the source), frames_indices, total_num_frames, duration, video_backend

    def for_vllm(self) -> tuple[np.ndarray, dict[str, Any]]:
        """vLLM's video item: frames with metadata; `do_sample_frames=False`, the frames are final."""
        return self.frames, {**self.metadata, "do_sample_frames": False}


def video_list(videos: Any) -> list:
    """A row's video cell as a list of video entries (None: no videos; a single entry: one video)."""
    if videos is None:
        return []
    if isinstance(videos, bytes | bytearray | dict | str):
        return [videos]
    try:
        return list(videos)
    except TypeError:  # a number column named as the video column: the row is bad, not the load
        raise BadRow("videos is not a list of videos", type(videos).__name__) from None


def video_name(entry: Any) -> str:
    """How a message names a video entry: its path, else its size in bytes."""
    path = entry.get("path") if isinstance(entry, dict) else entry if isinstance(entry, str) else None
    data = entry.get("bytes") if isinstance(entry, dict) else entry
    if path:
        return str(path)
    return f"({len(data)} bytes)" if isinstance(data, bytes | bytearray) else f"({type(entry).__name__})"


def _source(entry: Any, base_dir: Path | None):
    data, path = entry, None
    if isinstance(entry, dict):
        data, path = entry.get("bytes"), entry.get("path")
    if isinstance(data, bytes | bytearray):
        return io.BytesIO(data)
    if isinstance(data or path, str):
        file = Path(data or path)
        if not file.is_absolute() and base_dir is not None and not file.exists():
            file = base_dir / file
        return str(file)
    raise BadRow("undecodable video", f"no bytes or path in a {type(entry).__name__}")


def _count_and_rate(source) -> tuple[int, float]:
    """(decoded frame count, frames per second) of the first video stream: every frame is decoded once, as
    the container's own frame count is missing or wrong in many files."""
    import av

    with av.open(source) as container:
        if not container.streams.video:
            raise BadRow("undecodable video", "no video stream")
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        count = sum(1 for _ in container.decode(stream))
    return count, float(rate or 0.0)


@contextmanager
def _as_bad_row(kind: str, *errors: type[BaseException]):
    """`errors` raised inside become `BadRow(kind, message)`."""
    try:
        yield
    except BadRow:
        raise
    except errors as e:
        raise BadRow(kind, f"{type(e).__name__}: {e}") from e


def decode_video(entry: Any, base_dir: Path | None, rules: VideoRules) -> Video:
    """The video's frames sampled and resized by `rules` (see the module docstring)."""
    from qwen_vl_utils.vision_process import smart_nframes, smart_resize

    # PyAV: not a video, truncated, unknown codec, a missing file (its errors include ValueErrors)
    with _as_bad_row("undecodable video", Exception):
        source = _source(entry, base_dir)
        total, fps = _count_and_rate(source)
    if total == 0:
        raise BadRow("video has no frames")
    if fps <= 0:
        raise BadRow("video has no frame rate")
    limits = {"fps": rules.fps, "min_frames": rules.min_frames, "max_frames": rules.max_frames}
    with _as_bad_row("video cannot be sampled", ValueError):  # fewer frames than one temporal patch
        nframes = smart_nframes(limits, total_frames=total, video_fps=fps)
    wanted = np.linspace(0, total - 1, nframes).round().astype(int).tolist()
    with _as_bad_row("undecodable video", Exception):
        decoded = _decode_frames(source, set(wanted))
        frames = [decoded[i] for i in wanted]  # KeyError: fewer frames on the second pass
    max_pixels = max(
        min(rules.max_pixels, rules.total_pixels / nframes * rules.frame_factor), int(rules.min_pixels * 1.05)
    )
    with _as_bad_row("video cannot be resized", ValueError):  # extreme aspect ratio
        height, width = smart_resize(
            frames[0].height, frames[0].width, rules.factor, rules.min_pixels, max_pixels
        )
    resized = [
        f if f.size == (width, height) else f.resize((width, height), Image.Resampling.BICUBIC)
        for f in frames
    ]
    metadata = {
        "fps": fps,
        "frames_indices": wanted,
        "total_num_frames": total,
        "duration": total / fps,
        "video_backend": "pyav",
    }
    return Video(np.stack([np.asarray(f) for f in resized]), metadata)


def _decode_frames(source, wanted: set[int]) -> dict[int, Image.Image]:
    """The frames numbered in `wanted`, as RGB images (a second decode pass; only these are kept)."""
    import av

    if isinstance(source, io.BytesIO):
        source.seek(0)
    kept = {}
    with av.open(source) as container:
        for index, frame in enumerate(container.decode(container.streams.video[0])):
            if index in wanted:
                kept[index] = frame.to_image().convert("RGB")
    return kept


def encode_video(frames: list[Image.Image], fps: int = 2) -> bytes:
    """MPEG-4 bytes of `frames` (even width and height) at `fps`: how the builtin video task and the tests
    write videos (PyAV's bundled encoder; no system ffmpeg)."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"
        for image in frames:
            container.mux(stream.encode(av.VideoFrame.from_image(image.convert("RGB"))))
        container.mux(stream.encode())
    return buffer.getvalue()
