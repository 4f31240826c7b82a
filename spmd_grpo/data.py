"""Data: prompt datasets (geometry3k schema) -> tokenized `Example`s, and per-rank prompt sampling.

Sources (`data.train_files` / `data.val_files`):
  * `builtin:color`  a synthetic, learnable task: a 56x56 solid colour, answer one digit (red/green/blue/yellow
                     -> 0/1/2/3). Tiny prompts (4 image tokens) for CPU tests and smoke runs.
  * `builtin:geo3k`  synthetic rows in the geometry3k schema (drawn diagram, numeric answer), no file needed.
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

`PromptSampler` gives each rank its contiguous share of every global batch of `rollout_batch_size` prompts
(all samples of a prompt stay on its rank, so GRPO groups are rank-local). Each epoch is a permutation of the
dataset; the incomplete tail of an epoch is dropped (drop_last) so every step has a full global batch.
"""

from __future__ import annotations

import argparse
import io
import logging
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageDraw

from spmd_grpo.config import DataConfig

logger = logging.getLogger(__name__)

IMAGE_MARKER = "<image>"
IMAGE_FACTOR = 28  # Qwen2.5-VL: patch 14 x spatial merge 2; one image token per 28x28 pixels
COLOR_PROBLEM = "<image>Which color is this? Answer with one digit."
COLORS = {"0": (255, 0, 0), "1": (0, 255, 0), "2": (0, 0, 255), "3": (255, 255, 0)}  # red green blue yellow
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


# ------------------------------------------------------------------------------------------ synthetic data
def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def color_task_examples(n: int, seed: int) -> list[dict]:
    """`n` geometry3k-schema rows of the builtin colour task; colours get a small deterministic jitter."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        answer = rng.choice(sorted(COLORS))
        rgb = tuple(min(255, max(0, c + rng.randint(-20, 20))) for c in COLORS[answer])
        image = Image.new("RGB", (56, 56), rgb)
        rows.append(
            {"problem": COLOR_PROBLEM, "answer": answer, "images": [{"bytes": _png(image), "path": None}]}
        )
    return rows


def _diagram(points: list[tuple[float, float]], labels: list[tuple[tuple[float, float], str]]) -> bytes:
    image = Image.new("RGB", (224, 168), "white")
    draw = ImageDraw.Draw(image)
    draw.polygon(points, outline="black", width=2)
    for xy, text in labels:
        draw.text(xy, text, fill="black")
    return _png(image)


def synthetic_geo3k_rows(n: int, seed: int) -> list[dict]:
    """`n` geometry3k-schema rows: a drawn diagram, a "Find x." question, a numeric answer string."""
    rng = random.Random(seed)
    triples = [(3, 4, 5), (5, 12, 13), (6, 8, 10), (8, 15, 17), (9, 12, 15), (7, 24, 25)]
    rows = []
    for _ in range(n):
        kind = rng.randrange(3)
        if kind == 0:  # right triangle, hypotenuse
            a, b, c = rng.choice(triples)
            problem = f"<image>Find x. The right triangle has legs {a} and {b}; x is the hypotenuse."
            answer = str(c)
            image = _diagram(
                [(30, 140), (190, 140), (30, 30)],
                [((100, 145), str(b)), ((10, 80), str(a)), ((115, 75), "x")],
            )
        elif kind == 1:  # triangle angle sum
            a, b = rng.randint(20, 80), rng.randint(20, 80)
            problem = f"<image>Find x. Two angles of the triangle measure {a} and {b} degrees."
            answer = str(180 - a - b)
            image = _diagram(
                [(20, 140), (200, 140), (90, 25)],
                [((30, 120), f"{a}°"), ((170, 120), f"{b}°"), ((85, 40), "x")],
            )
        else:  # rectangle perimeter
            w, h = rng.randint(2, 20), rng.randint(2, 20)
            problem = f"<image>Find x, the perimeter of the rectangle with sides {w} and {h}."
            answer = str(2 * (w + h))
            image = _diagram(
                [(30, 30), (190, 30), (190, 130), (30, 130)], [((105, 135), str(w)), ((195, 75), str(h))]
            )
        rows.append({"problem": problem, "answer": answer, "images": [{"bytes": image, "path": None}]})
    return rows


def write_parquet(rows: list[dict], path: str | Path) -> Path:
    """Write rows in the geometry3k schema; an image may be a PIL image, PNG/JPEG bytes, or {bytes, path}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def image_struct(image: Any) -> dict:
        if isinstance(image, Image.Image):
            return {"bytes": _png(image), "path": None}
        if isinstance(image, bytes | bytearray):
            return {"bytes": bytes(image), "path": None}
        if isinstance(image, dict):
            return {"bytes": image.get("bytes"), "path": image.get("path")}
        raise TypeError(f"cannot write image of type {type(image).__name__}")

    image_type = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    schema = pa.schema([("problem", pa.string()), ("answer", pa.string()), ("images", image_type)])
    table = pa.table(
        {
            "problem": [row.get("problem") for row in rows],
            "answer": [row.get("answer") for row in rows],
            "images": [[image_struct(im) for im in row.get("images") or []] for row in rows],
        },
        schema=schema,
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


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


def load_dataset(cfg: DataConfig, processor, split: str = "train") -> list[Example]:
    """Read `cfg.train_files` (split "train") or `cfg.val_files` (split "val") into tokenized Examples."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    source = cfg.train_files if split == "train" else cfg.val_files
    if not source:
        raise ValueError(f"no data source for split {split!r} (data.{split}_files is not set)")
    tokenizer = getattr(processor, "tokenizer", processor)
    image_pad_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    proc_min, proc_max, factor = _image_processor_bounds(processor)
    if (proc_min and cfg.min_pixels < proc_min) or (proc_max and cfg.max_pixels > proc_max):
        logger.warning(
            "data.min_pixels/max_pixels [%d, %d] exceed the processor's [%s, %s]: the processor will resize images "
            "again and num_prompt_tokens will not match its expansion",
            cfg.min_pixels,
            cfg.max_pixels,
            proc_min,
            proc_max,
        )
    template = _load_template(cfg)

    examples: list[Example] = []
    too_long: list[int] = []
    for raw in _read_sources(source, cfg, split):
        bad: list[tuple[int, str]] = []
        for row_number, row in enumerate(raw.rows):
            try:
                examples.append(
                    _example(row, raw, row_number, cfg, processor, tokenizer, template, image_pad_id, factor)
                )
            except _BadRow as reason:
                bad.append((row_number, str(reason)))
        if bad:
            reasons = "; ".join(f"row {i} {why}" for i, why in bad)
            logger.warning("skipped %d of %d rows in %s: %s", len(bad), len(raw.rows), raw.name, reasons)
            if len(bad) > cfg.max_bad_fraction * len(raw.rows):
                first = "; ".join(f"row {i} {why}" for i, why in bad[:5])
                raise ValueError(
                    f"{raw.name}: {len(bad)} of {len(raw.rows)} rows are bad, more than data.max_bad_fraction="
                    f"{cfg.max_bad_fraction}; first reasons: {first}"
                )
    kept = []
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
    if not kept:
        raise ValueError(f"no usable examples in {source} (data.max_prompt_length={cfg.max_prompt_length})")
    logger.info("loaded %d %s examples from %s", len(kept), split, source)
    return kept


def _example(
    row: dict, raw: _RawSource, row_number: int, cfg, processor, tokenizer, template, image_pad_id, factor
) -> Example:
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
    text = template.render(content=problem) if template is not None else problem
    num_markers = text.count(IMAGE_MARKER)
    if num_markers != len(images):
        raise _BadRow(f"{num_markers} {IMAGE_MARKER} markers but {len(images)} images")
    decoded = [_resize(_decode_image(image, raw.base_dir), cfg) for image in images]
    prompt = processor.apply_chat_template(_messages(text, cfg), add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if ids.count(image_pad_id) != len(decoded):
        raise _BadRow("text contains vision special tokens")
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


# ------------------------------------------------------------------------------------------ sampling
class PromptSampler:
    """Per-rank sharding of a global batch of prompts, epoch shuffling, exact resumable state.

    Epoch e is `torch.randperm(num_examples)` from a generator seeded with `seed + e` (identity without
    shuffle); step k of an epoch is the slice [k * global_batch_size, (k + 1) * global_batch_size). The tail
    (num_examples % global_batch_size prompts) is dropped each epoch, so every step has a full batch. Rank r
    gets global uids [r * per_rank, (r + 1) * per_rank) of each batch. Every rank holds the same state.
    """

    def __init__(
        self, num_examples: int, global_batch_size: int, rank: int, world_size: int, seed: int, shuffle: bool
    ):
        if global_batch_size <= 0 or world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(
                f"bad sampler sizes: global_batch_size={global_batch_size}, rank={rank}/{world_size}"
            )
        if global_batch_size % world_size:
            raise ValueError(
                f"global batch size {global_batch_size} is not divisible by world size {world_size}"
            )
        if global_batch_size > num_examples:
            raise ValueError(
                f"global batch size (data.rollout_batch_size) {global_batch_size} is larger than the dataset "
                f"({num_examples} examples)"
            )
        self.num_examples, self.global_batch_size = num_examples, global_batch_size
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.per_rank = global_batch_size // world_size
        self._epoch = 0
        self._position = 0  # batches already drawn from the current epoch
        self._order: tuple[int, list[int]] | None = None  # (epoch, permutation) cache

    @property
    def epoch(self) -> int:
        """Epoch of the most recently drawn batch (0 before the first)."""
        return self._epoch

    @property
    def steps_per_epoch(self) -> int:
        return self.num_examples // self.global_batch_size

    def _permutation(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(self.num_examples, generator=generator).tolist()
            else:
                order = list(range(self.num_examples))
            self._order = (epoch, order)
        return self._order[1]

    def next_batch(self) -> list[tuple[int, int]]:
        """This rank's (global_uid_in_step, example_position) pairs for the next step."""
        if self._position >= self.steps_per_epoch:  # drop the tail, start the next epoch
            self._epoch, self._position = self._epoch + 1, 0
        start = self._position * self.global_batch_size
        batch = self._permutation(self._epoch)[start : start + self.global_batch_size]
        self._position += 1
        uids = range(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)
        return [(uid, batch[uid]) for uid in uids]

    def state_dict(self) -> dict:
        return {
            "epoch": self._epoch,
            "position": self._position,
            "num_examples": self.num_examples,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, d: dict) -> None:
        for key in ("num_examples", "global_batch_size", "seed", "shuffle"):
            if d[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state was saved with {key}={d[key]} but this run has {key}={getattr(self, key)}; "
                    "resuming would change the prompt order"
                )
        self._epoch, self._position = int(d["epoch"]), int(d["position"])


# ------------------------------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m spmd_grpo.data", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("make-geo3k", help="write synthetic geometry3k-schema rows to a parquet file")
    make.add_argument("out", type=Path)
    make.add_argument("--rows", type=int, default=64)
    make.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.rows <= 0:
        parser.error("--rows must be positive")
    path = write_parquet(synthetic_geo3k_rows(args.rows, args.seed), args.out)
    print(f"wrote {args.rows} rows to {path}")


if __name__ == "__main__":
    main()
