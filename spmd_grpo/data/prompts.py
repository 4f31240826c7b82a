"""Prompts: the chat messages of a row (text split at `<image>` and `<video>` markers), the optional jinja
format template (`data.format_prompt`), the processor's size arguments of a run (`ProcessorSizes`, decided
once by `processor_sizes` and handed to the data loader, the trainer and vLLM), and `Prompting`, which
tokenizes a row the way vLLM and the trainer both see it (one `<|image_pad|>` per image, one `<|video_pad|>`
per video; vLLM expands them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spmd_grpo.config.schema import DataConfig
from spmd_grpo.data.images import DEFAULT_IMAGE_FACTOR, BadRow
from spmd_grpo.data.videos import VIDEO_MARKER, VideoRules

IMAGE_MARKER = "<image>"
_MARKERS = re.compile(f"({re.escape(IMAGE_MARKER)}|{re.escape(VIDEO_MARKER)})")


# ------------------------------------------------------------------------------------------ rows -> examples
def chat_messages(text: str, cfg: DataConfig) -> list[dict]:
    if IMAGE_MARKER in text or VIDEO_MARKER in text:
        content: str | list[dict] = []
        for piece in _MARKERS.split(text):
            if piece in (IMAGE_MARKER, VIDEO_MARKER):
                content.append({"type": piece.strip("<>")})
            elif piece:
                content.append({"type": "text", "text": piece})
    else:
        content = text  # a plain string renders with text-only chat templates too
    messages = [{"role": "user", "content": content}]
    if cfg.system_prompt:
        messages.insert(0, {"role": "system", "content": cfg.system_prompt})
    return messages


def image_factor(processor) -> int:
    """Pixels per image-token side of the processor's resize (patch x merge: 28, or 32 for Qwen3-VL)."""
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None:
        return DEFAULT_IMAGE_FACTOR
    return getattr(image_processor, "patch_size", 14) * getattr(image_processor, "merge_size", 2)


@dataclass(frozen=True)
class ProcessorSizes:
    """The processor's size arguments of a run: how the data loader resizes images and samples videos, and
    what the trainer's processor calls and vLLM (`mm_processor_kwargs`) are given, so that all three see the
    same pixels and the processors' own resize is the identity. Made once, by `processor_sizes`."""

    min_pixels: int
    """Image bounds (data.min_pixels / data.max_pixels)."""
    max_pixels: int
    factor: int
    """Pixels per image-token side of the model's processor (patch x merge)."""
    video: VideoRules
    """Frame sampling and per-frame / total pixel budgets of videos (data.video_*, defaults filled in)."""
    videos: bool
    """Whether a prompt can hold videos (worker.rollout.limit_videos > 0): the processor call then takes
    per-modality arguments."""

    def image_size(self) -> dict[str, int]:
        """The image processor's `size` (not min_pixels/max_pixels: transformers deprecates those as per-call
        kwargs)."""
        return {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}

    def processor_kwargs(self) -> dict:
        """The processor call's (and vLLM's `mm_processor_kwargs`) sizes: `size` for images when no video
        can occur, else `images_kwargs` and `videos_kwargs` (a shared `size` would give frames the image
        bounds)."""
        if not self.videos:
            return {"size": self.image_size()}
        return {
            "images_kwargs": {"size": self.image_size()},
            "videos_kwargs": {"size": self.video.processor_size()},
        }


def processor_sizes(cfg: DataConfig, processor, limit_videos: int | None) -> ProcessorSizes:
    """The run's `ProcessorSizes`: the data section's bounds for `processor`'s factor. `limit_videos`
    (worker.rollout.limit_videos; None: no limit) says whether videos can occur."""
    factor = image_factor(processor)
    return ProcessorSizes(
        min_pixels=cfg.min_pixels,
        max_pixels=cfg.max_pixels,
        factor=factor,
        video=VideoRules.of(cfg, factor),
        videos=limit_videos != 0,
    )


def _load_template(cfg: DataConfig, special: re.Pattern | None):
    """data.format_prompt's template. A special token written in it is an error naming the file (every row
    would otherwise be skipped for a special token in its text, naming the rows instead)."""
    if cfg.format_prompt is None:
        return None
    import jinja2

    path = Path(cfg.format_prompt).expanduser()
    if not path.is_file():
        raise ValueError(f"data.format_prompt: no such file {cfg.format_prompt}")
    text = path.read_text()
    found = special.search(text) if special else None
    if found:
        raise ValueError(
            f"data.format_prompt: {cfg.format_prompt} contains the special token {found.group()!r}"
        )
    return jinja2.Template(text)


def _special_tokens(tokenizer) -> re.Pattern | None:
    """A pattern matching any of the tokenizer's special tokens written as text (longest first)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    tokens = {t.content for t in decoder.values() if getattr(t, "special", False)}
    tokens |= set(getattr(tokenizer, "all_special_tokens", None) or ())
    if not tokens:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


@dataclass(frozen=True)
class Prompting:
    """What turns a row into a checked, tokenized prompt, the same for every row of one `load_dataset` call."""

    cfg: DataConfig
    processor: Any
    tokenizer: Any
    template: Any  # jinja2.Template of data.format_prompt, or None
    image_pad_id: int
    sizes: ProcessorSizes  # the run's image resize, video sampling and processor arguments
    special_tokens: re.Pattern | None  # the tokenizer's special tokens as text
    limit_images: int | None  # most images per prompt the rollout engine accepts
    video_pad_id: int = -1
    limit_videos: int | None = None  # most videos per prompt the rollout engine accepts

    @classmethod
    def for_load(
        cls,
        cfg: DataConfig,
        processor,
        limit_images: int | None,
        *,
        sizes: ProcessorSizes,
        limit_videos: int | None = None,
    ) -> Prompting:
        tokenizer = getattr(processor, "tokenizer", processor)
        image_pad_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        special = _special_tokens(tokenizer)
        found = special.search(cfg.system_prompt) if special and cfg.system_prompt else None
        if found:
            raise ValueError(f"data.system_prompt contains the special token {found.group()!r}")
        template = _load_template(cfg, special)
        video_pad_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
        return cls(
            cfg, processor, tokenizer, template, image_pad_id, sizes, special, limit_images,
            video_pad_id, limit_videos,
        )  # fmt: skip


def with_video_metadata(kwargs: dict, videos: list) -> dict:
    """`processor_kwargs` for a call with `videos` (`data.videos.Video`s): their metadata, and no frame
    sampling (the frames are final)."""
    videos_kwargs = dict(kwargs["videos_kwargs"], do_sample_frames=False)
    videos_kwargs["video_metadata"] = [v.metadata for v in videos]
    return dict(kwargs, videos_kwargs=videos_kwargs)


def check_text(text: str, num_images: int, prompting: Prompting, num_videos: int = 0) -> None:
    """The prompt text against what vLLM and the chat template need: no special tokens written as text (they
    would end the user turn early or add vision tokens vLLM has no image for), one `<image>` per image and
    one `<video>` per video, no more images or videos than the rollout engine takes (vLLM rejects the
    request: the whole generate call fails)."""
    found = prompting.special_tokens.search(text) if prompting.special_tokens else None
    if found:
        raise BadRow("text contains a special token", repr(found.group()))
    kinds = (
        (IMAGE_MARKER, "images", num_images, prompting.limit_images),
        (VIDEO_MARKER, "videos", num_videos, prompting.limit_videos),
    )
    for marker, what, count, limit in kinds:
        num_markers = text.count(marker)
        if num_markers != count:
            raise BadRow(f"{marker} markers do not match {what}", f"{num_markers} markers, {count} {what}")
        if limit is not None and count > limit:
            raise BadRow(f"more {what} than worker.rollout.limit_{what}", f"{count} > {limit}")
