"""Each row's checks at load: the question and answer are text (or a finite number), data.format_prompt
renders the question, the `<image>` and `<video>` markers match the images and videos, no special token is
in the text, every image decodes and resizes, every video decodes into at least one temporal patch of
sampled frames, and the templated prompt fits `data.max_prompt_length`. `check_share` runs them over one
rank's share of the rows and returns the kept rows and the skipped ones with their reasons.
"""

from __future__ import annotations

import decimal
import math
import numbers
from array import array
from collections.abc import Iterator
from typing import Any, NamedTuple

from spmd_grpo.data.images import BadRow, decode_image, image_list, resized_size
from spmd_grpo.data.prompts import Prompting, chat_messages, check_text, with_video_metadata
from spmd_grpo.data.sources import Rows, Unreadable
from spmd_grpo.data.videos import Video, decode_video, video_list, video_name


class KeptRow(NamedTuple):
    """A row that passed the checks: what every rank keeps of it (no pixels)."""

    source: int  # position of its `Rows` in the source list
    row: int
    problem: str
    answer: str
    data_source: str
    token_ids: array
    num_prompt_tokens: int
    videos: str = ""
    """What the row's videos became (`name: T frames of WxH`), kept only for a row over
    data.max_prompt_length: its length filter names them."""


class SkippedRow(NamedTuple):
    source: int
    row: int
    reason: str


class SkippedFile(NamedTuple):
    """A source that failed while being read (a corrupt page): all of its rows are dropped."""

    source: int
    reason: str


def _text(value: Any, what: str) -> str:
    """A text cell as str: bytes (a binary column) must be UTF-8; anything but text is a bad row."""
    if isinstance(value, Unreadable):
        raise value.reason
    if value is None:
        raise BadRow(f"missing {what}")
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadRow(f"{what} is not UTF-8", f"byte {e.start}") from e
    if not isinstance(value, str):
        raise BadRow(f"{what} is not text", type(value).__name__)
    return value


def _answer(value: Any) -> str:
    """The ground truth as the reward function reads it: text stripped, numbers as their shortest decimal text
    (2.0 -> "2", 0.1 -> "0.1"). None, booleans (more likely a flag column than an answer), NaN/infinity and
    lists (one ground truth per row) are bad rows."""
    if value is None or isinstance(value, str | bytes | Unreadable):
        answer = _text(value, "answer").strip()
        if not answer:
            raise BadRow("empty answer")
        return answer
    if isinstance(value, bool) or not isinstance(value, numbers.Real | decimal.Decimal):
        raise BadRow("answer is not text or a number", type(value).__name__)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, decimal.Decimal):
        if not value.is_finite():
            raise BadRow("answer is not finite", str(value))
        return str(value)
    number = float(value)
    if not math.isfinite(number):
        raise BadRow("answer is not finite", str(number))
    return str(int(number)) if number.is_integer() and abs(number) < 2**53 else repr(number)


def _check_row(values: dict, source: Rows, prompting: Prompting) -> tuple[str, str, array, int, str]:
    """(problem, answer, token ids, tokens after image and video expansion, its videos described when it is
    too long) of a good row; `BadRow` names a bad one. Each image and video is decoded to check it, and
    dropped."""
    problem = _text(values["problem"], "problem")
    if not problem.strip():
        raise BadRow("empty problem")
    answer = _answer(values["answer"])
    for key in ("images", "videos"):
        if isinstance(values[key], Unreadable):
            raise values[key].reason
    images, videos = image_list(values["images"]), video_list(values["videos"])
    template, cfg, sizes = prompting.template, prompting.cfg, prompting.sizes
    text = _render(template, problem) if template is not None else problem
    check_text(text, len(images), prompting, len(videos))
    resized = [resized_size(decode_image(image, source.base_dir), cfg, sizes.factor) for image in images]
    decoded = [decode_video(video, source.base_dir, sizes.video) for video in videos]
    prompt = prompting.processor.apply_chat_template(
        chat_messages(text, cfg), add_generation_prompt=True, tokenize=False
    )
    ids = prompting.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    # a chat template adding its own vision tokens
    if ids.count(prompting.image_pad_id) != len(images) or ids.count(prompting.video_pad_id) != len(videos):
        raise BadRow("prompt has more image or video tokens than images and videos")
    if decoded:
        length = _expanded_length(prompt, source, values, decoded, prompting)
        named = ""
        if length > cfg.max_prompt_length:
            named = "; ".join(
                f"video {video_name(entry)}: {len(v.frames)} frames of {v.frames.shape[2]}x{v.frames.shape[1]}"
                for entry, v in zip(videos, decoded, strict=True)
            )
        return problem, answer, array("i", ids), length, named
    expansion = sum((height // sizes.factor) * (width // sizes.factor) - 1 for width, height in resized)
    return problem, answer, array("i", ids), len(ids) + expansion, ""


def _render(template, problem: str) -> str:
    """data.format_prompt applied to one problem; a template that fails on this row's text (it rendered the
    preflight's problem) makes the row bad, named, rather than ending the load naming nothing."""
    try:
        return template.render(content=problem)
    except Exception as e:
        raise BadRow("data.format_prompt failed on the problem", f"{type(e).__name__}: {e}") from e


def _expanded_length(
    prompt: str, source: Rows, values: dict, videos: list[Video], prompting: Prompting
) -> int:
    """Prompt tokens after expansion, from the processor itself: a video's expansion is not a product of
    its grid alone (Qwen3-VL writes a timestamp and vision start/end tokens around every temporal patch).
    The processor's video grid must be our frames' own (its resize the identity), else the frames vLLM and
    the trainer see would be resized a second time."""
    images = source.decode_images(values["images"]) if values["images"] else None
    enc = prompting.processor(
        text=[prompt],
        images=images,
        videos=[v.frames for v in videos],
        **with_video_metadata(prompting.sizes.processor_kwargs(), videos),
    )
    patch, temporal = prompting.sizes.factor // 2, prompting.sizes.video.frame_factor
    for video, grid in zip(videos, enc["video_grid_thw"], strict=True):
        t, h, w = video.frames.shape[:3]
        if [int(x) for x in grid] != [-(-t // temporal), h // patch, w // patch]:
            raise BadRow("video resized by the processor", f"frames {t}x{h}x{w}, grid {list(grid)}")
    return len(enc["input_ids"][0])


def _read_guarded(source: Rows, start: int, stop: int) -> Iterator[tuple[int, dict] | str]:
    """`source.read(start, stop)`; where reading fails on the file's content (corrupt page, bad footer), the
    failure's text is yielded last. An operating-system I/O error (it has an errno) is raised."""
    try:
        yield from source.read(start, stop)
    except Exception as e:
        if isinstance(e, OSError) and e.errno is not None:
            raise
        yield f"{type(e).__name__}: {e}"


def check_share(sources: list[Rows], prompting: Prompting, rank: int, world_size: int) -> list:
    """`KeptRow` / `SkippedRow` for this rank's contiguous share of all rows, in row order, and a `SkippedFile` (with
    none of the file's rows) for a file that failed while being read."""
    total = sum(s.num_rows for s in sources)
    start, stop = total * rank // world_size, total * (rank + 1) // world_size
    results: list[KeptRow | SkippedRow | SkippedFile] = []
    for k, source in enumerate(sources):
        lo, hi = max(start - source.index_offset, 0), min(stop - source.index_offset, source.num_rows)
        first = len(results)
        for item in _read_guarded(source, lo, hi) if lo < hi else ():
            if isinstance(item, str):
                del results[first:]
                results.append(SkippedFile(k, item))
                break
            row, values = item
            try:
                problem, answer, ids, length, videos = _check_row(values, source, prompting)
            except BadRow as reason:
                results.append(SkippedRow(k, row, str(reason)))
                continue
            data_source = values["data_source"]
            data_source = data_source if isinstance(data_source, str) else _label(data_source)
            results.append(KeptRow(k, row, problem, answer, data_source, ids, length, videos))
    return results


def _label(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return "" if isinstance(value, Unreadable) else str(value)
