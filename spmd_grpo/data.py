"""Data: prompt datasets (geometry3k schema) -> tokenized `Example`s.

Sources (`data.train_files` / `data.val_files`):
  * `builtin:color`  a synthetic, learnable task: a 56x56 solid colour, answer one digit (red/green/blue/yellow
                     -> 0/1/2/3). Tiny prompts (4 image tokens) for CPU tests and smoke runs.
  * `builtin:geo3k`  synthetic rows in the geometry3k schema (drawn diagram, numeric answer), no file needed.
                     Both are made by `spmd_grpo.tools.synthetic_data`, which also writes them to parquet.
  * a parquet file, or a directory of parquet files (read in sorted order), in the geometry3k schema
    (hiyouga/geometry3k): `problem` (string, with one `<image>` marker per image), `answer` (string),
    `images` (list<struct<bytes: binary, path: string>>). Column names come from prompt_key/answer_key/image_key;
    a missing image column means text-only rows. An optional `data_source` column is carried through.
  * `owner/name@split` from the Hugging Face hub via `datasets.load_dataset` (needs network or a local cache).

Every row becomes one `Example`: the problem's `<image>` markers become image content parts in order, the chat
template is applied with add_generation_prompt=True, and the prompt ids hold ONE `<|image_pad|>` per image (what
vLLM takes). `num_prompt_tokens` counts the prompt after image-token expansion (what the trainer sees), assuming
the trainer's processor uses the same min/max pixels (the images are already resized to that rule here, so the
processor's own resize is then the identity; a warning is logged when its bounds are narrower).

Bad rows (undecodable image, missing answer, `<image>` count != image count, empty problem) are skipped with one
summary log line per file; more than `max_bad_fraction` of a file is an error. Prompts longer than
`max_prompt_length` after image expansion are dropped, never truncated (truncation would split an image's pad
tokens). `Example.index` is the row's number in its source; for a directory the files are numbered as if
concatenated in sorted order (log lines name the row number inside each file).

Which examples each rank rolls out at each step is `spmd_grpo.sampler.PromptSampler`'s business.
"""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from spmd_grpo.config import DataConfig
from spmd_grpo.tools.synthetic_data import color_task_examples, synthetic_geo3k_rows

logger = logging.getLogger(__name__)

IMAGE_MARKER = "<image>"
IMAGE_FACTOR = 28  # Qwen2.5-VL: patch 14 x spatial merge 2; one image token per 28x28 pixels
_BYTESIO_REPR = re.compile(r" <_io\.BytesIO object at 0x[0-9a-fA-F]+>")
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+(@[\w.\[\]:%+-]+)?$")


@dataclass
class Example:
    index: int
    """Row number in the source (original numbering, before any row was skipped or filtered)."""
    problem: str
    """Raw problem text, with its `<image>` markers."""
    images: list[Image.Image]
    """RGB, resized by qwen_vl_utils.smart_resize (factor 28) into [min_pixels, max_pixels]."""
    answer: str
    prompt_token_ids: list[int]
    """Chat template applied (add_generation_prompt=True); one `<|image_pad|>` per image."""
    num_prompt_tokens: int
    """Prompt length after image-token expansion."""
    data_source: str


# ------------------------------------------------------------------------------------------ reading sources
@dataclass
class _RawSource:
    name: str  # for log lines and errors
    rows: list[dict]  # normalised: problem, answer, images, data_source
    index_offset: int
    base_dir: Path | None  # where relative image paths are resolved


def _normalise(rows: Iterable[dict], data_source: str, keys: tuple[str, str, str]) -> list[dict]:
    prompt_key, answer_key, image_key = keys
    return [
        {
            "problem": row.get(prompt_key),
            "answer": row.get(answer_key),
            "images": row.get(image_key),
            "data_source": row.get("data_source") or data_source,
        }
        for row in rows
    ]


def _read_parquet(path: Path, cfg: DataConfig) -> list[dict]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    for key in (cfg.prompt_key, cfg.answer_key):
        if key not in table.column_names:
            raise ValueError(
                f"{path}: no column {key!r} (columns: {table.column_names}); set data.prompt_key/answer_key"
            )
    keys = (cfg.prompt_key, cfg.answer_key, cfg.image_key)
    return _normalise(table.to_pylist(), path.stem, keys)


def _read_sources(source: str, cfg: DataConfig, split: str) -> list[_RawSource]:
    default_keys = ("problem", "answer", "images")
    seed = cfg.seed if split == "train" else cfg.seed + 1  # builtin validation rows differ from training rows
    if source.startswith("builtin:"):
        task = source.removeprefix("builtin:")
        makers = {"color": color_task_examples, "geo3k": synthetic_geo3k_rows}
        if task not in makers:
            raise ValueError(
                f"unknown builtin dataset {source!r}; available: {sorted('builtin:' + k for k in makers)}"
            )
        rows = makers[task](cfg.num_builtin_examples, seed)
        return [_RawSource(source, _normalise(rows, task, default_keys), 0, None)]
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(path.glob("*.parquet"))
        if not files:
            raise ValueError(f"no *.parquet files in directory {source}")
        out, offset = [], 0
        for file in files:
            rows = _read_parquet(file, cfg)
            out.append(_RawSource(str(file), rows, offset, file.parent))
            offset += len(rows)
        return out
    if path.is_file():
        return [_RawSource(str(path), _read_parquet(path, cfg), 0, path.parent)]
    if _HUB_ID.match(source):
        name, _, hub_split = source.partition("@")
        hub_split = hub_split or split
        try:
            import datasets

            ds = datasets.load_dataset(name, split=hub_split)
        except Exception as e:  # offline, unknown id, unknown split, ...: name what was asked for
            raise ValueError(
                f"cannot load Hugging Face dataset {name!r} split {hub_split!r} (from {source!r}): "
                f"{type(e).__name__}: {e}"
            ) from e
        for key in (cfg.prompt_key, cfg.answer_key):
            if key not in ds.column_names:
                raise ValueError(f"{source}: no column {key!r} (columns: {ds.column_names})")
        keys = (cfg.prompt_key, cfg.answer_key, cfg.image_key)
        return [_RawSource(source, _normalise(ds, name, keys), 0, None)]
    raise ValueError(
        f"data source {source!r} is not an existing parquet file or directory, a `builtin:` task, or a hub id "
        "`owner/name@split`"
    )


# ------------------------------------------------------------------------------------------ rows -> examples
class _BadRow(Exception):
    """A row that is skipped; the message is the reason written in the summary log line."""


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


def _resize(image: Image.Image, cfg: DataConfig) -> Image.Image:
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
    if (width, height) != image.size:
        image = image.resize((width, height), Image.Resampling.BICUBIC)
    return image


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
    """What turns a row into an `Example`, the same for every row of one `load_dataset` call."""

    cfg: DataConfig
    processor: Any
    tokenizer: Any
    template: Any  # jinja2.Template of data.format_prompt, or None
    image_pad_id: int
    factor: int  # pixels per image-token side of the processor's resize

    @classmethod
    def for_load(cls, cfg: DataConfig, processor) -> _Prompting:
        tokenizer = getattr(processor, "tokenizer", processor)
        image_pad_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        proc_min, proc_max, factor = _image_processor_bounds(processor)
        if (proc_min and cfg.min_pixels < proc_min) or (proc_max and cfg.max_pixels > proc_max):
            logger.warning(
                "data.min_pixels/max_pixels [%d, %d] exceed the processor's [%s, %s]: the processor will "
                "resize images again and num_prompt_tokens will not match its expansion",
                cfg.min_pixels,
                cfg.max_pixels,
                proc_min,
                proc_max,
            )
        return cls(cfg, processor, tokenizer, _load_template(cfg), image_pad_id, factor)


def load_dataset(cfg: DataConfig, processor, split: str = "train") -> list[Example]:
    """Read `cfg.train_files` (split "train") or `cfg.val_files` (split "val") into tokenized Examples."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    source = cfg.train_files if split == "train" else cfg.val_files
    if not source:
        raise ValueError(f"no data source for split {split!r} (data.{split}_files is not set)")
    prompting = _Prompting.for_load(cfg, processor)
    examples = [e for raw in _read_sources(source, cfg, split) for e in _source_examples(raw, prompting)]
    kept = _drop_too_long(examples, source, cfg)
    if not kept:
        raise ValueError(f"no usable examples in {source} (data.max_prompt_length={cfg.max_prompt_length})")
    logger.info("loaded %d %s examples from %s", len(kept), split, source)
    return kept


def _source_examples(raw: _RawSource, prompting: _Prompting) -> list[Example]:
    """The Examples of one source's rows; its bad rows are skipped with one summary log line, or are an error
    when they are more than data.max_bad_fraction of its rows."""
    examples: list[Example] = []
    bad: list[tuple[int, str]] = []
    for row_number, row in enumerate(raw.rows):
        try:
            examples.append(_example(row, raw, row_number, prompting))
        except _BadRow as reason:
            bad.append((row_number, str(reason)))
    if bad:
        cfg = prompting.cfg
        reasons = "; ".join(f"row {i} {why}" for i, why in bad)
        logger.warning("skipped %d of %d rows in %s: %s", len(bad), len(raw.rows), raw.name, reasons)
        if len(bad) > cfg.max_bad_fraction * len(raw.rows):
            first = "; ".join(f"row {i} {why}" for i, why in bad[:5])
            raise ValueError(
                f"{raw.name}: {len(bad)} of {len(raw.rows)} rows are bad, more than data.max_bad_fraction="
                f"{cfg.max_bad_fraction}; first reasons: {first}"
            )
    return examples


def _drop_too_long(examples: list[Example], source: str, cfg: DataConfig) -> list[Example]:
    """The examples within data.max_prompt_length after image expansion, in order; one log line names the
    others."""
    kept, too_long = [], []
    for example in examples:
        if example.num_prompt_tokens > cfg.max_prompt_length:
            too_long.append(example.index)
        else:
            kept.append(example)
    if too_long:
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


def _example(row: dict, raw: _RawSource, row_number: int, prompting: _Prompting) -> Example:
    problem, answer, images = row["problem"], row["answer"], row["images"]
    if not isinstance(problem, str) or not problem.strip():
        raise _BadRow("empty problem" if isinstance(problem, str) else "missing problem")
    if answer is None:
        raise _BadRow("missing answer")
    answer = str(answer).strip()
    if not answer:
        raise _BadRow("empty answer")
    if images is None:
        images = []
    elif isinstance(images, Image.Image | bytes | dict):
        images = [images]
    template, cfg = prompting.template, prompting.cfg
    text = template.render(content=problem) if template is not None else problem
    num_markers = text.count(IMAGE_MARKER)
    if num_markers != len(images):
        raise _BadRow(f"{num_markers} {IMAGE_MARKER} markers but {len(images)} images")
    decoded = [_resize(_decode_image(image, raw.base_dir), cfg) for image in images]
    prompt = prompting.processor.apply_chat_template(
        _messages(text, cfg), add_generation_prompt=True, tokenize=False
    )
    ids = prompting.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if ids.count(prompting.image_pad_id) != len(decoded):
        raise _BadRow("text contains vision special tokens")
    factor = prompting.factor
    expansion = sum((im.height // factor) * (im.width // factor) - 1 for im in decoded)
    return Example(
        index=raw.index_offset + row_number,
        problem=problem,
        images=decoded,
        answer=answer,
        prompt_token_ids=ids,
        num_prompt_tokens=len(ids) + expansion,
        data_source=str(row["data_source"]),
    )
