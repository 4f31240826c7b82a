"""Where rows come from: parquet files (or a directory of them), a hub data set, or generated `builtin:` rows.

A source reads rows [start, stop) in order, a row group and `ROW_BATCH` rows at a time, so memory stays flat
in the number of rows; images are decoded on demand (`Rows.images`), never held for the whole set. Files that
cannot be opened are skipped and named.
"""

from __future__ import annotations

import logging
import re
from bisect import bisect_right
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from PIL import Image

from spmd_grpo.config.checks import BUILTIN_DATASETS
from spmd_grpo.config.schema import DataConfig
from spmd_grpo.data.images import BadRow, decode_image, image_list, resize_image
from spmd_grpo.data.prompts import ProcessorSizes
from spmd_grpo.data.synthetic import color_task_examples, synthetic_geo3k_rows, video_color_task_examples
from spmd_grpo.data.videos import Video, decode_video, video_list

logger = logging.getLogger(__name__)


ROW_BATCH = 64  # rows converted to Python at a time while checking
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+(@[\w.\[\]:%+-]+)?$")
"""A hub data set's `owner/name`, optionally `@split`."""


MAX_NAMED_PER_REASON = 5  # skipped rows named in the log per reason (the rest are counted)


LARGE_ROW_GROUP_BYTES = 256 << 20  # an image column chunk above this is warned about (read whole per access)


# ------------------------------------------------------------------------------------------ sources
class Rows:
    """One source of rows: a parquet file, a hub data set, or generated rows.

    `read(start, stop)` yields `(row, values)` for rows [start, stop) in order, holding at most a row group
    plus `ROW_BATCH` rows at a time; `values` is the normalised row {problem, answer, images, data_source}.
    `raw_images(row)` is one row's image cell as stored. `images(row)` decodes and resizes it; `raw_videos`
    and `videos` likewise for the video cell (frames sampled and resized, `data.videos`).
    """

    name: str  # for log lines and errors
    num_rows: int
    index_offset: int  # Example.index of row 0
    base_dir: Path | None  # where relative image paths are resolved
    cfg: DataConfig
    sizes: ProcessorSizes | None = None  # the run's image resize and video sampling; load_dataset sets it

    def read(self, start: int, stop: int) -> Iterator[tuple[int, dict]]:
        raise NotImplementedError

    def raw_images(self, row: int) -> Any:
        raise NotImplementedError

    def raw_videos(self, row: int) -> Any:
        raise NotImplementedError

    def decode_images(self, cell: Any) -> list[Image.Image]:
        """An image cell's images, decoded and resized for this model."""
        return [
            resize_image(decode_image(im, self.base_dir), self.cfg, self.sizes.factor)
            for im in image_list(cell)
        ]

    def images(self, row: int) -> list[Image.Image]:
        try:
            return self.decode_images(self.raw_images(row))
        except BadRow as e:
            raise ValueError(f"{self.name} row {row}: {e}, though it passed the check at load") from e

    def videos(self, row: int) -> list[Video]:
        try:
            return [
                decode_video(v, self.base_dir, self.sizes.video) for v in video_list(self.raw_videos(row))
            ]
        except BadRow as e:
            raise ValueError(f"{self.name} row {row}: {e}, though it passed the check at load") from e


def _keys(cfg: DataConfig) -> tuple[str, str, str, str]:
    return cfg.prompt_key, cfg.answer_key, cfg.image_key, cfg.video_key


def _normalise(row: dict, data_source: str, keys: tuple[str, str, str, str]) -> dict:
    prompt_key, answer_key, image_key, video_key = keys
    return {
        "problem": row.get(prompt_key),
        "answer": row.get(answer_key),
        "images": row.get(image_key),
        "videos": row.get(video_key),
        "data_source": row.get("data_source") or data_source,
    }


def _arrow_rows(batch, first_row: int, data_source: str, keys: tuple[str, str, str, str]):
    """`(row, normalised values)` of an Arrow table or record batch whose first row is `first_row`."""
    names = batch.schema.names
    wanted = [*keys, "data_source"]
    columns = {k: _pylist(batch.column(k), k) for k in wanted if k in names}
    for i in range(batch.num_rows):
        yield first_row + i, _normalise({k: v[i] for k, v in columns.items()}, data_source, keys)


class Unreadable(NamedTuple):
    """A cell Arrow could not convert to Python (the row is bad, not its batch)."""

    reason: BadRow


def _pylist(column, name: str) -> list:
    """A column's values; a value that cannot be converted (invalid UTF-8 in a string column, which writers
    other than Arrow's may produce, fails `to_pylist` for the whole batch) becomes an `Unreadable`."""
    try:
        return column.to_pylist()
    except Exception:
        values: list = []
        for i in range(len(column)):
            try:
                values.append(column[i].as_py())
            except UnicodeDecodeError as e:
                values.append(Unreadable(BadRow(f"{name} is not UTF-8", f"byte {e.start}")))
            except Exception as e:
                values.append(Unreadable(BadRow(f"{name} unreadable", f"{type(e).__name__}: {e}")))
        return values


def _check_columns(name: str, columns: list[str], cfg: DataConfig) -> None:
    for key in (cfg.prompt_key, cfg.answer_key):
        if key not in columns:
            raise ValueError(
                f"{name}: no column {key!r} (columns: {columns}); set data.prompt_key/answer_key"
            )


class _MemoryRows(Rows):
    """Generated rows (`builtin:` tasks), kept in memory with their encoded images."""

    def __init__(self, name: str, rows: list[dict], data_source: str, cfg: DataConfig) -> None:
        keys = ("problem", "answer", "images", "videos")
        self.rows = [_normalise(row, data_source, keys) for row in rows]
        self.name, self.num_rows, self.index_offset, self.base_dir, self.cfg = name, len(rows), 0, None, cfg

    def read(self, start: int, stop: int) -> Iterator[tuple[int, dict]]:
        yield from enumerate(self.rows[start:stop], start)

    def raw_images(self, row: int) -> Any:
        return self.rows[row]["images"]

    def raw_videos(self, row: int) -> Any:
        return self.rows[row]["videos"]


class _RowGroupCache:
    """The image (and video) column of the most recently read parquet row group, shared by every file of one
    load: one row group per column."""

    def __init__(self) -> None:
        self.keys: dict[str, tuple[Path, int]] = {}
        self.columns: dict[str, Any] = {}  # column name -> pyarrow ChunkedArray

    def get(self, path: Path, group: int, key: str):
        if self.keys.get(key) != (path, group):
            import pyarrow.parquet as pq

            self.keys.pop(key, None)
            self.columns.pop(key, None)  # free the previous group before reading the next one
            with pq.ParquetFile(path) as f:
                self.columns[key] = f.read_row_group(group, columns=[key]).column(key)
            self.keys[key] = (path, group)
        return self.columns[key]


class _ParquetRows(Rows):
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

    def _cell(self, row: int, key: str) -> Any:
        if key not in self.columns:
            return None
        group = bisect_right(self.starts, row) - 1
        return self.cache.get(self.path, group, key)[row - self.starts[group]].as_py()

    def raw_images(self, row: int) -> Any:
        return self._cell(row, self.cfg.image_key)

    def raw_videos(self, row: int) -> Any:
        return self._cell(row, self.cfg.video_key)


def _image_chunk_bytes(group, image_key: str) -> Iterator[int]:
    """Uncompressed bytes of the image column's leaves in one row group's metadata."""
    for i in range(group.num_columns):
        column = group.column(i)
        if column.path_in_schema == image_key or column.path_in_schema.startswith(image_key + "."):
            yield column.total_uncompressed_size


class _HubRows(Rows):
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

    def _cell(self, row: int, key: str) -> Any:
        if key not in self.table.column_names:
            return None
        return self.table[row : row + 1].column(key)[0].as_py()

    def raw_images(self, row: int) -> Any:
        return self._cell(row, self.cfg.image_key)

    def raw_videos(self, row: int) -> Any:
        return self._cell(row, self.cfg.video_key)


def _open_parquet_files(files: list[Path], cfg: DataConfig) -> tuple[list[Rows], list[tuple[str, str]]]:
    """The files' rows (footers read) and the files that cannot be opened, with why (not parquet, empty,
    truncated, no problem/answer column). An OS-level I/O error is raised; so is every file failing."""
    opened: list[Rows] = []
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


def parquet_files(path: Path) -> list[Path]:
    """The parquet files of a local source: the file itself, or a directory's `*.parquet` in name order."""
    return sorted(path.glob("*.parquet")) if path.is_dir() else [path]


def open_sources(source: str, cfg: DataConfig, split: str) -> tuple[list[Rows], list[tuple[str, str]]]:
    """The rows of `source`, opened (parquet: footers only; hub: memory-mapped; builtin: generated), and the
    files of a directory that cannot be opened, with why."""
    seed = cfg.seed if split == "train" else cfg.seed + 1  # builtin validation rows differ from training rows
    if source.startswith("builtin:"):
        task = source.removeprefix("builtin:")
        makers = {
            "color": color_task_examples,
            "geo3k": synthetic_geo3k_rows,
            "video_color": video_color_task_examples,
        }
        assert set(makers) == set(BUILTIN_DATASETS), "config.checks.BUILTIN_DATASETS lists other tasks"
        if task not in makers:
            raise ValueError(
                f"unknown builtin dataset {source!r}; available: {sorted('builtin:' + k for k in makers)}"
            )
        return [_MemoryRows(source, makers[task](cfg.num_builtin_examples, seed), task, cfg)], []
    path = Path(source).expanduser()
    if path.is_dir() or path.is_file():
        files = parquet_files(path)
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


def warn_large_row_groups(sources: list[Rows], *, log: bool) -> None:
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
