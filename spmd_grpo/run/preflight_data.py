"""Preflight of the data section, before any process group or model: the sources exist (a parquet file, a
directory holding parquet files, `builtin:<task>`, or a hub id), their parquet footers are readable and hold
the prompt and answer columns in types the rows can be read from, the training set holds one rollout batch
and the validation set is not empty, and the prompt template (`data.format_prompt`) parses, uses `content`
and renders a problem. Rows themselves are checked at load (data/row_checks.py). Each failure is a
`ConfigError` naming the key.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from spmd_grpo.config.checks import ConfigError, require
from spmd_grpo.config.schema import Config, DataConfig


def check_data(cfg: Config) -> None:
    """Every data check of this module, cheapest first."""
    d = cfg.data
    check_data_source("data.train_files", d.train_files)
    if d.val_files is not None:
        check_data_source("data.val_files", d.val_files)
    check_format_prompt("data.format_prompt", d.format_prompt)
    check_data_size(cfg)
    check_columns("data.train_files", d.train_files, d)
    if d.val_files is not None:
        check_columns("data.val_files", d.val_files, d)


def check_format_prompt(key: str, value: str | None) -> None:
    """The prompt template: an existing UTF-8 jinja file that parses, uses `content` (the row's problem) and
    renders a problem. Otherwise the load failed on every rank naming no file (a syntax error, a filter
    that fails on text), or, for a template without `content`, every prompt lost its problem and each row was
    skipped for `<image>` markers that no longer matched its images."""
    if value is None:
        return
    path = Path(value).expanduser()
    require(path.is_file(), f"{key} must be an existing jinja file, got {value!r}: no such file")
    import jinja2
    import jinja2.meta

    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{key}: {value} is not UTF-8 text (byte {e.start})") from None
    try:
        parsed = jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"{key}: {value} line {e.lineno}: {e.message}") from None
    require(
        "content" in jinja2.meta.find_undeclared_variables(parsed),
        f"{key}: {value} never uses {{{{ content }}}} (the row's problem, with its <image> markers): "
        "every prompt would be the template alone",
    )
    try:  # the loader's own construction (data.prompts), on a problem of the geometry3k schema
        jinja2.Template(text).render(content="<image>Find x. Choices: A. 1 B. 2")
    except Exception as e:
        raise ConfigError(f"{key}: {value}: rendering a problem raised {type(e).__name__}: {e}") from None


def check_data_size(cfg: Config) -> None:
    """The training set (counted from parquet footers, or the builtin size) holds one rollout batch, and the
    validation set is readable and not empty (it was read only after the process group had formed, and an
    empty one stopped the job with a message giving no reason); a hub data set is counted when it loads."""
    d = cfg.data
    try:
        rows = count_rows(d.train_files, d.num_builtin_examples)
    except ConfigError as e:
        raise ConfigError(f"data.train_files: {e}") from None
    require(
        rows is None or rows >= d.rollout_batch_size,
        f"data.rollout_batch_size ({d.rollout_batch_size}) must be <= the rows of data.train_files "
        f"({rows} in {d.train_files})",
    )
    if d.val_files is None:
        return
    try:
        val_rows = count_rows(d.val_files, d.num_builtin_examples)
    except ConfigError as e:
        raise ConfigError(f"data.val_files: {e}") from None
    require(
        val_rows != 0,
        f"data.val_files: {d.val_files} holds no rows; set data.val_files=null to train without validation",
    )


def looks_like_hub_id(value: str) -> bool:
    """`owner/name[@split]` that cannot be a local path: no leading `/`, `.` or `~`, and `owner` is not a
    directory here (`models/qwen` with a `models/` directory is a missing local path, not a hub id)."""
    from spmd_grpo.data.sources import HUB_ID

    if not HUB_ID.match(value) or value[0] in "/.~":
        return False
    return not Path(value.split("/")[0]).is_dir()


OTHER_FORMATS = (".json", ".jsonl", ".csv", ".tsv", ".arrow", ".txt")
"""Data files other trainers read (EasyR1 reads JSON lines through `datasets`); here only parquet is."""
ONLY_PARQUET = (
    "only parquet is read; convert it, e.g. pandas.read_json(FILE, lines=True).to_parquet(OUT), keeping "
    "images as {bytes, path} structs"
)


SAMPLE_ROWS = 64
"""Rows whose problems `check_media_columns` reads from a file without an image or video column."""


def check_data_source(key: str, source: str) -> None:
    """A parquet file, a directory holding *.parquet, `builtin:<task>` (checked by the section), a hub id."""
    if source.startswith("builtin:"):
        return
    path = Path(source).expanduser()
    if path.is_file():
        return
    if path.is_dir():
        others = sorted({f.suffix for f in path.iterdir() if f.suffix in OTHER_FORMATS})
        require(
            any(path.glob("*.parquet")),
            f"{key}: directory {source!r} holds no *.parquet file"
            + (f" (it holds {', '.join('*' + s for s in others)} files: {ONLY_PARQUET})" if others else ""),
        )
        return
    # `data/train.parquet` has a hub id's shape, but a missing file is what it names (as a hub id it was probed
    # for, or loaded from, the hub: a data set never meant).
    require(
        looks_like_hub_id(source) and not source.partition("@")[0].endswith(".parquet"),
        f"{key} must be a parquet file or directory, builtin:<task> or a hub id owner/name[@split], "
        f"got {source!r}: no such file or directory",
    )


def count_rows(source: str, num_builtin_examples: int) -> int | None:
    """Rows of a data source before any is read (parquet footers only); None for a hub data set."""
    if source.startswith("builtin:"):
        return num_builtin_examples
    path = Path(source).expanduser()
    if not (path.is_file() or path.is_dir()):
        return None
    import pyarrow.parquet as pq

    from spmd_grpo.data.sources import parquet_files

    files = parquet_files(path)
    rows, unreadable = 0, []
    for file in files:
        try:
            rows += pq.read_metadata(file).num_rows
        except Exception as e:  # pyarrow raises several types for a file that is not parquet
            if file.suffix in OTHER_FORMATS:
                unreadable.append(f"{file} is a {file.suffix} file, not parquet: {ONLY_PARQUET}")
            else:
                unreadable.append(f"{file} is not a readable parquet file: {type(e).__name__}: {e}")
    # A bad file among good ones in a directory is skipped by the loader (named in its log), not fatal here.
    if unreadable and (path.is_file() or len(unreadable) == len(files)):
        raise ConfigError(unreadable[0])
    return rows


def _column_kinds() -> dict[str, tuple[str, Callable]]:
    """What each row key's column can hold: (what to call it, a test of its Arrow type)."""
    import pyarrow.types as pt

    def text(t) -> bool:
        views = (getattr(pt, "is_string_view", None), getattr(pt, "is_binary_view", None))
        return any(
            f(t) for f in (pt.is_string, pt.is_large_string, pt.is_binary, pt.is_large_binary, *views) if f
        )

    def answer(t) -> bool:
        return text(t) or pt.is_integer(t) or pt.is_floating(t) or pt.is_decimal(t)

    def media(t) -> bool:  # a list of entries, or one entry: {bytes, path}, encoded bytes, a path
        return pt.is_list(t) or pt.is_large_list(t) or pt.is_struct(t) or text(t)

    def unsure(test: Callable) -> Callable:  # all-null and dictionary columns: left to the row checks
        return lambda t: pt.is_null(t) or pt.is_dictionary(t) or test(t)

    return {
        "prompt_key": ("text", unsure(text)),
        "answer_key": ("text or numbers", unsure(answer)),
        "image_key": ("a list of images", unsure(media)),
        "video_key": ("a list of videos", unsure(media)),
    }


def check_columns(key: str, source: str, d: DataConfig) -> None:
    """The parquet files of a local source (footers only) hold the prompt and answer columns, and no row key
    names a column of a type none of its rows could be read from (a number column as data.prompt_key or
    data.image_key). The loader skips a file without the columns when another is readable, so that is an
    error here only when every file lacks them; a column of the wrong type makes every row of its file bad,
    which the loader refuses (data.max_bad_fraction < 1) only after it read and checked every row of the
    set, decoding each image. A hub data set's columns are checked when it loads."""
    path = Path(source).expanduser()
    if source.startswith("builtin:") or not (path.is_file() or path.is_dir()):
        return
    import pyarrow.parquet as pq

    from spmd_grpo.data.sources import parquet_files

    files = parquet_files(path)
    lacking, readable = [], 0
    for file in files:
        try:
            schema = pq.read_schema(file)
        except Exception:  # pyarrow raises several types; an unreadable file is count_rows' business
            continue
        readable += 1
        names = schema.names
        missing = [getattr(d, k) for k in ("prompt_key", "answer_key") if getattr(d, k) not in names]
        if missing:
            lacking.append(f"{file} has no column {missing[0]!r} (columns: {names})")
            continue
        if d.max_bad_fraction >= 1:
            continue
        for row_key, (what, holds) in _column_kinds().items():
            column = getattr(d, row_key)
            if column in names and not holds(schema.field(column).type):
                raise ConfigError(
                    f"{key}: {file}: column {column!r} (data.{row_key}) is {schema.field(column).type}, not "
                    f"{what}: every row of the file would be skipped; set data.{row_key}"
                )
        check_media_columns(key, file, d, names)
    if lacking and len(lacking) == readable:
        raise ConfigError(f"{key}: {lacking[0]}; set data.prompt_key / data.answer_key")


def check_media_columns(key: str, file: Path, d: DataConfig, names: list[str]) -> None:
    """A file without the data.image_key (data.video_key) column, more of whose first `SAMPLE_ROWS` problems
    than data.max_bad_fraction hold `<image>` (`<video>`) markers: the loader would skip those rows for
    markers without images, then refuse the file, naming the rows and not the column (a data set whose
    column is `image`, not `images`). Reads only the prompt column of those rows."""
    wanted = [
        (k, m) for k, m in (("image_key", "<image>"), ("video_key", "<video>")) if getattr(d, k) not in names
    ]
    if not wanted:
        return
    import pyarrow.parquet as pq

    try:
        with pq.ParquetFile(file) as f:
            batch = next(f.iter_batches(batch_size=SAMPLE_ROWS, columns=[d.prompt_key]), None)
        problems = [p for p in batch.column(0).to_pylist() if isinstance(p, str)] if batch is not None else []
    except Exception:  # unreadable values are the row checks' business
        return
    for row_key, marker in wanted:
        marked = sum(marker in p for p in problems)
        require(
            not problems or marked <= d.max_bad_fraction * len(problems),
            f"{key}: {file} has no column {getattr(d, row_key)!r} (data.{row_key}; columns: {names}), but "
            f"{marked} of its first {len(problems)} problems hold {marker} markers; set data.{row_key}",
        )
