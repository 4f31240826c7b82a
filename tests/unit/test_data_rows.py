"""Rows a real data set can hold: each is used correctly or skipped and named (file, row, reason) at load, and
what is kept goes through the real Qwen2.5-VL processor with prompt ids and images that agree (one
`<|image_pad|>` per image, the processor's expansion equal to `num_prompt_tokens`).

Covered: text that is not UTF-8 (a binary column, invalid bytes in a string column), NUL/emoji/RTL text,
non-string answers, special tokens written in the text, more images than worker.rollout.limit_images, images
of every PIL mode (alpha, palette transparency, 16-bit, 32-bit, float, CMYK, LAB), tiny and extreme sizes,
decompression bombs, truncated images, corrupt/empty/foreign files in a directory, and a log that names at most
MAX_NAMED_PER_REASON rows per reason.
"""

from __future__ import annotations

import decimal
import io
import logging
import struct
import warnings
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from spmd_grpo.config.schema import DataConfig
from spmd_grpo.data.dataset import DataError, load_dataset
from spmd_grpo.data.sources import MAX_NAMED_PER_REASON
from spmd_grpo.data.synthetic import synthetic_geo3k_rows, write_parquet
from tests.conftest import tiny_model
from tests.unit.test_data_streaming import split_load

IMAGES = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))


def _encoded(image: Image.Image, fmt: str = "PNG", **save) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save)
    return buf.getvalue()


def _png(size=(56, 56)) -> bytes:
    return _encoded(Image.new("RGB", size, (10, 200, 30)))


def _cfg(path, **kw) -> DataConfig:
    return replace(DataConfig(), train_files=str(path), **kw)


def _skip_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped")]


def _processor_for(processor, cfg: DataConfig):
    """The processor with the trainer's (and vLLM's) resize bounds for `cfg`."""
    import transformers

    size = {"shortest_edge": cfg.min_pixels, "longest_edge": cfg.max_pixels}
    return transformers.AutoProcessor.from_pretrained(tiny_model(), size=size)


def _assert_processor_agrees(examples, processor) -> None:
    """What the trainer's processor makes of each kept prompt equals what load counted and vLLM will get."""
    pad_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for example in examples:
        images = example.images
        assert all(image.mode == "RGB" for image in images)
        assert example.prompt_token_ids.count(pad_id) == len(images)
        text = processor.tokenizer.decode(example.prompt_token_ids)
        out = processor(text=[text], images=images or None, return_tensors="np")
        assert len(out["input_ids"][0]) == example.num_prompt_tokens
        if images:
            assert np.isfinite(out["pixel_values"]).all()
            assert int((out["image_grid_thw"].prod(-1) // 4).sum()) == list(out["input_ids"][0]).count(pad_id)


# ------------------------------------------------------------------------------------------ text
def test_text_encodings(tmp_path, processor, caplog):
    odd = [
        "<image>NUL\x00inside, emoji \U0001f600\U0001f3f3\ufe0f\u200d\U0001f308, x?",
        "<image>RTL \u05e9\u05dc\u05d5\u05dd \u0645\u0631\u062d\u0628\u0627 \u202eevil\u202c, combining e\u0301?",
        "<image>\ufeffBOM, CRLF\r\nand a lone \\ backslash {{ braces }} {% raw %}?",
    ]
    utf8 = pa.array([t.encode() for t in odd] + ["<image>caf\xe9 in latin-1".encode("latin-1")], pa.binary())
    binary = pa.table(
        {"problem": utf8, "answer": ["1", "2", "3", "4"], "images": [[{"bytes": _png(), "path": None}]] * 4},
        schema=pa.schema([("problem", pa.binary()), ("answer", pa.string()), ("images", IMAGES)]),
    )
    pq.write_table(binary, tmp_path / "a_binary.parquet")
    # A string column holding invalid UTF-8 (writers other than Arrow's do not all validate): only that row is bad.
    data = b"<image>ok<image>bad \xe9<image>ok too"
    offsets = np.array([0, 9, 21, len(data)], np.int32)
    text = pa.Array.from_buffers(pa.string(), 3, [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(data)])
    images = [[{"bytes": _png(), "path": None}]] * 3
    pq.write_table(
        pa.table({"problem": text, "answer": ["5", "6", "7"], "images": pa.array(images, IMAGES)}),
        tmp_path / "b_string.parquet",
    )
    with caplog.at_level(logging.WARNING, logger="spmd_grpo.data.dataset"):
        examples = load_dataset(_cfg(tmp_path, max_bad_fraction=0.5), processor)
    assert [e.problem for e in examples] == [*odd, "<image>ok", "<image>ok too"]
    assert [e.index for e in examples] == [0, 1, 2, 4, 6]
    lines = _skip_lines(caplog)
    assert lines[0] == f"skipped {tmp_path / 'a_binary.parquet'} row 3: problem is not UTF-8 (byte 10)"
    assert lines[1] == f"skipped {tmp_path / 'b_string.parquet'} row 1: problem is not UTF-8 (byte 11)"
    for example in examples:  # the text reaches the model unchanged
        decoded = processor.tokenizer.decode(example.prompt_token_ids)
        assert example.problem.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>") in decoded
    _assert_processor_agrees(examples, processor)


def test_answers_of_every_type(tmp_path, processor, caplog):
    answers = {
        "int": (pa.array([7, -3], pa.int64()), ["7", "-3"]),
        "float": (pa.array([2.0, 0.1, float("nan"), float("inf"), None]), ["2", "0.1"]),
        "decimal": (pa.array([decimal.Decimal("1.50")], pa.decimal128(5, 2)), ["1.50"]),
        "bool": (pa.array([True]), []),
        "list": (pa.array([["1", "2"]]), []),
        "string": (pa.array(["  x = 3 ", "", None]), ["x = 3"]),
    }
    for name, (column, _) in answers.items():
        problems = [f"<image>{name} {i}" for i in range(len(column))]
        images = pa.array([[{"bytes": _png(), "path": None}]] * len(column), IMAGES)
        pq.write_table(
            pa.table({"problem": problems, "answer": column, "images": images}), tmp_path / f"{name}.parquet"
        )
    with caplog.at_level(logging.WARNING, logger="spmd_grpo.data.dataset"):
        examples = load_dataset(_cfg(tmp_path, max_bad_fraction=1.0), processor)
    by_file = {}
    for example in examples:
        by_file.setdefault(example.problem.split()[0].removeprefix("<image>"), []).append(example.answer)
    assert by_file == {name: want for name, (_, want) in answers.items() if want}
    reasons = [line.split(": ", 1)[1] for line in _skip_lines(caplog)[:-1]]
    assert sorted(reasons) == sorted(
        [
            "answer is not text or a number (bool)",
            "answer is not finite (nan)",
            "answer is not finite (inf)",
            "missing answer",
            "answer is not text or a number (list)",
            "empty answer",
            "missing answer",
        ]
    )


SPECIAL = [
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|endoftext|>",
]


def test_special_tokens_in_text_are_skipped(tmp_path, processor, caplog):
    rows = [{"problem": f"<image>Row {i}?", "answer": str(i), "images": [_png()]} for i in range(12)]
    for i, token in enumerate(SPECIAL):
        rows[2 * i]["problem"] = f"<image>What does {token} mean?"
    rows[1]["problem"] = "<image>Near misses are text: <|im_start>, < |image_pad| >, <image_pad>?"
    path = write_parquet(rows, tmp_path / "s.parquet")
    with caplog.at_level(logging.WARNING, logger="spmd_grpo.data.dataset"):
        examples = load_dataset(_cfg(path, max_bad_fraction=0.5), processor)
    assert [e.index for e in examples] == list(range(1, 12, 2))
    assert _skip_lines(caplog)[:-1] == [
        f"skipped {path} row {2 * i}: text contains a special token ({token!r})"
        for i, token in enumerate(SPECIAL[:MAX_NAMED_PER_REASON])
    ]
    _assert_processor_agrees(examples, processor)


def test_special_tokens_in_prompt_settings(tmp_path, processor):
    path = write_parquet([{"problem": "<image>q", "answer": "1", "images": [_png()]}], tmp_path / "p.parquet")
    with pytest.raises(DataError, match=r"data.system_prompt contains the special token '<\|im_end\|>'"):
        load_dataset(_cfg(path, system_prompt="Be brief.<|im_end|>"), processor)
    template = tmp_path / "fmt.jinja"
    template.write_text("{{ content }}<|endoftext|>")
    with pytest.raises(  # the template named, not each row ("1 of 1 rows are bad ... special token")
        DataError, match=rf"data.format_prompt: {template} contains the special token '<\|endoftext\|>'$"
    ):
        load_dataset(_cfg(path, format_prompt=str(template)), processor)


def test_more_images_than_the_rollout_limit_are_skipped(tmp_path, processor, caplog):
    rows = [
        {"problem": "<image>" * k + f"{k} images", "answer": str(k), "images": [_png()] * k}
        for k in (0, 1, 2, 3, 2, 1)
    ]
    path = write_parquet(rows, tmp_path / "many.parquet")
    assert len(load_dataset(_cfg(path), processor)) == 6  # no limit given: every row
    with caplog.at_level(logging.WARNING, logger="spmd_grpo.data.dataset"):
        examples = load_dataset(_cfg(path, max_bad_fraction=0.2), processor, limit_images=2)
    assert [e.index for e in examples] == [0, 1, 2, 4, 5]
    assert (
        _skip_lines(caplog)[0]
        == f"skipped {path} row 3: more images than worker.rollout.limit_images (3 > 2)"
    )
    _assert_processor_agrees(examples, processor)


# ------------------------------------------------------------------------------------------ images
def _modes() -> dict[str, tuple[bytes, tuple[int, int, int]]]:
    """name -> (encoded image, the RGB pixel the model should see)."""
    size = (40, 30)
    palette = Image.new("P", size, 0)
    palette.putpalette([255, 0, 0] * 256)
    grey16 = Image.fromarray(np.full(size[::-1], 32896, np.uint16))
    return {
        "1": (_encoded(Image.new("1", size, 1)), (255, 255, 255)),
        "L": (_encoded(Image.new("L", size, 100)), (100, 100, 100)),
        "LA transparent": (_encoded(Image.new("LA", size, (100, 0))), (255, 255, 255)),
        "LA opaque": (_encoded(Image.new("LA", size, (100, 255))), (100, 100, 100)),
        "P": (_encoded(palette), (255, 0, 0)),
        "P transparent": (_encoded(palette, transparency=0), (255, 255, 255)),
        "PA": (_encoded(Image.new("PA", size, (0, 0)), "TIFF"), (255, 255, 255)),
        "RGBA transparent": (_encoded(Image.new("RGBA", size, (200, 0, 0, 0))), (255, 255, 255)),
        "RGBA opaque": (_encoded(Image.new("RGBA", size, (200, 0, 0, 255))), (200, 0, 0)),
        "CMYK": (_encoded(Image.new("CMYK", size, (0, 0, 0, 0)), "TIFF"), (255, 255, 255)),
        "CMYK jpeg": (_encoded(Image.new("CMYK", size, (0, 0, 0, 0)), "JPEG", quality=100), (255, 255, 255)),
        "16-bit PNG": (_encoded(grey16), (128, 128, 128)),
        "I 32-bit": (_encoded(Image.new("I", size, 65535), "TIFF"), (255, 255, 255)),
        "F 0..1": (_encoded(Image.new("F", size, 0.5), "TIFF"), (128, 128, 128)),
        "F 0..255": (_encoded(Image.new("F", size, 100.0), "TIFF"), (100, 100, 100)),
        "LAB": (_encoded(Image.new("LAB", size, (100, 128, 128)), "TIFF"), None),
        "GIF": (_encoded(Image.new("P", size, 0), "GIF"), (0, 0, 0)),
        "WEBP": (_encoded(Image.new("RGB", size, (1, 2, 3)), "WEBP", lossless=True), (1, 2, 3)),
    }


def test_images_of_every_mode(tmp_path, processor, caplog):
    modes = _modes()
    rows = [
        {"problem": f"<image>{name}", "answer": "1", "images": [data]} for name, (data, _) in modes.items()
    ]
    path = write_parquet(rows, tmp_path / "modes.parquet")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no PIL warning per image (palette transparency, bombs)
        with caplog.at_level(logging.WARNING, logger="spmd_grpo.data.dataset"):
            examples = load_dataset(_cfg(path, max_bad_fraction=0.2), processor)
        got = {e.problem.removeprefix("<image>"): e.images[0] for e in examples}
    assert set(got) == set(modes) and not _skip_lines(caplog)
    for name, image in got.items():
        want = modes[name][1] or image.getpixel((0, 0))  # LAB: PIL's conversion, whatever it is
        assert image.mode == "RGB" and image.getpixel((image.width // 2, image.height // 2)) == want, name
    _assert_processor_agrees(examples, processor)


def _png_header(width: int, height: int) -> bytes:
    """A PNG that says width x height but holds 64 pixels of data: PIL reads the size before any pixel."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    pixels = zlib.compress(bytes(64))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def test_image_sizes(tmp_path, processor, caplog):
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 255, (300, 300, 3), np.uint8))
    sizes = {
        "1x1": _png((1, 1)),
        "1x27": _png((1, 27)),
        "3x500": _png((3, 500)),  # aspect 167 <= 200: resized
        "1x300": _png((1, 300)),  # aspect 300: smart_resize refuses
        "20000x20000": _png_header(20000, 20000),  # above twice PIL's limit: DecompressionBombError
        "10000x10000": _png_header(10000, 10000),  # between once and twice: PIL would only warn
        "truncated PNG": _encoded(noise)[:-5000],
        "truncated JPEG": _encoded(noise, "JPEG")[:-3000],
        "empty bytes": b"",
    }
    rows = [{"problem": f"<image>{name}", "answer": "1", "images": [data]} for name, data in sizes.items()]
    path = write_parquet(rows, tmp_path / "sizes.parquet")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level(logging.WARNING, logger="spmd_grpo.data.dataset"):
            examples = load_dataset(_cfg(path, max_bad_fraction=1.0), processor)
    assert [e.problem.removeprefix("<image>") for e in examples] == ["1x1", "1x27", "3x500"]
    low, high = DataConfig().min_pixels, DataConfig().max_pixels
    for example in examples:  # smaller than one 28x28 patch: scaled up into [min_pixels, max_pixels]
        (image,) = example.images
        assert image.width % 28 == 0 and image.height % 28 == 0 and low <= image.width * image.height <= high
    assert examples[0].images[0].size == (56, 56)
    reasons = [line.split(": ", 1)[1] for line in _skip_lines(caplog)[:-1]]
    assert reasons[0].startswith("image cannot be resized (absolute aspect ratio must be smaller than 200")
    assert reasons[1] == "image too large (Image size (400000000 pixels) exceeds limit of 178956970 pixels)"
    assert reasons[2] == "image too large (Image size (100000000 pixels) exceeds limit of 89478485 pixels)"
    assert reasons[3].startswith("undecodable image (") and "truncated" in reasons[3]
    assert reasons[4].startswith("undecodable image (") and "truncated" in reasons[4]
    assert reasons[5] == "undecodable image (cannot identify image file)"
    _assert_processor_agrees(examples, processor)
    # Under 16 image tokens, 3x500 has no size: smart_resize would floor its width to 0 (PIL fails on that).
    small = _cfg(path, max_bad_fraction=1.0, max_pixels=28 * 28 * 16)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="spmd_grpo.data.dataset"):
        examples = load_dataset(small, processor)
    assert [e.problem.removeprefix("<image>") for e in examples] == ["1x1", "1x27"]
    assert _skip_lines(caplog)[0] == (
        f"skipped {path} row 2: image cannot be resized (3x500 has no 28-multiple size within "
        "data.min_pixels=3136, data.max_pixels=12544 at its aspect ratio)"
    )
    _assert_processor_agrees(examples, _processor_for(processor, small))


def test_an_image_that_changes_after_load_is_named(tmp_path, processor):
    image = tmp_path / "pic.png"
    image.write_bytes(_png())
    rows = [{"problem": "<image>q", "answer": "1", "images": [{"bytes": None, "path": "pic.png"}]}]
    (example,) = load_dataset(_cfg(write_parquet(rows, tmp_path / "p.parquet")), processor)
    assert example.images[0].size == (56, 56)  # a path relative to the parquet file's directory
    image.write_bytes(b"overwritten")
    with pytest.raises(ValueError, match=r"p\.parquet row 0: undecodable image .* passed the check at load"):
        _ = example.images


# ------------------------------------------------------------------------------------------ files
def _directory_with_bad_files(d: Path) -> None:
    """Good a.parquet (8 rows) and c.parquet (6 rows) among files that are not usable."""
    rows = synthetic_geo3k_rows(14, seed=5)
    write_parquet(rows[:8], d / "a.parquet", row_group_size=4)
    (d / "b_empty.parquet").write_bytes(b"")
    write_parquet(rows[8:], d / "c.parquet")
    (d / "d_garbage.parquet").write_bytes(b"not parquet at all" * 10)
    good = (d / "a.parquet").read_bytes()
    (d / "e_truncated.parquet").write_bytes(good[: len(good) // 2])
    pq.write_table(pa.table({"question": ["<image>?"], "answer": ["1"]}), d / "f_columns.parquet")
    # A readable footer but a corrupt page header in its second row group: found only when read.
    damaged = bytearray(good)
    offset = pq.ParquetFile(d / "a.parquet").metadata.row_group(1).column(0).data_page_offset
    damaged[offset : offset + 24] = b"\xff" * 24
    (d / "g_pages.parquet").write_bytes(bytes(damaged))
    write_parquet([], d / "h_no_rows.parquet")


@pytest.mark.parametrize("world_size", [1, 2])
def test_bad_files_in_a_directory_are_skipped(tmp_path, processor, caplog, world_size):
    _directory_with_bad_files(tmp_path)
    with caplog.at_level(logging.WARNING, logger="spmd_grpo.data.dataset"):
        ranks = split_load(_cfg(tmp_path), processor, world_size) if world_size > 1 else None
        examples = ranks[0] if ranks else load_dataset(_cfg(tmp_path), processor)
    a, c = synthetic_geo3k_rows(14, seed=5)[:8], synthetic_geo3k_rows(14, seed=5)[8:]
    assert [e.answer for e in examples] == [r["answer"] for r in a + c]
    assert [e.index for e in examples] == list(range(14))  # files that cannot be opened have no rows
    assert all(r == examples or [e.index for e in r] == list(range(14)) for r in ranks or [])
    lines = [m for m in _skip_lines(caplog) if "unreadable file" in m]
    expected = {
        "b_empty": "ArrowInvalid: Parquet file size is 0 bytes",
        "d_garbage": "ArrowInvalid: Parquet magic bytes not found in footer",
        "e_truncated": "ArrowInvalid: Parquet magic bytes not found in footer",
        "f_columns": "ValueError: " + str(tmp_path / "f_columns.parquet") + ": no column 'problem'",
        "g_pages": "OSError: Couldn't deserialize thrift",  # found by the rank that read that row group
    }
    assert len(lines) == len(expected)  # one line per file
    for line, (name, why) in zip(lines, expected.items(), strict=True):
        assert line.startswith(f"skipped unreadable file {tmp_path / name}.parquet: {why}"), line


def test_a_directory_of_bad_files_is_an_error(tmp_path, processor):
    (tmp_path / "a.parquet").write_bytes(b"")
    (tmp_path / "b.parquet").write_bytes(b"junk" * 100)
    with pytest.raises(
        ValueError, match=r"no readable parquet file among 2: .*a\.parquet: .*; .*b\.parquet: "
    ):
        load_dataset(_cfg(tmp_path), processor)


# ------------------------------------------------------------------------------------------ the log
def test_skip_log_names_a_few_rows_per_reason(tmp_path, processor, caplog):
    rows = [{"problem": f"<image>Row {i}?", "answer": str(i), "images": [_png()]} for i in range(100)]
    for i in range(0, 80, 2):
        rows[i]["answer"] = None
    for i in (1, 3, 5):
        rows[i]["images"] = [b"broken"]
    path = write_parquet(rows, tmp_path / "many_bad.parquet")
    with caplog.at_level(logging.WARNING, logger="spmd_grpo.data.dataset"):
        examples = load_dataset(_cfg(path, max_bad_fraction=0.5), processor)
    assert len(examples) == 57
    *named, summary = _skip_lines(caplog)
    assert len(named) == MAX_NAMED_PER_REASON + 3
    assert named == [
        f"skipped {path} row {i}: "
        + ("missing answer" if i % 2 == 0 else "undecodable image (cannot identify image file)")
        for i in (0, 1, 2, 3, 4, 5, 6, 8)  # row order; past 5 rows, "missing answer" is only counted
    ]
    assert summary == (
        f"skipped 43 of 100 rows in {path}: missing answer: 40, undecodable image: 3 "
        f"({40 - MAX_NAMED_PER_REASON} not named above: at most {MAX_NAMED_PER_REASON} per reason)"
    )


def test_every_row_bad_is_an_error_naming_the_file(tmp_path, processor):
    rows = [{"problem": "<image>q", "answer": None, "images": [_png()]} for _ in range(4)]
    path = write_parquet(rows, tmp_path / "all_bad.parquet")
    with pytest.raises(DataError, match=r"all_bad\.parquet: 4 of 4 rows are bad.*row 0 missing answer"):
        load_dataset(_cfg(path), processor)
    with pytest.raises(
        DataError, match=r"no usable examples in .*all_bad\.parquet .*4 bad rows \(missing answer: 4\)"
    ):
        load_dataset(_cfg(path, max_bad_fraction=1.0), processor)
    pq.write_table(
        pq.read_table(path).slice(0, 0), tmp_path / "no_rows.parquet"
    )  # the reason, not ": " alone
    with pytest.raises(
        DataError, match=r"no usable examples in .*no_rows\.parquet \(.*\): it holds no rows$"
    ):
        load_dataset(_cfg(tmp_path / "no_rows.parquet"), processor)


@pytest.mark.parametrize("column", ["images", "videos"])
def test_a_media_column_of_numbers_is_a_bad_row_naming_file_and_row(tmp_path, processor, column):
    """A number column under data.image_key / video_key (a mapping mistake): each row is bad and named, where
    the load stopped with `TypeError: 'int' object is not iterable`, naming no file, row or column."""
    marker = "<image>" if column == "images" else "<video>"
    table = pa.table({"problem": [f"{marker}q"] * 2, "answer": ["1", "2"], column: [5, 6]})
    pq.write_table(table, tmp_path / "numbers.parquet")
    with pytest.raises(
        ValueError,
        match=rf"numbers\.parquet: 2 of 2 rows are bad.*row 0 {column} is not a list of {column} \(int\)",
    ):
        load_dataset(_cfg(tmp_path / "numbers.parquet"), processor)


def test_a_prompt_template_failing_on_one_row_skips_that_row_naming_it(tmp_path, processor, caplog):
    """A format_prompt that renders most problems but raises on one (here: non-ASCII text) skips that row,
    named, where the load stopped on every rank with the jinja error alone, naming no file or row."""
    rows = [{"problem": f"<image>{p}", "answer": "1", "images": [_png()]} for p in ("a?", "caf\xe9?", "b?")]
    path = write_parquet(rows, tmp_path / "t.parquet")
    template = tmp_path / "ascii.jinja"
    template.write_text("{{ content.encode('ascii').decode() }} Answer briefly.")
    with caplog.at_level(logging.WARNING, logger="spmd_grpo.data.dataset"):
        examples = load_dataset(_cfg(path, format_prompt=str(template), max_bad_fraction=0.5), processor)
    assert [e.index for e in examples] == [0, 2]
    assert _skip_lines(caplog)[0].startswith(
        f"skipped {path} row 1: data.format_prompt failed on the problem (UnicodeEncodeError: 'ascii' codec"
    )
