"""Data pipeline: bad-row handling, prompt-length filtering with image expansion, resizing, sources, the
synthetic-data CLI."""

from __future__ import annotations

import io
import logging
import sys
import types
from dataclasses import replace

import pytest
from PIL import Image

from spmd_grpo.config.schema import DataConfig
from spmd_grpo.data.dataset import load_dataset
from spmd_grpo.data.synthetic import color_task_examples, synthetic_geo3k_rows, write_parquet
from spmd_grpo.tools.synthetic_data import main


def _png(size=(56, 56), color=(10, 200, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def _cfg(path, **kw) -> DataConfig:
    return replace(DataConfig(), train_files=str(path), **kw)


# ------------------------------------------------------------------------------------------ bad rows
def _rows_with_bad(n=50) -> tuple[list[dict], dict[int, str]]:
    rows = [
        {"problem": f"<image>Row {i}: what is x?", "answer": str(i), "images": [_png()]} for i in range(n)
    ]
    rows[3]["images"] = [b"this is not an image"]
    rows[7]["answer"] = None
    rows[12]["problem"] = ""
    rows[15]["problem"] = "<image> and <image>: two markers"
    rows[18]["problem"] = "no marker at all"
    expected = {
        3: "undecodable image",
        7: "missing answer",
        12: "empty problem",
        15: "<image> markers do not match images (2 markers, 1 images)",
        18: "<image> markers do not match images (0 markers, 1 images)",
    }
    return rows, expected


def test_bad_rows_are_skipped_and_summarised(tmp_path, processor, caplog):
    rows, expected = _rows_with_bad()
    path = write_parquet(rows, tmp_path / "geo.parquet")
    with caplog.at_level(logging.WARNING, logger="spmd_grpo.data.dataset"):
        examples = load_dataset(_cfg(path), processor)
    assert len(examples) == 45
    assert {e.index for e in examples} == set(range(50)) - set(expected)
    assert all(e.answer == str(e.index) for e in examples)  # original row numbers are kept
    *named, summary = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(named) == 5  # one line per skipped row: file, row, reason
    for line, (index, reason) in zip(named, expected.items(), strict=True):
        assert line.startswith(f"skipped {path} row {index}: {reason}")
    assert "cannot identify image file" in named[0] and "BytesIO" not in named[0]
    assert summary == (
        f"skipped 5 of 50 rows in {path}: <image> markers do not match images: 2, undecodable image: 1, "
        "missing answer: 1, empty problem: 1"
    )


def test_empty_answer_is_bad(tmp_path, processor):
    rows = [{"problem": "<image>q", "answer": "5", "images": [_png()]} for _ in range(4)]
    rows[1]["answer"] = "  "
    with pytest.raises(ValueError, match=r"bad\.parquet.*1 of 4 rows.*row 1 empty answer"):
        load_dataset(_cfg(write_parquet(rows, tmp_path / "bad.parquet")), processor)


def test_too_many_bad_rows_raise(tmp_path, processor):
    rows, _ = _rows_with_bad(20)  # 5 of 20 bad > 0.1
    path = write_parquet(rows, tmp_path / "broken.parquet")
    with pytest.raises(ValueError, match=r"broken\.parquet: 5 of 20 rows are bad.*row 3 undecodable image"):
        load_dataset(_cfg(path), processor)
    assert len(load_dataset(_cfg(path, max_bad_fraction=0.25), processor)) == 15


# ------------------------------------------------------------------------------------------ prompts
def test_long_prompts_are_filtered_and_expansion_counted(tmp_path, processor, caplog):
    rows = [
        {"problem": "<image>Short?", "answer": "1", "images": [_png((56, 56))]},  # 4 image tokens
        {"problem": "<image>Short too?", "answer": "2", "images": [_png((280, 280))]},  # 100 image tokens
        {"problem": "Text only, " + "very long " * 60, "answer": "3", "images": []},
        {"problem": "<image>then<image>", "answer": "4", "images": [_png((56, 112)), _png((112, 56))]},
    ]
    path = write_parquet(rows, tmp_path / "len.parquet")
    cfg = _cfg(path, max_pixels=280 * 280, max_prompt_length=4096)
    everything = load_dataset(cfg, processor)
    lengths = {e.index: e.num_prompt_tokens for e in everything}
    pad_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for example in everything:
        assert example.prompt_token_ids.count(pad_id) == len(example.images)
        text = processor.tokenizer.decode(example.prompt_token_ids)
        expanded = processor(text=[text], images=example.images or None)["input_ids"][0]
        assert example.num_prompt_tokens == len(expanded)
    assert lengths[1] - lengths[0] > 90  # the 280x280 image counts as 100 tokens, not 1

    limit = lengths[0] + 5
    with caplog.at_level(logging.WARNING, logger="spmd_grpo.data.dataset"):
        kept = load_dataset(replace(cfg, max_prompt_length=limit), processor)
    assert [e.index for e in kept] == [i for i, n in lengths.items() if n <= limit] and 0 in [
        e.index for e in kept
    ]
    assert all(e.num_prompt_tokens <= limit for e in kept)
    filtered = [i for i, n in lengths.items() if n > limit]
    message = next(r.getMessage() for r in caplog.records if "filtered" in r.getMessage())
    assert f"filtered {len(filtered)} of 4 prompts" in message
    assert "; ".join(f"row {i}: {lengths[i]} tokens" for i in filtered) in message  # each with its length
    assert message.endswith("raise data.max_prompt_length, or shrink the images with data.max_pixels from "
                            f"{path}: longer than data.max_prompt_length={limit}")  # fmt: skip


def test_markers_become_ordered_parts_with_format_and_system_prompt(tmp_path, processor):
    template = tmp_path / "fmt.jinja"
    template.write_text("{{ content }} Put the answer in \\boxed{}.")
    rows = [{"problem": "A<image>B<image>C", "answer": "1", "images": [_png(), _png()]}]
    cfg = _cfg(
        write_parquet(rows, tmp_path / "one.parquet"), format_prompt=str(template), system_prompt="SYS"
    )
    (example,) = load_dataset(cfg, processor)
    text = processor.tokenizer.decode(example.prompt_token_ids)
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    assert text == (
        f"<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nA{vision}B{vision}C Put the answer in \\boxed{{}}."
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert example.problem == "A<image>B<image>C"


def test_images_are_resized_into_pixel_bounds(tmp_path, processor):
    rows = [
        {"problem": "<image>big", "answer": "1", "images": [_png((400, 300))]},
        {"problem": "<image>small", "answer": "2", "images": [_png((20, 30))]},
        {"problem": "<image>grey", "answer": "3", "images": [Image.new("L", (90, 90), 128)]},
    ]
    low, high = 28 * 28 * 4, 28 * 28 * 16
    examples = load_dataset(
        _cfg(write_parquet(rows, tmp_path / "r.parquet"), min_pixels=low, max_pixels=high), processor
    )
    assert len(examples) == 3
    for example in examples:
        (image,) = example.images
        assert image.mode == "RGB"
        assert low <= image.width * image.height <= high
        assert image.width % 28 == 0 and image.height % 28 == 0


# ------------------------------------------------------------------------------------------ sources
def test_builtin_color(processor):
    cfg = replace(
        DataConfig(), train_files="builtin:color", val_files="builtin:color", num_builtin_examples=24
    )
    examples = load_dataset(cfg, processor)
    assert len(examples) == 24
    assert {e.answer for e in examples} <= {"0", "1", "2", "3"} and len({e.answer for e in examples}) > 1
    assert all(e.data_source == "color" and e.images[0].size == (56, 56) for e in examples)
    assert all(e.num_prompt_tokens == len(e.prompt_token_ids) + 3 for e in examples)  # 56x56 -> 4 tokens
    assert color_task_examples(8, 3) == color_task_examples(8, 3)
    assert color_task_examples(8, 3) != color_task_examples(8, 4)
    assert len(load_dataset(cfg, processor, split="val")) == 24


def test_builtin_geo3k_and_cli(tmp_path, processor):
    rows = synthetic_geo3k_rows(6, seed=0)
    assert rows == synthetic_geo3k_rows(6, seed=0)
    assert all(r["problem"].count("<image>") == 1 and r["answer"].isdigit() for r in rows)
    assert (
        len(
            load_dataset(
                replace(DataConfig(), train_files="builtin:geo3k", num_builtin_examples=6), processor
            )
        )
        == 6
    )

    out = tmp_path / "d" / "geo.parquet"
    # what `python -m spmd_grpo.data.synthetic make-geo3k ...` runs
    main(["make-geo3k", str(out), "--rows", "5", "--seed", "1"])
    examples = load_dataset(_cfg(out), processor)
    assert len(examples) == 5 and all(e.data_source == "geo" for e in examples)
    # a directory of files: indices continue across files in sorted order
    write_parquet(rows[:2], tmp_path / "d" / "more.parquet")
    assert [e.index for e in load_dataset(_cfg(tmp_path / "d"), processor)] == list(range(7))


def test_unknown_sources_are_named(processor, monkeypatch):
    def offline(name, split):  # the hub cannot be reached here; this is what `datasets` raises offline
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(ValueError, match=r"'hiyouga/geometry3k' split 'test'.*OfflineModeIsEnabled"):
        load_dataset(replace(DataConfig(), train_files="hiyouga/geometry3k@test"), processor)
    with pytest.raises(ValueError, match="builtin:nope"):
        load_dataset(replace(DataConfig(), train_files="builtin:nope"), processor)
    with pytest.raises(ValueError, match="data.val_files"):
        load_dataset(DataConfig(), processor, split="val")
    with pytest.raises(ValueError, match="no/such.parquet"):
        load_dataset(replace(DataConfig(), train_files="/no/such.parquet"), processor)
