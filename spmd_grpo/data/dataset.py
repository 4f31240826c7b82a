"""Data: prompt data sets (geometry3k schema) -> tokenized `Example`s whose images are decoded on demand.

Sources (`data.train_files` / `data.val_files`):
  * `builtin:color`  a synthetic, learnable task: a 56x56 solid colour, answer one digit (red/green/blue/yellow
                     -> 0/1/2/3). Tiny prompts (4 image tokens) for CPU tests and smoke runs.
  * `builtin:geo3k`  synthetic rows in the geometry3k schema (drawn diagram, numeric answer), no file needed.
                     Both are made by `spmd_grpo.data.synthetic`, which also writes them to parquet.
  * a parquet file, or a directory of parquet files (read in sorted order), in the geometry3k schema
    (hiyouga/geometry3k): `problem` (string, with one `<image>` marker per image), `answer` (string),
    `images` (list<struct<bytes: binary, path: string>>). Column names come from prompt_key/answer_key/image_key;
    a missing image column means text-only rows. An optional `data_source` column is carried through.
  * `owner/name@split` from the Hugging Face hub via `datasets.load_dataset` (needs network or a local cache);
    the `datasets` object is memory-mapped Arrow and is read in its raw Arrow form (images as {bytes, path}).

Every row becomes one `Example`: the problem's `<image>` markers become image content parts in order, the chat
template is applied with add_generation_prompt=True, and the prompt ids hold ONE `<|image_pad|>` per image (what
vLLM takes). `num_prompt_tokens` counts the prompt after image-token expansion (what the trainer sees): the
run's `ProcessorSizes` (data.prompts) resize images and sample videos here, and the trainer's processor calls
and vLLM get the same sizes, so their own resize is the identity.

Loading (`load_dataset`; a collective when world_size > 1): the source's rows (a directory's files numbered as
if concatenated in sorted order) are split into `world_size` contiguous ranges, and each rank reads ONLY its
range, `ROW_BATCH` rows at a time (parquet: `ParquetFile.iter_batches` over the row groups that overlap it). It
checks every row, decoding each image fully to do so (truncated data fails only there) and dropping the pixels
right after, so that a row that passed cannot fail later, in the trainer's processor or in vLLM. Prompts longer
than `max_prompt_length` after image and video expansion are dropped, never truncated (truncation would split an image's
pad tokens). The per-row results (kept rows with their text, answer and token ids; bad rows with their reasons)
are all-gathered with the `all_gather` the caller passes (`parallel.all_gather_objects` under torchrun), so
every rank holds the same Examples and raises the same errors; only rank 0 logs. A rank that cannot read its
range (an operating-system I/O error) sends its error through the same all-gather, and every rank raises it
rather than waiting for it. What makes a data set unusable (the cases below that are errors, and a source
that does not open) is a `DataError`, which the trainer prints as one line, `data error: ...`, before any
model is built, ending the job with exit code 2.

What a row may hold, and what happens to it (a skipped row is logged as `skipped FILE row N: REASON`, at most
`MAX_NAMED_PER_REASON` rows per reason, then one line of counts per reason; more than `max_bad_fraction` of a
file's rows skipped is an error naming the file):
  * text: str, or UTF-8 bytes (a binary column); any Unicode (NUL, emoji, right-to-left, BOM) is kept as is.
    Bytes that are not UTF-8, in a binary column or (written by a non-validating writer) in a string column:
    that row is skipped, not its batch or file.
  * answer: text (stripped) or a number, written as its shortest decimal ("2.0" -> "2"). None, empty text,
    NaN/infinity, booleans and lists: skipped.
  * the tokenizer's special tokens written as text (`<|im_start|>`, `<|im_end|>`, `<|vision_start|>`,
    `<|image_pad|>`, `<|endoftext|>`, ...): skipped, not escaped; they would end the user turn early or give vLLM
    vision tokens without an image. In `data.system_prompt` or the `data.format_prompt` file they are an
    error naming it.
  * videos (`videos` column, `<video>` markers, `data.videos`): every video is decoded and sampled at load
    (PyAV; qwen-vl-utils' rules), and the prompt's expanded length is the processor's own count; a video that
    cannot be decoded, has no frame rate or fewer frames than one temporal patch, or more videos than
    `limit_videos` (worker.rollout.limit_videos): skipped. Videos are read on demand like images
    (`Example.videos`, the step's frames only).
  * `<image>` markers must match the images; more images than `limit_images` (worker.rollout.limit_images, the
    most vLLM accepts per prompt; it would fail the whole generate call): skipped, not truncated.
  * images: every PIL mode becomes RGB (`_to_rgb`: transparency on white, 16-bit grey scaled, float grey read
    as 0..1 or 0..255); any size smart_resize accepts (a 1x1 image is scaled up to min_pixels); an aspect ratio
    above 200, too thin for max_pixels (3x500 under 16 tokens: a side would be 0 pixels) or with no size in
    [min_pixels, max_pixels] at its aspect ratio (the processor would resize it again), more pixels than
    PIL's decompression-bomb limit (refused from the header, before decoding), or data that cannot be decoded
    or is truncated: skipped. An image or video cell that is not a list of entries (a number column under
    data.image_key or data.video_key): skipped.
  * a directory's file that cannot be opened (empty, not parquet, truncated, no problem/answer column) or fails
    while being read (a corrupt page, on whichever rank reads it): skipped whole with one line naming it; no
    readable file is an error. An operating-system I/O error (with an errno) is an error, not a skip.

Images on demand: `Example.images` decodes and resizes the row's images each time it is read (the trainer
reads it once per prompt per step). A parquet row is read back through its row group: the image column of the
most recently read row group is kept (one row group per `load_dataset` call, whichever file it is in), so
random access reads one row group's image column, never the whole file. Files written with big row groups
(pandas and pyarrow write up to 1Mi rows per group) are warned about at load; Hugging Face's image parquet
exports use ~100-row groups, `tools.synthetic_data.write_parquet` 256. Hub rows are sliced from the
memory-mapped Arrow table; `builtin:` rows are generated in memory (small PNGs).

Memory per rank, N kept rows of T prompt tokens, R rows per row group, B prompts per step:
  * N x (~0.25 kB of objects and locator + the problem and answer text + 4 B x T token ids, a C-int `array`):
    0.63 kB per synthetic geometry3k row (T = 51, measured with tracemalloc), so 100k rows ~ 65 MB; no pixels;
  * one row group's image column per split (R x the encoded image size: 256 x 1.4 kB for the synthetic
    diagrams; 100 rows x 0.5 MB photos = 50 MB), plus what Arrow's allocator keeps of freed reads;
  * the step's decoded images: B x images per prompt x 4 B (PIL keeps RGB as 32-bit pixels) x resized pixels
    (<= data.max_pixels);
  * at load, transiently: one row group and `ROW_BATCH` rows of this rank's range, one decoded image, then the
    gathered results of every rank (the first item, pickled, then unpickled).
Load time: every image is decoded once, by the rank whose range holds it, so it is rows / world_size x (decode
+ tokenize): 0.4 to 1.7 ms per synthetic geometry3k row on one core of a shared CPU (benchmarks/data_memory.py).

`Example.index` is the row's number in its source (for a directory, in the concatenation). Which examples each
rank rolls out at each step is `spmd_grpo.data.sampler.PromptSampler`'s business.
"""

from __future__ import annotations

import logging
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from spmd_grpo.config.schema import DataConfig
from spmd_grpo.data.images import reason_kind
from spmd_grpo.data.prompts import ProcessorSizes, Prompting, processor_sizes
from spmd_grpo.data.row_checks import KeptRow, SkippedFile, SkippedRow, check_share
from spmd_grpo.data.sources import MAX_NAMED_PER_REASON, Rows, open_sources, warn_large_row_groups

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """A data set that cannot be trained on, found at load (too many bad rows, no readable file, no usable
    example, a source that does not open). Every rank raises the same one (the findings are all-gathered),
    so the trainer says it once, in one line, and ends the job with a config error's exit code, 2."""


AllGather = Callable[[Any], list]
"""Every rank's object, in rank order (`parallel.all_gather_objects`); [obj] in a single process."""


def _single_process(obj: Any) -> list:
    return [obj]


@dataclass(frozen=True, slots=True)
class Example:
    """One kept row: its text, answer and token ids in memory, its images read from the source on demand."""

    index: int
    """Row number in the source (original numbering, before any row was skipped or filtered)."""
    problem: str
    """Raw problem text, with its `<image>` markers."""
    answer: str
    data_source: str
    num_prompt_tokens: int
    """Prompt length after image-token expansion."""
    token_ids: array
    """The prompt's token ids as a compact int32 `array` (see `prompt_token_ids`)."""
    source: Rows = field(compare=False, repr=False)
    """Where the row's images are read from."""
    row: int = field(repr=False)
    """The row's number inside `source` (for a directory: inside its file)."""

    @property
    def prompt_token_ids(self) -> list[int]:
        """Chat template applied (add_generation_prompt=True); one `<|image_pad|>` per image."""
        return self.token_ids.tolist()

    @property
    def images(self) -> list[Image.Image]:
        """The row's images, decoded and resized NOW (each read decodes again; nothing is kept): RGB, resized
        by qwen_vl_utils.smart_resize (the processor's factor: 28, or 32 for Qwen3-VL) into [min_pixels,
        max_pixels]. The same decode passed at
        load; a failure now means the source changed since, and is a ValueError naming the file and row."""
        return self.source.images(self.row)

    @property
    def videos(self) -> list:
        """The row's videos (`data.videos.Video`: sampled, resized frames and their metadata), decoded NOW
        from the source, like `images`: frames are never held beyond the step that reads them."""
        return self.source.videos(self.row)


def load_dataset(
    cfg: DataConfig,
    processor,
    split: str = "train",
    *,
    rank: int = 0,
    world_size: int = 1,
    all_gather: AllGather = _single_process,
    limit_images: int | None = None,
    limit_videos: int | None = None,
    sizes: ProcessorSizes | None = None,
) -> list[Example]:
    """Read `cfg.train_files` (split "train") or `cfg.val_files` (split "val") into tokenized Examples.

    Each rank checks its contiguous share of the rows; `all_gather` (every rank's object in rank order; under
    torchrun `parallel.all_gather_objects`, called once by every rank) gives every rank the same Examples.
    `limit_images` / `limit_videos` (worker.rollout.limit_images / limit_videos): rows with more images or
    videos are skipped. `sizes`: the run's `processor_sizes` (None: made here from `processor`).
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    source = cfg.train_files if split == "train" else cfg.val_files
    if not source:
        raise ValueError(f"no data source for split {split!r} (data.{split}_files is not set)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    if world_size > 1 and all_gather is _single_process:
        raise ValueError(f"world_size={world_size} needs an all_gather (parallel.all_gather_objects)")
    try:
        sources, unreadable = open_sources(source, cfg, split)
        sizes = sizes or processor_sizes(cfg, processor, limit_videos)
        prompting = Prompting.for_load(cfg, processor, limit_images, sizes=sizes, limit_videos=limit_videos)
        for s in sources:  # images resized as this model's processor resizes them
            s.sizes = sizes
        layout = [(s.name, s.num_rows) for s in sources]
        mine: tuple[str, Any, Any] = ("ok", layout, check_share(sources, prompting, rank, world_size))
    except Exception as e:  # sent to every rank, so none waits in the all-gather for this one
        # a ValueError is the data's (a source that does not open, a system prompt with a special token)
        error, mine = e, ("error", f"{type(e).__name__}: {e}", isinstance(e, ValueError))
    parts = all_gather(mine)
    if len(parts) != world_size:
        raise ValueError(f"all_gather returned {len(parts)} parts for a world of size {world_size}")
    if mine[0] == "error":
        if mine[2]:
            raise DataError(str(error)) from error
        raise error
    failed = [(r, what, data) for r, (status, what, data) in enumerate(parts) if status == "error"]
    if failed:
        r, what, data = failed[0]
        raise (DataError if data else ValueError)(f"reading {source} failed on rank {r}: {what}")
    if any(what != layout for _, what, _ in parts):  # a file readable on some ranks only
        raise DataError(f"the ranks opened different files of {source}: {[what for _, what, _ in parts]}")
    results = [result for _, _, part in parts for result in part]
    examples = _examples(sources, unreadable, results, cfg, log=rank == 0, name=source)
    videos = {sources[r.source].index_offset + r.row: r.videos for r in results if getattr(r, "videos", "")}
    kept = _drop_too_long(examples, source, cfg, videos, bad_rows=_bad_row_counts(results), log=rank == 0)
    if rank == 0:
        logger.info("loaded %d %s examples from %s", len(kept), split, source)
    return kept


def _examples(
    sources: list[Rows],
    unreadable: list[tuple[str, str]],
    results: list,
    cfg: DataConfig,
    *,
    log: bool,
    name: str,
) -> list[Example]:
    """Every rank's check results (all rows, in order) -> the Examples. A file that could not be opened or
    read is skipped whole (an error when no file is left); bad rows are skipped, named (at most
    `MAX_NAMED_PER_REASON` per reason) and counted, or are an error when they are more than
    data.max_bad_fraction of their file's rows."""
    failed = {r.source: r.reason for r in results if isinstance(r, SkippedFile)}
    bad_files = unreadable + [(sources[k].name, why) for k, why in failed.items()]
    if len(failed) == len(sources):
        named = "; ".join(f"{name}: {why}" for name, why in bad_files[:MAX_NAMED_PER_REASON])
        raise DataError(f"no readable file among {len(bad_files)}: {named}")
    if log:
        _log_skipped_files(bad_files, len(sources) + len(unreadable))
    results = [r for r in results if r.source not in failed]
    bad = [r for r in results if isinstance(r, SkippedRow)]
    if log:
        num_rows = sum(s.num_rows for k, s in enumerate(sources) if k not in failed)
        _log_bad_rows(sources, bad, num_rows, name)
    for k, source in enumerate(sources):
        _check_bad_fraction(source, [r for r in bad if r.source == k], cfg)
    warn_large_row_groups(sources, log=log)
    return [
        Example(
            index=sources[r.source].index_offset + r.row,
            problem=r.problem,
            answer=r.answer,
            source=sources[r.source],
            row=r.row,
            data_source=r.data_source,
            num_prompt_tokens=r.num_prompt_tokens,
            token_ids=r.token_ids,
        )
        for r in results
        if isinstance(r, KeptRow)
    ]


def _log_skipped_files(bad_files: list[tuple[str, str]], num_files: int) -> None:
    for name, why in bad_files[:MAX_NAMED_PER_REASON]:
        logger.warning("skipped unreadable file %s: %s", name, why)
    if len(bad_files) > MAX_NAMED_PER_REASON:
        logger.warning(
            "skipped %d unreadable files of %d (%d named above)",
            len(bad_files),
            num_files,
            MAX_NAMED_PER_REASON,
        )


def _bad_row_counts(results: list) -> str:
    """`N bad rows (reason: count, ...)` of the check results, or '' when there are none."""
    counts = Counter(reason_kind(r.reason) for r in results if isinstance(r, SkippedRow))
    files = sum(isinstance(r, SkippedFile) for r in results)
    text = ", ".join(f"{kind}: {n}" for kind, n in counts.most_common())
    return (f"{counts.total()} bad rows ({text})" if counts else "") + (
        f"{'; ' if counts else ''}{files} unreadable files" if files else ""
    )


def _log_bad_rows(sources: list[Rows], bad: list[SkippedRow], num_rows: int, name: str) -> None:
    """One line per bad row, naming its file, row and reason, for the first `MAX_NAMED_PER_REASON` rows of
    each reason; then one line with the counts by reason."""
    if not bad:
        return
    named: Counter[str] = Counter()
    for r in bad:
        kind = reason_kind(r.reason)
        named[kind] += 1
        if named[kind] <= MAX_NAMED_PER_REASON:
            logger.warning("skipped %s row %d: %s", sources[r.source].name, r.row, r.reason)
    unnamed = sum(max(n - MAX_NAMED_PER_REASON, 0) for n in named.values())
    logger.warning(
        "skipped %d of %d rows in %s: %s%s",
        len(bad),
        num_rows,
        name,
        ", ".join(f"{kind}: {n}" for kind, n in named.most_common()),
        f" ({unnamed} not named above: at most {MAX_NAMED_PER_REASON} per reason)" if unnamed else "",
    )


def _check_bad_fraction(source: Rows, bad: list[SkippedRow], cfg: DataConfig) -> None:
    if len(bad) > cfg.max_bad_fraction * source.num_rows:
        first = "; ".join(f"row {r.row} {r.reason}" for r in bad[:MAX_NAMED_PER_REASON])
        raise DataError(
            f"{source.name}: {len(bad)} of {source.num_rows} rows are bad, more than data.max_bad_fraction="
            f"{cfg.max_bad_fraction}; first reasons: {first}"
        )


def _drop_too_long(
    examples: list[Example], source: str, cfg: DataConfig, videos: dict[int, str], *, bad_rows: str, log: bool
) -> list[Example]:
    """The examples within data.max_prompt_length after image and video expansion, in order; one log line
    describes the others (their lengths and videos, and the keys that shorten them). None left: a
    ValueError with that description and `bad_rows` (the counts of the rows skipped before)."""
    kept, too_long = [], []
    for example in examples:
        if example.num_prompt_tokens > cfg.max_prompt_length:
            too_long.append(example)
        else:
            kept.append(example)
    if not too_long and kept:
        return kept
    if not too_long:
        raise DataError(
            f"no usable examples in {source} (data.max_prompt_length={cfg.max_prompt_length}): "
            f"{bad_rows or 'it holds no rows'}"
        )
    named = [
        f"row {e.index}: {e.num_prompt_tokens} tokens"
        + (f" ({videos[e.index]})" if e.index in videos else "")
        for e in too_long[:5]
    ]
    lengths = sorted(e.num_prompt_tokens for e in too_long)
    what = (
        f"{len(too_long)} of {len(examples)} prompts, {lengths[0]} to {lengths[-1]} tokens after image and "
        f"video expansion ({'; '.join(named)}{'; ...' if len(too_long) > 5 else ''}): raise "
        "data.max_prompt_length"
    )
    if any(e.index in videos for e in too_long):
        what += (
            ", or shorten the videos' prompts (fewer, smaller frames) with data.video_max_frames, "
            "data.video_fps, data.video_max_pixels or data.video_total_pixels"
        )
    elif too_long[0].source.images(too_long[0].row):  # (decodes that row's images once)
        what += ", or shrink the images with data.max_pixels"
    if not kept:
        why = "; ".join(filter(None, [bad_rows, f"too long: {what}"]))
        raise DataError(
            f"no usable examples in {source} (data.max_prompt_length={cfg.max_prompt_length}): {why}"
        )
    if log:
        logger.warning("filtered %s from %s: longer than data.max_prompt_length=%d", what, source,
                       cfg.max_prompt_length)  # fmt: skip
    return kept
