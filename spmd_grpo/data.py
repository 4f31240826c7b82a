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
checks every row, decoding each image to do so and dropping the pixels right after. Bad rows (undecodable image,
missing/empty problem or answer, `<image>` count != image count, vision special tokens in the text, an aspect
ratio smart_resize refuses) are skipped, with one summary log line per file naming each by its row number inside
the file; more than `max_bad_fraction` of a file is an error. Prompts longer than `max_prompt_length` after
image expansion are dropped, never truncated (truncation would split an image's pad tokens). The per-row
results (kept rows with their text, answer and token ids; bad rows with their reasons) are all-gathered with the
`all_gather` the caller passes (`distributed.all_gather_objects` under torchrun), so every rank holds the same
Examples and raises the same errors; only rank 0 logs. A rank that cannot read its range (an I/O error) sends
its error through the same all-gather, and every rank raises it rather than waiting for it.

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

import io
import logging
import re
from array import array
from bisect import bisect_right
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
        by qwen_vl_utils.smart_resize (factor 28) into [min_pixels, max_pixels]."""
        return self.source.images(self.row)


# ------------------------------------------------------------------------------------------ images
class _BadRow(Exception):
    """A row that is skipped; the message is the reason written in the summary log line."""


def _image_list(images: Any) -> list:
    """A row's image cell as a list of image entries (None: no images; a single entry: one image)."""
    if images is None:
        return []
    if isinstance(images, Image.Image | bytes | dict):
        return [images]
    return list(images)


def _decode_image(image: Any, base_dir: Path | None) -> Image.Image:
    try:
        if isinstance(image, Image.Image):
            decoded = image
        else:
            data, path = image, None
            if isinstance(image, dict):
                data, path = image.get("bytes"), image.get("path")
            if isinstance(data, bytes | bytearray):
                decoded = Image.open(io.BytesIO(data))
            elif isinstance(data or path, str):
                file = Path(data or path)
                if not file.is_absolute() and base_dir is not None and not file.exists():
                    file = base_dir / file
                decoded = Image.open(file)
            else:
                raise _BadRow(f"undecodable image (no bytes or path in a {type(image).__name__})")
        decoded.load()
        return decoded.convert("RGB")
    except _BadRow:
        raise
    except Exception as e:
        raise _BadRow(f"undecodable image ({_BYTESIO_REPR.sub('', str(e)) or type(e).__name__})") from e


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
        raise _BadRow(f"image cannot be resized ({e})") from e
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
    columns = {k: batch.column(k).to_pylist() for k in wanted if k in names}
    for i in range(batch.num_rows):
        yield first_row + i, _normalise({k: v[i] for k, v in columns.items()}, data_source, keys)


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


def _open_sources(source: str, cfg: DataConfig, split: str) -> list[_Rows]:
    """The rows of `source`, opened (parquet: footers only; hub: memory-mapped; builtin: generated)."""
    seed = cfg.seed if split == "train" else cfg.seed + 1  # builtin validation rows differ from training rows
    if source.startswith("builtin:"):
        task = source.removeprefix("builtin:")
        makers = {"color": color_task_examples, "geo3k": synthetic_geo3k_rows}
        assert set(makers) == set(BUILTIN_DATASETS), "config.BUILTIN_DATASETS lists other tasks"
        if task not in makers:
            raise ValueError(
                f"unknown builtin dataset {source!r}; available: {sorted('builtin:' + k for k in makers)}"
            )
        return [_MemoryRows(source, makers[task](cfg.num_builtin_examples, seed), task, cfg)]
    path = Path(source).expanduser()
    if path.is_dir() or path.is_file():
        files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
        if not files:
            raise ValueError(f"no *.parquet files in directory {source}")
        out, cache = [], _RowGroupCache()
        for file in files:
            out.append(_ParquetRows(file, cfg, cache, sum(s.num_rows for s in out)))
        return out
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
        return [_HubRows(source, dataset, name, cfg)]
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


@dataclass(frozen=True)
class _Prompting:
    """What turns a row into a checked, tokenized prompt, the same for every row of one `load_dataset` call."""

    cfg: DataConfig
    processor: Any
    tokenizer: Any
    template: Any  # jinja2.Template of data.format_prompt, or None
    image_pad_id: int
    factor: int  # pixels per image-token side of the processor's resize

    @classmethod
    def for_load(cls, cfg: DataConfig, processor, *, log: bool) -> _Prompting:
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
        return cls(cfg, processor, tokenizer, _load_template(cfg), image_pad_id, factor)


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


def _check_row(values: dict, source: _Rows, prompting: _Prompting) -> tuple[str, str, array, int]:
    """(problem, answer, token ids, tokens after image expansion) of a good row; `_BadRow` names a bad one.
    Each image is decoded to check it, and dropped."""
    problem, answer, images = values["problem"], values["answer"], _image_list(values["images"])
    if not isinstance(problem, str) or not problem.strip():
        raise _BadRow("empty problem" if isinstance(problem, str) else "missing problem")
    if answer is None:
        raise _BadRow("missing answer")
    answer = str(answer).strip()
    if not answer:
        raise _BadRow("empty answer")
    template, cfg, factor = prompting.template, prompting.cfg, prompting.factor
    text = template.render(content=problem) if template is not None else problem
    num_markers = text.count(IMAGE_MARKER)
    if num_markers != len(images):
        raise _BadRow(f"{num_markers} {IMAGE_MARKER} markers but {len(images)} images")
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
    if ids.count(prompting.image_pad_id) != len(images):
        raise _BadRow("text contains vision special tokens")
    return problem, answer, array("i", ids), len(ids) + expansion


def _check_share(sources: list[_Rows], prompting: _Prompting, rank: int, world_size: int) -> list:
    """`_Kept` / `_Bad` for this rank's contiguous share of all rows, in row order."""
    total = sum(s.num_rows for s in sources)
    start, stop = total * rank // world_size, total * (rank + 1) // world_size
    results: list[_Kept | _Bad] = []
    for k, source in enumerate(sources):
        lo, hi = max(start - source.index_offset, 0), min(stop - source.index_offset, source.num_rows)
        for row, values in source.read(lo, hi) if lo < hi else ():
            try:
                problem, answer, ids, length = _check_row(values, source, prompting)
            except _BadRow as reason:
                results.append(_Bad(k, row, str(reason)))
                continue
            results.append(_Kept(k, row, problem, answer, str(values["data_source"]), ids, length))
    return results


def load_dataset(
    cfg: DataConfig,
    processor,
    split: str = "train",
    *,
    rank: int = 0,
    world_size: int = 1,
    all_gather: AllGather = _single_process,
) -> list[Example]:
    """Read `cfg.train_files` (split "train") or `cfg.val_files` (split "val") into tokenized Examples.

    Each rank checks its contiguous share of the rows; `all_gather` (every rank's object in rank order; under
    torchrun `distributed.all_gather_objects`, called once by every rank) gives every rank the same Examples.
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
        sources = _open_sources(source, cfg, split)
        results = _check_share(sources, _Prompting.for_load(cfg, processor, log=rank == 0), rank, world_size)
        mine: tuple[str, Any] = ("ok", results)
    except Exception as e:  # sent to every rank, so none waits in the all-gather for this one
        error, mine = e, ("error", f"{type(e).__name__}: {e}")
    parts = all_gather(mine)
    if len(parts) != world_size:
        raise ValueError(f"all_gather returned {len(parts)} parts for a world of size {world_size}")
    if mine[0] == "error":
        raise error
    failed = [(r, what) for r, (status, what) in enumerate(parts) if status == "error"]
    if failed:
        r, what = failed[0]
        raise ValueError(f"reading {source} failed on rank {r}: {what}")
    examples = _examples(sources, [result for _, part in parts for result in part], cfg, log=rank == 0)
    kept = _drop_too_long(examples, source, cfg, log=rank == 0)
    if not kept:
        raise ValueError(f"no usable examples in {source} (data.max_prompt_length={cfg.max_prompt_length})")
    if rank == 0:
        logger.info("loaded %d %s examples from %s", len(kept), split, source)
    return kept


def _examples(sources: list[_Rows], results: list, cfg: DataConfig, *, log: bool) -> list[Example]:
    """Every rank's check results (all rows, in order) -> the Examples; each source's bad rows are skipped
    with one summary log line, or are an error when they are more than data.max_bad_fraction of its rows."""
    bad: list[list[tuple[int, str]]] = [[] for _ in sources]
    examples = []
    for result in results:
        source = sources[result.source]
        if isinstance(result, _Bad):
            bad[result.source].append((result.row, result.reason))
            continue
        examples.append(
            Example(
                index=source.index_offset + result.row,
                problem=result.problem,
                answer=result.answer,
                source=source,
                row=result.row,
                data_source=result.data_source,
                num_prompt_tokens=result.num_prompt_tokens,
                token_ids=result.token_ids,
            )
        )
    for source, source_bad in zip(sources, bad, strict=True):
        _check_bad_rows(source, source_bad, cfg, log=log)
    _warn_large_row_groups(sources, log=log)
    return examples


def _check_bad_rows(source: _Rows, bad: list[tuple[int, str]], cfg: DataConfig, *, log: bool) -> None:
    if not bad:
        return
    if log:
        reasons = "; ".join(f"row {i} {why}" for i, why in bad)
        logger.warning("skipped %d of %d rows in %s: %s", len(bad), source.num_rows, source.name, reasons)
    if len(bad) > cfg.max_bad_fraction * source.num_rows:
        first = "; ".join(f"row {i} {why}" for i, why in bad[:5])
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
