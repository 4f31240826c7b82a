"""Synthetic prompt data in the geometry3k schema: no download, deterministic for a seed.

Rows are dicts `{"problem": str with one "<image>" marker, "answer": str,
"images": [{"bytes": PNG, "path": None}]}`, the schema `spmd_grpo.data.dataset.load_dataset` reads. Two tasks,
also readable as data sources without a file:
  * `builtin:color` (`color_task_examples`): a 56x56 solid colour, answer one digit (red/green/blue/yellow
    -> 0/1/2/3); learnable, with tiny prompts (4 image tokens) for CPU tests and smoke runs.
  * `builtin:geo3k` (`synthetic_geo3k_rows`): a drawn diagram and a "Find x." question with a numeric answer.
  * `builtin:video_color` (`video_color_task_examples`): a 2-second, 2-fps MPEG-4 video of 4 solid-colour
    56x56 frames in the `videos` column; answer the digit of the LAST frame's colour (the earlier frames are
    other colours drawn at random, so the answer needs the time axis).
`write_parquet` writes such rows (or any rows in the schema) to a parquet file in row groups of 256 rows; the
CLI `python -m spmd_grpo.tools.synthetic_data make-geo3k OUT.parquet [--rows N] [--seed S]` writes geo3k rows.
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

COLOR_PROBLEM = "<image>Which color is this? Answer with one digit."
COLORS = {"0": (255, 0, 0), "1": (0, 255, 0), "2": (0, 0, 255), "3": (255, 255, 0)}  # red green blue yellow


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


VIDEO_COLOR_PROBLEM = "<video>Which color is the last frame? Answer with one digit."
VIDEO_COLOR_FRAMES = 4


def video_color_task_examples(n: int, seed: int) -> list[dict]:
    """`n` rows of the builtin video colour task: every frame one colour, the last frame's is the answer."""
    from spmd_grpo.data.videos import encode_video

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        answer = rng.choice(sorted(COLORS))
        others = [c for c in sorted(COLORS) if c != answer]
        digits = [rng.choice(others) for _ in range(VIDEO_COLOR_FRAMES - 1)] + [answer]
        frames = [Image.new("RGB", (56, 56), COLORS[d]) for d in digits]
        video = {"bytes": encode_video(frames, fps=2), "path": None}
        rows.append({"problem": VIDEO_COLOR_PROBLEM, "answer": answer, "images": None, "videos": [video]})
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


ROW_GROUP_SIZE = 256


def write_parquet(rows: list[dict], path: str | Path, *, row_group_size: int = ROW_GROUP_SIZE) -> Path:
    """Write rows in the geometry3k schema; an image may be a PIL image, PNG/JPEG bytes, or {bytes, path}; a
    `videos` column is written when a row has videos (encoded bytes, a path, or {bytes, path}).

    Row groups hold `row_group_size` rows (256), small like Hugging Face's image parquet exports (~100 rows):
    a reader that needs one row's images reads that row's row group, so small groups keep random access cheap.
    """
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

    def video_struct(video: Any) -> dict:
        return {"bytes": None, "path": video} if isinstance(video, str) else image_struct(video)

    media_type = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    columns = {
        "problem": (pa.string(), [row.get("problem") for row in rows]),
        "answer": (pa.string(), [row.get("answer") for row in rows]),
        "images": (media_type, [[image_struct(im) for im in row.get("images") or []] for row in rows]),
    }
    if any(row.get("videos") for row in rows):  # a video: bytes, a path, or {bytes, path}, like an image
        videos = [[video_struct(v) for v in row.get("videos") or []] for row in rows]
        columns["videos"] = (media_type, videos)
    schema = pa.schema([(name, kind) for name, (kind, _) in columns.items()])
    table = pa.table({name: values for name, (_, values) in columns.items()}, schema=schema)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path
