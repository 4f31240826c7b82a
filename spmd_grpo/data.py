"""Data: prompt data sets (geometry3k schema) -> tokenized `Example`s whose images are decoded on demand.

Sources (`data.train_files` / `data.val_files`):
  * `builtin:color`  a synthetic, learnable task: a 56x56 solid colour, answer one digit (red/green/blue/yellow
                     -> 0/1/2/3). Tiny prompts (4 image tokens) for CPU tests and smoke runs.
  * `builtin:geo3k`  synthetic rows in the geometry3k schema (drawn diagram, numeric answer), no file needed.
                     Both are made by `spmd_grpo.tools.synthetic_data`, which also writes them to parquet.
  * a parquet file, or a directory of parquet files (read in sorted order), in the geometry3k schema
    (hiyouga/geometry3k): `problem` (string, with one `<image>` marker per image), `answer` (string),
    `images` (list<struct<bytes: binary, path: string>>). Column names come from prompt_key/answer_key/image_key;
    a missing image column means text-only rows. An optional `data_source` column is carried through.
  * `owner/name@split` from the Hugging Face hub via `datasets.load_dataset` (needs network or a local cache);
    the `datasets` object is memory-mapped Arrow and is read in its raw Arrow form (images as {bytes, path}).

Every row becomes one `Example`: the problem's `<image>` markers become image content parts in order, the chat
template is applied with add_generation_prompt=True, and the prompt ids hold ONE `<|image_pad|>` per image (what
vLLM takes). `num_prompt_tokens` counts the prompt after image-token expansion (what the trainer sees), assuming
the trainer's processor uses the same min/max pixels (images are resized to that rule here, so the processor's
own resize is then the identity; a warning is logged when its bounds are narrower).

Loading (`load_dataset`; a collective when world_size > 1): the source's rows (a directory's files numbered as
if concatenated in sorted order) are split into `world_size` contiguous ranges, and each rank reads ONLY its
range, `ROW_BATCH` rows at a time (parquet: `ParquetFile.iter_batches` over the row groups that overlap it). It
checks every row, decoding each image fully to do so (truncated data fails only there) and dropping the pixels
right after, so that a row that passed cannot fail later, in the trainer's processor or in vLLM. Prompts longer
than `max_prompt_length` after image expansion are dropped, never truncated (truncation would split an image's
pad tokens). The per-row results (kept rows with their text, answer and token ids; bad rows with their reasons)
are all-gathered with the `all_gather` the caller passes (`distributed.all_gather_objects` under torchrun), so
every rank holds the same Examples and raises the same errors; only rank 0 logs. A rank that cannot read its
range (an operating-system I/O error) sends its error through the same all-gather, and every rank raises it
rather than waiting for it.

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
    vision tokens without an image. In `data.system_prompt` they are an error.
  * `<image>` markers must match the images; more images than `limit_images` (worker.rollout.limit_images, the
    most vLLM accepts per prompt; it would fail the whole generate call): skipped, not truncated.
  * images: every PIL mode becomes RGB (`_to_rgb`: transparency on white, 16-bit grey scaled, float grey read
    as 0..1 or 0..255); any size smart_resize accepts (a 1x1 image is scaled up to min_pixels); an aspect ratio
    above 200 or too thin for max_pixels (3x500 under 16 tokens: a side would be 0 pixels), more pixels than
    PIL's decompression-bomb limit (refused from the header, before decoding), or data that cannot be decoded
    or is truncated: skipped.
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
rank rolls out at each step is `spmd_grpo.sampler.PromptSampler`'s business.
"""

from __future__ import annotations

import decimal
import io
import logging
import math
import numbers
import re
import warnings
from array import array
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from PIL import Image

from spmd_grpo.config import BUILTIN_DATASETS, HUB_ID, DataConfig
from spmd_grpo.tools.synthetic_data import color_task_examples, synthetic_geo3k_rows

logger = logging.getLogger(__name__)

IMAGE_MARKER = "<image>"
IMAGE_FACTOR = 28  # Qwen2.5-VL: patch 14 x spatial merge 2; one image token per 28x28 pixels
ROW_BATCH = 64  # rows converted to Python at a time while checking
MAX_NAMED_PER_REASON = 5  # skipped rows named in the log per reason (the rest are counted)
LARGE_ROW_GROUP_BYTES = 256 << 20  # an image column chunk above this is warned about (read whole per access)
_BYTESIO_REPR = re.compile(r" <_io\.BytesIO object at 0x[0-9a-fA-F]+>")

AllGather = Callable[[Any], list]
"""Every rank's object, in rank order (`distributed.all_gather_objects`); [obj] in a single process."""


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
    source: _Rows = field(compare=False, repr=False)
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
        by qwen_vl_utils.smart_resize (factor 28) into [min_pixels, max_pixels]. The same decode passed at
        load; a failure now means the source changed since, and is a ValueError naming the file and row."""
        return self.source.images(self.row)


# ------------------------------------------------------------------------------------------ images
class _BadRow(Exception):
    """A row that is skipped. `kind` groups rows in the skip log (at most `MAX_NAMED_PER_REASON` named per
    kind); the message is `kind (detail)`."""

    def __init__(self, kind: str, detail: str | None = None) -> None:
        super().__init__(f"{kind} ({detail})" if detail else kind)
        self.kind = kind


def _reason_kind(reason: str) -> str:
    return reason.partition(" (")[0]


def _image_list(images: Any) -> list:
    """A row's image cell as a list of image entries (None: no images; a single entry: one image)."""
    if images is None:
        return []
    if isinstance(images, Image.Image | bytes | dict | str):
        return [images]
    return list(images)


def _open_image(image: Any, base_dir: Path | None) -> Image.Image:
    if isinstance(image, Image.Image):
        return image
    data, path = image, None
    if isinstance(image, dict):
        data, path = image.get("bytes"), image.get("path")
    if isinstance(data, bytes | bytearray):
        return Image.open(io.BytesIO(data))
    if isinstance(data or path, str):
        file = Path(data or path)
        if not file.is_absolute() and base_dir is not None and not file.exists():
            file = base_dir / file
        return Image.open(file)
    raise _BadRow("undecodable image", f"no bytes or path in a {type(image).__name__}")


def _decode_image(image: Any, base_dir: Path | None) -> Image.Image:
    """The image fully decoded (truncated data fails here, not later) and converted to RGB (`_to_rgb`).
    Images above PIL's decompression-bomb limit (`Image.MAX_IMAGE_PIXELS`, 89.5M pixels) are refused from
    their header, before any pixel is decoded, where PIL alone would warn and decode up to twice that."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            decoded = _open_image(image, base_dir)
            decoded.load()
        return _to_rgb(decoded)
    except _BadRow:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise _BadRow("image too large", str(e).partition(", could")[0]) from e
    except Exception as e:
        raise _BadRow("undecodable image", _BYTESIO_REPR.sub("", str(e)) or type(e).__name__) from e


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB as the model should see the image. PIL's `convert("RGB")` is right for 1, L, P, CMYK, YCbCr, but:
    transparency is composited on white (qwen_vl_utils does so for RGBA; a dropped alpha turns a transparent
    diagram background black); 16-bit grey (I;16*, and I, which 16-bit PNGs open as) is scaled from
    0..65535 (PIL clips at 255: a 16-bit scan turns white); float grey (F) is read as 0..1 when all its
    values lie there, else as 0..255 (clipped; NaN -> 0)."""
    import numpy as np

    mode = image.mode
    if mode == "RGB":
        return image
    if mode in ("RGBA", "LA", "La", "RGBa", "PA") or (mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        rgb = Image.new("RGB", rgba.size, (255, 255, 255))
        rgb.paste(rgba, mask=rgba.getchannel("A"))
        return rgb
    if mode.startswith("I") or mode == "F":
        values = np.nan_to_num(np.asarray(image, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
        if mode != "F":
            values = values / 257.0
        elif values.size and values.min() >= 0.0 and values.max() <= 1.0:
            values = values * 255.0
        grey = np.clip(np.rint(values), 0, 255).astype(np.uint8)
        return Image.fromarray(grey).convert("RGB")
    return image.convert("RGB")


def _resized_size(image: Image.Image, cfg: DataConfig) -> tuple[int, int]:
    """(width, height) of `image` after qwen_vl_utils.smart_resize into [min_pixels, max_pixels]."""
    from qwen_vl_utils import smart_resize

    try:
        height, width = smart_resize(
            image.height,
            image.width,
            factor=IMAGE_FACTOR,
            min_pixels=cfg.min_pixels,
            max_pixels=cfg.max_pixels,
        )
    except ValueError as e:  # extreme aspect ratio
        raise _BadRow("image cannot be resized", str(e)) from e
    if min(width, height) < IMAGE_FACTOR or width * height > cfg.max_pixels:
        # A thin image under a small max_pixels: smart_resize floors one side to 0 (PIL's resize then fails
        # in the middle of training), and the processor's own rule would exceed max_pixels.
        raise _BadRow(
            "image cannot be resized",
            f"{image.width}x{image.height} has no {IMAGE_FACTOR}-multiple size within "
            f"data.max_pixels={cfg.max_pixels} at its aspect ratio",
        )
    return width, height


def _processor_size(size: tuple[int, int], cfg: DataConfig, factor: int) -> tuple[int, int]:
    """(width, height) the processor gives an image of `size` (already resized here with factor 28): the same
    for patch 14 (Qwen2-VL, Qwen2.5-VL); Qwen3-VL's patch 16 resizes again to multiples of 32."""
    if factor == IMAGE_FACTOR:
        return size
    from qwen_vl_utils import smart_resize

    height, width = smart_resize(
        size[1], size[0], factor=factor, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels
    )
    return width, height


def _resize(image: Image.Image, cfg: DataConfig) -> Image.Image:
    size = _resized_size(image, cfg)
    return image if size == image.size else image.resize(size, Image.Resampling.BICUBIC)


# ------------------------------------------------------------------------------------------ sources
class _Rows:
    """One source of rows: a parquet file, a hub data set, or generated rows.

    `read(start, stop)` yields `(row, values)` for rows [start, stop) in order, holding at most a row group
    plus `ROW_BATCH` rows at a time; `values` is the normalised row {problem, answer, images, data_source}.
    `raw_images(row)` is one row's image cell as stored. `images(row)` decodes and resizes it.
    """

    name: str  # for log lines and errors
    num_rows: int
    index_offset: int  # Example.index of row 0
    base_dir: Path | None  # where relative image paths are resolved
    cfg: DataConfig

    def read(self, start: int, stop: int) -> Iterator[tuple[int, dict]]:
        raise NotImplementedError

    def raw_images(self, row: int) -> Any:
        raise NotImplementedError

    def images(self, row: int) -> list[Image.Image]:
        try:
            images = _image_list(self.raw_images(row))
            return [_resize(_decode_image(image, self.base_dir), self.cfg) for image in images]
        except _BadRow as e:
            raise ValueError(f"{self.name} row {row}: {e}, though it passed the check at load") from e


def _keys(cfg: DataConfig) -> tuple[str, str, str]:
    return cfg.prompt_key, cfg.answer_key, cfg.image_key


def _normalise(row: dict, data_source: str, keys: tuple[str, str, str]) -> dict:
    prompt_key, answer_key, image_key = keys
    return {
        "problem": row.get(prompt_key),
        "answer": row.get(answer_key),
        "images": row.get(image_key),
        "data_source": row.get("data_source") or data_source,
    }


def _arrow_rows(batch, first_row: int, data_source: str, keys: tuple[str, str, str]):
    """`(row, normalised values)` of an Arrow table or record batch whose first row is `first_row`."""
    names = batch.schema.names
    wanted = [*keys, "data_source"]
    columns = {k: _pylist(batch.column(k), k) for k in wanted if k in names}
    for i in range(batch.num_rows):
        yield first_row + i, _normalise({k: v[i] for k, v in columns.items()}, data_source, keys)


class _Unreadable(NamedTuple):
    """A cell Arrow could not convert to Python (the row is bad, not its batch)."""

    reason: _BadRow


def _pylist(column, name: str) -> list:
    """A column's values; a value that cannot be converted (invalid UTF-8 in a string column, which writers
    other than Arrow's may produce, fails `to_pylist` for the whole batch) becomes an `_Unreadable`."""
    try:
        return column.to_pylist()
    except Exception:
        values: list = []
        for i in range(len(column)):
            try:
                values.append(column[i].as_py())
            except UnicodeDecodeError as e:
                values.append(_Unreadable(_BadRow(f"{name} is not UTF-8", f"byte {e.start}")))
            except Exception as e:
                values.append(_Unreadable(_BadRow(f"{name} unreadable", f"{type(e).__name__}: {e}")))
        return values


def _check_columns(name: str, columns: list[str], cfg: DataConfig) -> None:
    for key in (cfg.prompt_key, cfg.answer_key):
        if key not in columns:
            raise ValueError(
                f"{name}: no column {key!r} (columns: {columns}); set data.prompt_key/answer_key"
            )


class _MemoryRows(_Rows):
    """Generated rows (`builtin:` tasks), kept in memory with their encoded images."""

    def __init__(self, name: str, rows: list[dict], data_source: str, cfg: DataConfig) -> None:
        keys = ("problem", "answer", "images")
        self.rows = [_normalise(row, data_source, keys) for row in rows]
        self.name, self.num_rows, self.index_offset, self.base_dir, self.cfg = name, len(rows), 0, None, cfg

    def read(self, start: int, stop: int) -> Iterator[tuple[int, dict]]:
        yield from enumerate(self.rows[start:stop], start)

    def raw_images(self, row: int) -> Any:
        return self.rows[row]["images"]


class _RowGroupCache:
    """The image column of the most recently read parquet row group, shared by every file of one load."""

    def __init__(self) -> None:
        self.key: tuple[Path, int] | None = None
        self.column = None  # pyarrow ChunkedArray

    def get(self, path: Path, group: int, image_key: str):
        if self.key != (path, group):
            import pyarrow.parquet as pq

            self.key, self.column = None, None  # free the previous group before reading the next one
            with pq.ParquetFile(path) as f:
                self.column = f.read_row_group(group, columns=[image_key]).column(image_key)
            self.key = (path, group)
        return self.column


class _ParquetRows(_Rows):
    """One parquet file: its footer (row groups, columns) at open, its rows read by row group."""

    def __init__(self, path: Path, cfg: DataConfig, cache: _RowGroupCache, index_offset: int) -> None:
        import pyarrow.parquet as pq

        with pq.ParquetFile(path) as f:
            meta, self.columns = f.metadata, f.schema_arrow.names
        _check_columns(str(path), self.columns, cfg)
        groups = [meta.row_group(g) for g in range(meta.num_row_groups)]
        self.starts = [0]  # first row of each row group
        for group in groups:
            self.starts.append(self.starts[-1] + group.num_rows)
        self.largest_image_chunk = max(
            (sum(_image_chunk_bytes(group, cfg.image_key)) for group in groups), default=0
        )
        self.name, self.path, self.num_rows, self.index_offset = str(path), path, meta.num_rows, index_offset
        self.base_dir, self.cfg, self.cache = path.parent, cfg, cache

    def read(self, start: int, stop: int) -> Iterator[tuple[int, dict]]:
        import pyarrow.parquet as pq

        if start >= stop:
            return
        first, last = bisect_right(self.starts, start) - 1, bisect_right(self.starts, stop - 1) - 1
        wanted = [k for k in (*_keys(self.cfg), "data_source") if k in self.columns]
        row = self.starts[first]
        with pq.ParquetFile(self.path) as f:
            groups = range(first, last + 1)
            for batch in f.iter_batches(batch_size=ROW_BATCH, row_groups=groups, columns=wanted):
                lo, hi = max(start - row, 0), min(stop - row, batch.num_rows)
                if lo < hi:
                    yield from _arrow_rows(
                        batch.slice(lo, hi - lo), row + lo, self.path.stem, _keys(self.cfg)
                    )
                row += batch.num_rows

    def raw_images(self, row: int) -> Any:
        if self.cfg.image_key not in self.columns:
            return None
        group = bisect_right(self.starts, row) - 1
        return self.cache.get(self.path, group, self.cfg.image_key)[row - self.starts[group]].as_py()


def _image_chunk_bytes(group, image_key: str) -> Iterator[int]:
    """Uncompressed bytes of the image column's leaves in one row group's metadata."""
    for i in range(group.num_columns):
        column = group.column(i)
        if column.path_in_schema == image_key or column.path_in_schema.startswith(image_key + "."):
            yield column.total_uncompressed_size


class _HubRows(_Rows):
    """A Hugging Face `datasets.Dataset` (memory-mapped Arrow), read in its raw Arrow form."""

    def __init__(self, name: str, dataset, data_source: str, cfg: DataConfig) -> None:
        _check_columns(name, dataset.column_names, cfg)
        self.table, self.data_source = dataset.with_format("arrow"), data_source
        self.name, self.num_rows, self.index_offset, self.base_dir, self.cfg = (
            name,
            len(dataset),
            0,
            None,
            cfg,
        )

    def read(self, start: int, stop: int) -> Iterator[tuple[int, dict]]:
        for lo in range(start, stop, ROW_BATCH):
            yield from _arrow_rows(
                self.table[lo : min(lo + ROW_BATCH, stop)], lo, self.data_source, _keys(self.cfg)
            )

    def raw_images(self, row: int) -> Any:
        if self.cfg.image_key not in self.table.column_names:
            return None
        return self.table[row : row + 1].column(self.cfg.image_key)[0].as_py()


def _open_parquet_files(files: list[Path], cfg: DataConfig) -> tuple[list[_Rows], list[tuple[str, str]]]:
    """The files' rows (footers read) and the files that cannot be opened, with why (not parquet, empty,
    truncated, no problem/answer column). An OS-level I/O error is raised; so is every file failing."""
    opened: list[_Rows] = []
    unreadable: list[tuple[str, str]] = []
    cache = _RowGroupCache()
    for file in files:
        try:
            opened.append(_ParquetRows(file, cfg, cache, sum(s.num_rows for s in opened)))
        except Exception as e:
            if isinstance(e, OSError) and e.errno is not None:
                raise
            unreadable.append((str(file), f"{type(e).__name__}: {e}"))
    if not opened:
        named = "; ".join(f"{name}: {why}" for name, why in unreadable[:MAX_NAMED_PER_REASON])
        raise ValueError(f"no readable parquet file among {len(files)}: {named}")
    return opened, unreadable


def _open_sources(source: str, cfg: DataConfig, split: str) -> tuple[list[_Rows], list[tuple[str, str]]]:
    """The rows of `source`, opened (parquet: footers only; hub: memory-mapped; builtin: generated), and the
    files of a directory that cannot be opened, with why."""
    seed = cfg.seed if split == "train" else cfg.seed + 1  # builtin validation rows differ from training rows
    if source.startswith("builtin:"):
        task = source.removeprefix("builtin:")
        makers = {"color": color_task_examples, "geo3k": synthetic_geo3k_rows}
        assert set(makers) == set(BUILTIN_DATASETS), "config.BUILTIN_DATASETS lists other tasks"
        if task not in makers:
            raise ValueError(
                f"unknown builtin dataset {source!r}; available: {sorted('builtin:' + k for k in makers)}"
            )
        return [_MemoryRows(source, makers[task](cfg.num_builtin_examples, seed), task, cfg)], []
    path = Path(source).expanduser()
    if path.is_dir() or path.is_file():
        files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
        if not files:
            raise ValueError(f"no *.parquet files in directory {source}")
        return _open_parquet_files(files, cfg)
    if HUB_ID.match(source):
        name, _, hub_split = source.partition("@")
        hub_split = hub_split or split
        try:
            import datasets

            dataset = datasets.load_dataset(name, split=hub_split)
        except Exception as e:  # offline, unknown id, unknown split, ...: name what was asked for
            raise ValueError(
                f"cannot load Hugging Face dataset {name!r} split {hub_split!r} (from {source!r}): "
                f"{type(e).__name__}: {e}"
            ) from e
        return [_HubRows(source, dataset, name, cfg)], []
    raise ValueError(
        f"data source {source!r} is not an existing parquet file or directory, a `builtin:` task, or a hub id "
        "`owner/name@split`"
    )


# ------------------------------------------------------------------------------------------ rows -> examples
def _messages(text: str, cfg: DataConfig) -> list[dict]:
    if IMAGE_MARKER in text:
        content: str | list[dict] = []
        for i, piece in enumerate(text.split(IMAGE_MARKER)):
            if i > 0:
                content.append({"type": "image"})
            if piece:
                content.append({"type": "text", "text": piece})
    else:
        content = text  # a plain string renders with text-only chat templates too
    messages = [{"role": "user", "content": content}]
    if cfg.system_prompt:
        messages.insert(0, {"role": "system", "content": cfg.system_prompt})
    return messages


def _image_processor_bounds(processor) -> tuple[int | None, int | None, int]:
    """(min_pixels, max_pixels, tokens-per-side factor) of the processor's image resize, where it says."""
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None:
        return None, None, IMAGE_FACTOR
    factor = getattr(image_processor, "patch_size", 14) * getattr(image_processor, "merge_size", 2)
    size = getattr(image_processor, "size", None)
    size = dict(size.items()) if hasattr(size, "items") else {}
    low = getattr(image_processor, "min_pixels", None) or size.get("min_pixels") or size.get("shortest_edge")
    high = getattr(image_processor, "max_pixels", None) or size.get("max_pixels") or size.get("longest_edge")
    return low, high, factor


def _load_template(cfg: DataConfig):
    if cfg.format_prompt is None:
        return None
    import jinja2

    path = Path(cfg.format_prompt).expanduser()
    if not path.is_file():
        raise ValueError(f"data.format_prompt: no such file {cfg.format_prompt}")
    return jinja2.Template(path.read_text())


def _special_tokens(tokenizer) -> re.Pattern | None:
    """A pattern matching any of the tokenizer's special tokens written as text (longest first)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    tokens = {t.content for t in decoder.values() if getattr(t, "special", False)}
    tokens |= set(getattr(tokenizer, "all_special_tokens", None) or ())
    if not tokens:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


@dataclass(frozen=True)
class _Prompting:
    """What turns a row into a checked, tokenized prompt, the same for every row of one `load_dataset` call."""

    cfg: DataConfig
    processor: Any
    tokenizer: Any
    template: Any  # jinja2.Template of data.format_prompt, or None
    image_pad_id: int
    factor: int  # pixels per image-token side of the processor's resize
    special_tokens: re.Pattern | None  # the tokenizer's special tokens as text
    limit_images: int | None  # most images per prompt the rollout engine accepts

    @classmethod
    def for_load(cls, cfg: DataConfig, processor, limit_images: int | None, *, log: bool) -> _Prompting:
        tokenizer = getattr(processor, "tokenizer", processor)
        image_pad_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        proc_min, proc_max, factor = _image_processor_bounds(processor)
        if log and ((proc_min and cfg.min_pixels < proc_min) or (proc_max and cfg.max_pixels > proc_max)):
            logger.warning(
                "data.min_pixels/max_pixels [%d, %d] exceed the processor's [%s, %s]: the processor will "
                "resize images again and num_prompt_tokens will not match its expansion",
                cfg.min_pixels,
                cfg.max_pixels,
                proc_min,
                proc_max,
            )
        special = _special_tokens(tokenizer)
        found = special.search(cfg.system_prompt) if special and cfg.system_prompt else None
        if found:
            raise ValueError(f"data.system_prompt contains the special token {found.group()!r}")
        template = _load_template(cfg)
        return cls(cfg, processor, tokenizer, template, image_pad_id, factor, special, limit_images)


class _Kept(NamedTuple):
    """A row that passed the checks: what every rank keeps of it (no pixels)."""

    source: int  # position of its `_Rows` in the source list
    row: int
    problem: str
    answer: str
    data_source: str
    token_ids: array
    num_prompt_tokens: int


class _Bad(NamedTuple):
    source: int
    row: int
    reason: str


class _BadFile(NamedTuple):
    """A source that failed while being read (a corrupt page): all of its rows are dropped."""

    source: int
    reason: str


def _text(value: Any, what: str) -> str:
    """A text cell as str: bytes (a binary column) must be UTF-8; anything but text is a bad row."""
    if isinstance(value, _Unreadable):
        raise value.reason
    if value is None:
        raise _BadRow(f"missing {what}")
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _BadRow(f"{what} is not UTF-8", f"byte {e.start}") from e
    if not isinstance(value, str):
        raise _BadRow(f"{what} is not text", type(value).__name__)
    return value


def _answer(value: Any) -> str:
    """The ground truth as the reward function reads it: text stripped, numbers as their shortest decimal text
    (2.0 -> "2", 0.1 -> "0.1"). None, booleans (more likely a flag column than an answer), NaN/infinity and
    lists (one ground truth per row) are bad rows."""
    if value is None or isinstance(value, str | bytes | _Unreadable):
        answer = _text(value, "answer").strip()
        if not answer:
            raise _BadRow("empty answer")
        return answer
    if isinstance(value, bool) or not isinstance(value, numbers.Real | decimal.Decimal):
        raise _BadRow("answer is not text or a number", type(value).__name__)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, decimal.Decimal):
        if not value.is_finite():
            raise _BadRow("answer is not finite", str(value))
        return str(value)
    number = float(value)
    if not math.isfinite(number):
        raise _BadRow("answer is not finite", str(number))
    return str(int(number)) if number.is_integer() and abs(number) < 2**53 else repr(number)


def _check_text(text: str, num_images: int, prompting: _Prompting) -> None:
    """The prompt text against what vLLM and the chat template need: no special tokens written as text (they
    would end the user turn early or add vision tokens vLLM has no image for), one `<image>` per image, no
    more images than the rollout engine takes (vLLM rejects the request: the whole generate call fails)."""
    found = prompting.special_tokens.search(text) if prompting.special_tokens else None
    if found:
        raise _BadRow("text contains a special token", repr(found.group()))
    num_markers = text.count(IMAGE_MARKER)
    if num_markers != num_images:
        raise _BadRow(
            f"{IMAGE_MARKER} markers do not match images", f"{num_markers} markers, {num_images} images"
        )
    if prompting.limit_images is not None and num_images > prompting.limit_images:
        raise _BadRow(
            "more images than worker.rollout.limit_images", f"{num_images} > {prompting.limit_images}"
        )


def _check_row(values: dict, source: _Rows, prompting: _Prompting) -> tuple[str, str, array, int]:
    """(problem, answer, token ids, tokens after image expansion) of a good row; `_BadRow` names a bad one.
    Each image is decoded to check it, and dropped."""
    problem = _text(values["problem"], "problem")
    if not problem.strip():
        raise _BadRow("empty problem")
    answer = _answer(values["answer"])
    if isinstance(values["images"], _Unreadable):
        raise values["images"].reason
    images = _image_list(values["images"])
    template, cfg, factor = prompting.template, prompting.cfg, prompting.factor
    text = template.render(content=problem) if template is not None else problem
    _check_text(text, len(images), prompting)
    expansion = 0
    for image in images:
        width, height = _processor_size(
            _resized_size(_decode_image(image, source.base_dir), cfg), cfg, factor
        )
        expansion += (height // factor) * (width // factor) - 1
    prompt = prompting.processor.apply_chat_template(
        _messages(text, cfg), add_generation_prompt=True, tokenize=False
    )
    ids = prompting.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if ids.count(prompting.image_pad_id) != len(images):  # a chat template adding its own vision tokens
        raise _BadRow("prompt has more image tokens than images")
    return problem, answer, array("i", ids), len(ids) + expansion


def _read_guarded(source: _Rows, start: int, stop: int) -> Iterator[tuple[int, dict] | str]:
    """`source.read(start, stop)`; where reading fails on the file's content (corrupt page, bad footer), the
    failure's text is yielded last. An operating-system I/O error (it has an errno) is raised."""
    try:
        yield from source.read(start, stop)
    except Exception as e:
        if isinstance(e, OSError) and e.errno is not None:
            raise
        yield f"{type(e).__name__}: {e}"


def _check_share(sources: list[_Rows], prompting: _Prompting, rank: int, world_size: int) -> list:
    """`_Kept` / `_Bad` for this rank's contiguous share of all rows, in row order, and a `_BadFile` (with
    none of the file's rows) for a file that failed while being read."""
    total = sum(s.num_rows for s in sources)
    start, stop = total * rank // world_size, total * (rank + 1) // world_size
    results: list[_Kept | _Bad | _BadFile] = []
    for k, source in enumerate(sources):
        lo, hi = max(start - source.index_offset, 0), min(stop - source.index_offset, source.num_rows)
        first = len(results)
        for item in _read_guarded(source, lo, hi) if lo < hi else ():
            if isinstance(item, str):
                del results[first:]
                results.append(_BadFile(k, item))
                break
            row, values = item
            try:
                problem, answer, ids, length = _check_row(values, source, prompting)
            except _BadRow as reason:
                results.append(_Bad(k, row, str(reason)))
                continue
            data_source = values["data_source"]
            data_source = data_source if isinstance(data_source, str) else _label(data_source)
            results.append(_Kept(k, row, problem, answer, data_source, ids, length))
    return results


def _label(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return "" if isinstance(value, _Unreadable) else str(value)


def load_dataset(
    cfg: DataConfig,
    processor,
    split: str = "train",
    *,
    rank: int = 0,
    world_size: int = 1,
    all_gather: AllGather = _single_process,
    limit_images: int | None = None,
) -> list[Example]:
    """Read `cfg.train_files` (split "train") or `cfg.val_files` (split "val") into tokenized Examples.

    Each rank checks its contiguous share of the rows; `all_gather` (every rank's object in rank order; under
    torchrun `distributed.all_gather_objects`, called once by every rank) gives every rank the same Examples.
    `limit_images` (worker.rollout.limit_images): rows with more images are skipped.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    source = cfg.train_files if split == "train" else cfg.val_files
    if not source:
        raise ValueError(f"no data source for split {split!r} (data.{split}_files is not set)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    if world_size > 1 and all_gather is _single_process:
        raise ValueError(f"world_size={world_size} needs an all_gather (distributed.all_gather_objects)")
    try:
        sources, unreadable = _open_sources(source, cfg, split)
        prompting = _Prompting.for_load(cfg, processor, limit_images, log=rank == 0)
        layout = [(s.name, s.num_rows) for s in sources]
        mine: tuple[str, Any, Any] = ("ok", layout, _check_share(sources, prompting, rank, world_size))
    except Exception as e:  # sent to every rank, so none waits in the all-gather for this one
        error, mine = e, ("error", f"{type(e).__name__}: {e}", None)
    parts = all_gather(mine)
    if len(parts) != world_size:
        raise ValueError(f"all_gather returned {len(parts)} parts for a world of size {world_size}")
    if mine[0] == "error":
        raise error
    failed = [(r, what) for r, (status, what, _) in enumerate(parts) if status == "error"]
    if failed:
        r, what = failed[0]
        raise ValueError(f"reading {source} failed on rank {r}: {what}")
    if any(what != layout for _, what, _ in parts):  # a file readable on some ranks only
        raise ValueError(f"the ranks opened different files of {source}: {[what for _, what, _ in parts]}")
    results = [result for _, _, part in parts for result in part]
    examples = _examples(sources, unreadable, results, cfg, log=rank == 0, name=source)
    kept = _drop_too_long(examples, source, cfg, log=rank == 0)
    if not kept:
        raise ValueError(
            f"no usable examples in {source} (data.max_prompt_length={cfg.max_prompt_length}): "
            f"{_bad_row_counts(results) or 'every prompt is too long'}"
        )
    if rank == 0:
        logger.info("loaded %d %s examples from %s", len(kept), split, source)
    return kept


def _examples(
    sources: list[_Rows],
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
    failed = {r.source: r.reason for r in results if isinstance(r, _BadFile)}
    bad_files = unreadable + [(sources[k].name, why) for k, why in failed.items()]
    if len(failed) == len(sources):
        named = "; ".join(f"{name}: {why}" for name, why in bad_files[:MAX_NAMED_PER_REASON])
        raise ValueError(f"no readable file among {len(bad_files)}: {named}")
    if log:
        _log_skipped_files(bad_files, len(sources) + len(unreadable))
    results = [r for r in results if r.source not in failed]
    bad = [r for r in results if isinstance(r, _Bad)]
    if log:
        num_rows = sum(s.num_rows for k, s in enumerate(sources) if k not in failed)
        _log_bad_rows(sources, bad, num_rows, name)
    for k, source in enumerate(sources):
        _check_bad_fraction(source, [r for r in bad if r.source == k], cfg)
    _warn_large_row_groups(sources, log=log)
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
        if isinstance(r, _Kept)
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
    counts = Counter(_reason_kind(r.reason) for r in results if isinstance(r, _Bad))
    files = sum(isinstance(r, _BadFile) for r in results)
    text = ", ".join(f"{kind}: {n}" for kind, n in counts.most_common())
    return (f"{counts.total()} bad rows ({text})" if counts else "") + (
        f"{'; ' if counts else ''}{files} unreadable files" if files else ""
    )


def _log_bad_rows(sources: list[_Rows], bad: list[_Bad], num_rows: int, name: str) -> None:
    """One line per bad row, naming its file, row and reason, for the first `MAX_NAMED_PER_REASON` rows of
    each reason; then one line with the counts by reason."""
    if not bad:
        return
    named: Counter[str] = Counter()
    for r in bad:
        kind = _reason_kind(r.reason)
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


def _check_bad_fraction(source: _Rows, bad: list[_Bad], cfg: DataConfig) -> None:
    if len(bad) > cfg.max_bad_fraction * source.num_rows:
        first = "; ".join(f"row {r.row} {r.reason}" for r in bad[:MAX_NAMED_PER_REASON])
        raise ValueError(
            f"{source.name}: {len(bad)} of {source.num_rows} rows are bad, more than data.max_bad_fraction="
            f"{cfg.max_bad_fraction}; first reasons: {first}"
        )


def _warn_large_row_groups(sources: list[_Rows], *, log: bool) -> None:
    """Reading a row's images reads its whole row group's image column: say so where that is large."""
    large = [s for s in sources if getattr(s, "largest_image_chunk", 0) > LARGE_ROW_GROUP_BYTES]
    if log and large:
        logger.warning(
            "%d parquet file(s) have row groups with more than %d MiB of images (%s: %d MiB); every image read "
            "reads its whole row group's image column: rewrite them with smaller row groups "
            "(pyarrow.parquet.write_table(..., row_group_size=100))",
            len(large),
            LARGE_ROW_GROUP_BYTES >> 20,
            large[0].name,
            large[0].largest_image_chunk >> 20,
        )


def _drop_too_long(examples: list[Example], source: str, cfg: DataConfig, *, log: bool) -> list[Example]:
    """The examples within data.max_prompt_length after image expansion, in order; one log line names the
    others."""
    kept, too_long = [], []
    for example in examples:
        if example.num_prompt_tokens > cfg.max_prompt_length:
            too_long.append(example.index)
        else:
            kept.append(example)
    if too_long and log:
        logger.warning(
            "filtered %d of %d prompts from %s longer than data.max_prompt_length=%d after image expansion "
            "(rows %s%s)",
            len(too_long),
            len(examples),
            source,
            cfg.max_prompt_length,
            ", ".join(map(str, too_long[:5])),
            ", ..." if len(too_long) > 5 else "",
        )
    return kept
