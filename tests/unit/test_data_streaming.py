"""Data loading split across ranks, images decoded on demand: every rank holds the same rows as a single-process
load, errors reach every rank, images equal an eager decode pixel for pixel, and no pixels are kept.

Ranks are simulated in one process: `split_load` runs each rank's check up to its all-gather (which records the
rank's part and stops it), then runs every rank again with an all-gather that returns all recorded parts. The
real collective is tested in tests/distributed/test_split_load.py.
"""

from __future__ import annotations

import errno
import gc
import io
import logging
import random
import sys
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image

import spmd_grpo.data.sources as sources
from spmd_grpo.config.schema import DataConfig
from spmd_grpo.data.dataset import load_dataset
from spmd_grpo.data.synthetic import synthetic_geo3k_rows, write_parquet


def _png(size=(56, 56), color=(10, 200, 30), mode="RGB", fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color if mode in ("RGB", "RGBA") else 100).save(buf, format=fmt)
    return buf.getvalue()


def _cfg(path, **kw) -> DataConfig:
    return replace(DataConfig(), train_files=str(path), **kw)


class _Stop(Exception):
    pass


def split_load(cfg: DataConfig, processor, world_size: int) -> list:
    """What each of `world_size` ranks returns from load_dataset (or the exception it raises), in one process."""
    parts = []

    def record(obj):
        parts.append(obj)
        raise _Stop

    for rank in range(world_size):
        with pytest.raises(_Stop):
            load_dataset(cfg, processor, rank=rank, world_size=world_size, all_gather=record)
    out = []
    for rank in range(world_size):
        try:
            out.append(
                load_dataset(
                    cfg, processor, rank=rank, world_size=world_size, all_gather=lambda _: list(parts)
                )
            )
        except Exception as e:
            out.append(e)
    return out


def _summary(examples) -> list[tuple]:
    return [
        (e.index, e.problem, e.answer, e.data_source, e.prompt_token_ids, e.num_prompt_tokens)
        for e in examples
    ]


def _directory(tmp_path: Path) -> tuple[Path, dict[str, dict[int, str]]]:
    """Three files (row groups of 4, 7 and 5 rows) with bad rows in each: file -> {row in file: reason}."""
    rows = synthetic_geo3k_rows(60, seed=3)
    rows[2]["images"] = [b"not an image"]
    rows[9]["answer"] = None
    rows[25]["images"] = [_png()[:40]]  # truncated PNG
    rows[33]["problem"] = "<image><image> two markers"
    rows[47]["images"] = [_png((1000, 4))]  # aspect ratio smart_resize refuses
    rows[58]["problem"] = "<image> mentions <|image_pad|>"
    d = tmp_path / "d"
    write_parquet(rows[:21], d / "a.parquet", row_group_size=4)
    write_parquet(rows[21:40], d / "b.parquet", row_group_size=7)
    write_parquet(rows[40:], d / "c.parquet", row_group_size=5)
    expected = {
        "a.parquet": {2: "undecodable image", 9: "missing answer"},
        "b.parquet": {4: "undecodable image", 12: "<image> markers do not match images"},
        "c.parquet": {7: "image cannot be resized", 18: "text contains a special token ('<|image_pad|>')"},
    }
    return d, expected


@pytest.fixture(scope="module")
def bad_rows_dir(tmp_path_factory) -> tuple[Path, dict[str, dict[int, str]]]:
    """`_directory`, written once for the tests below, which only read it."""
    return _directory(tmp_path_factory.mktemp("bad_rows"))


# ------------------------------------------------------------------------------------------ split load
def test_directory_bad_rows_name_file_and_row(bad_rows_dir, processor, caplog):
    d, expected = bad_rows_dir
    with caplog.at_level(logging.WARNING, logger="spmd_grpo.data.dataset"):
        examples = load_dataset(_cfg(d, max_bad_fraction=0.2), processor)
    bad = {
        21 * (f == "b.parquet") + 40 * (f == "c.parquet") + row
        for f, rows in expected.items()
        for row in rows
    }
    assert [e.index for e in examples] == [i for i in range(60) if i not in bad]
    *named, summary = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    in_order = [(d / name, row, why) for name, rows in expected.items() for row, why in rows.items()]
    assert len(named) == len(in_order)
    for line, (file, row, reason) in zip(named, in_order, strict=True):
        assert line.startswith(f"skipped {file} row {row}: {reason}")
    assert summary.startswith(f"skipped 6 of 60 rows in {d}: undecodable image: 2, missing answer: 1, ")
    assert {e.data_source for e in examples} == {"a", "b", "c"}


@pytest.mark.parametrize("world_size", [2, 3, 7])
def test_split_load_equals_single_process(bad_rows_dir, processor, caplog, world_size):
    d, _ = bad_rows_dir
    cfg = _cfg(d, max_bad_fraction=0.2, max_prompt_length=100)
    with caplog.at_level(logging.WARNING, logger="spmd_grpo.data.dataset"):
        single = load_dataset(cfg, processor)
    single_logs = [r.getMessage() for r in caplog.records]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="spmd_grpo.data.dataset"):
        ranks = split_load(cfg, processor, world_size)
    assert 0 < len(single) < 54  # bad rows skipped and some prompts too long
    assert all(_summary(r) == _summary(single) for r in ranks)
    assert [r.getMessage() for r in caplog.records] == single_logs  # rank 0 logs, once; the others do not
    assert any("filtered" in m for m in single_logs)
    for rank_examples in ranks:  # every rank can decode every row, not only the ones it checked
        assert [im.size for im in rank_examples[-1].images] == [im.size for im in single[-1].images]


def test_too_many_bad_rows_fail_on_every_rank(bad_rows_dir, processor):
    d, _ = bad_rows_dir
    ranks = split_load(_cfg(d, max_bad_fraction=0.05), processor, 3)
    messages = {str(r) for r in ranks}
    assert all(isinstance(r, ValueError) for r in ranks) and len(messages) == 1
    assert f"{d / 'a.parquet'}: 2 of 21 rows are bad" in messages.pop()


def test_a_read_error_on_one_rank_reaches_every_rank(bad_rows_dir, processor, monkeypatch):
    d, _ = bad_rows_dir
    read = sources._ParquetRows.read

    def flaky(self, start, stop):
        if self.path.name == "c.parquet":
            raise OSError(errno.EIO, "Input/output error")  # the OS's, not a corrupt file's
        return read(self, start, stop)

    monkeypatch.setattr(sources._ParquetRows, "read", flaky)
    rank0, rank1 = split_load(_cfg(d, max_bad_fraction=0.2), processor, 2)  # rank 1 reads rows 30..59
    assert isinstance(rank1, OSError)
    assert isinstance(rank0, ValueError)
    assert str(rank0) == f"reading {d} failed on rank 1: OSError: [Errno 5] Input/output error"


def test_all_gather_must_cover_the_world(tmp_path, processor):
    path = write_parquet(synthetic_geo3k_rows(4, seed=0), tmp_path / "x.parquet")
    with pytest.raises(ValueError, match="1 parts for a world of size 2"):
        load_dataset(_cfg(path), processor, rank=0, world_size=2, all_gather=lambda obj: [obj])
    with pytest.raises(ValueError, match="rank 2 is not in a world of size 2"):
        load_dataset(_cfg(path), processor, rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size=2 needs an all_gather"):
        load_dataset(_cfg(path), processor, rank=1, world_size=2)


def test_a_world_of_one_gathers_without_a_collective():
    """The trainer's all-gather in a gloo world of one hands back the object itself: the collective (a pickled
    copy, unpickled) would leave an OpenMP team on gloo's thread that slows every op of the run."""
    import torch.distributed as dist

    from spmd_grpo.parallel.collectives import all_gather_objects

    shard_check = ("ok", [("rows", 400)], bytes(400_000))  # the size of the start-up check's payload
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parts = all_gather_objects(shard_check)
    finally:
        dist.destroy_process_group()
    assert len(parts) == 1 and parts[0] is shard_check


# ------------------------------------------------------------------------------------------ images on demand
def _eager(image: bytes, low: int, high: int) -> Image.Image:
    """The eager decode the loader used to keep: RGB, smart_resize into [low, high], bicubic."""
    from qwen_vl_utils import smart_resize

    decoded = Image.open(io.BytesIO(image)).convert("RGB")
    height, width = smart_resize(decoded.height, decoded.width, factor=28, min_pixels=low, max_pixels=high)
    return (
        decoded
        if (width, height) == decoded.size
        else decoded.resize((width, height), Image.Resampling.BICUBIC)
    )


def test_images_on_demand_equal_the_eager_decode(tmp_path, processor):
    rng = random.Random(0)
    rows = []
    for i in range(40):
        mode, fmt = rng.choice([("RGB", "PNG"), ("RGB", "JPEG"), ("L", "PNG"), ("RGBA", "PNG"), ("P", "PNG")])
        size = (rng.randint(20, 700), rng.randint(20, 500))
        images = [_png(size, (i, 255 - i, 3 * i), mode, fmt) for _ in range(1 + (i % 3 == 0))]
        rows.append({"problem": "<image>" * len(images) + f"row {i}", "answer": str(i), "images": images})
    low, high = 28 * 28 * 4, 28 * 28 * 200
    path = write_parquet(rows, tmp_path / "mixed.parquet", row_group_size=3)
    examples = load_dataset(_cfg(path, min_pixels=low, max_pixels=high, max_prompt_length=4096), processor)
    assert [e.index for e in examples] == list(range(40))
    order = list(range(40))
    random.Random(1).shuffle(order)
    for i in order:  # random access across row groups
        got = examples[i].images
        want = [_eager(image, low, high) for image in rows[i]["images"]]
        assert [(g.mode, g.size, g.tobytes()) for g in got] == [(w.mode, w.size, w.tobytes()) for w in want]
        cache = examples[i].source.cache
        # one row group of the image column held, not the file
        assert cache.keys == {"images": (path, i // 3)} and len(cache.columns["images"]) <= 3


def test_hub_dataset_is_read_raw_and_on_demand(processor, monkeypatch):
    datasets = pytest.importorskip("datasets")
    rows = {
        "problem": [f"<image>hub row {i}" for i in range(6)],
        "answer": [str(i) for i in range(6)],
        "images": [[{"bytes": _png((60 + 10 * i, 50)), "path": None}] for i in range(6)],
    }
    rows["images"][4] = [{"bytes": b"broken", "path": None}]
    features = datasets.Features(
        {
            "problem": datasets.Value("string"),
            "answer": datasets.Value("string"),
            "images": [datasets.Image()],
        }
    )
    hub = datasets.Dataset.from_dict(rows, features=features)
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split: hub)
    cfg = replace(DataConfig(), train_files="someone/geo@train", max_bad_fraction=0.2)
    examples = load_dataset(cfg, processor)
    assert [e.index for e in examples] == [0, 1, 2, 3, 5]  # an undecodable image is a bad row, not a crash
    assert all(e.data_source == "someone/geo" for e in examples)
    for e in examples:
        want = _eager(rows["images"][e.index][0]["bytes"], cfg.min_pixels, cfg.max_pixels)
        assert [im.tobytes() for im in e.images] == [want.tobytes()]


def test_large_row_groups_are_warned_about(tmp_path, processor, caplog, monkeypatch):
    path = write_parquet(synthetic_geo3k_rows(8, seed=0), tmp_path / "big.parquet", row_group_size=8)
    monkeypatch.setattr(sources, "LARGE_ROW_GROUP_BYTES", 1000)
    with caplog.at_level(logging.WARNING, logger="spmd_grpo.data.dataset"):
        load_dataset(_cfg(path), processor)
    (message,) = [r.getMessage() for r in caplog.records if "row groups" in r.getMessage()]
    assert f"1 parquet file(s) have row groups with more than 0 MiB of images ({path}" in message


def test_write_parquet_writes_small_row_groups(tmp_path):
    path = write_parquet(synthetic_geo3k_rows(3, seed=0) * 200, tmp_path / "g.parquet")
    meta = pq.ParquetFile(path).metadata
    assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)] == [256, 256, 88]


# ------------------------------------------------------------------------------------------ memory
def _live_images() -> int:
    return sum(issubclass(type(o), Image.Image) for o in gc.get_objects())


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_1k_row_load_keeps_no_pixels(tmp_path, processor):
    distinct = synthetic_geo3k_rows(50, seed=0)
    path = write_parquet([distinct[i % 50] for i in range(1000)], tmp_path / "1k.parquet")
    warm_up = write_parquet(distinct, tmp_path / "50.parquet")
    load_dataset(
        _cfg(warm_up), processor
    )  # first-use imports and allocator pools (~45 MB) are not the data's
    gc.collect()
    images_before, rss_before = _live_images(), _rss()
    examples = load_dataset(_cfg(path), processor)
    gc.collect()
    assert len(examples) == 1000
    assert _live_images() == images_before
    # What is kept per row: the token ids (4 B each), the texts, the object. The eager loader kept each row's
    # decoded 224x168 RGB image (4 B per pixel in PIL): 150 kB a row, 150 MB here (measured at 2000 rows:
    # +315 MiB RSS, 2000 live images), well above the bound below.
    kept = sum(
        sys.getsizeof(e) + sys.getsizeof(e.token_ids) + sys.getsizeof(e.problem) + sys.getsizeof(e.answer)
        for e in examples
    )
    assert kept / len(examples) < 800, kept
    assert _rss() - rss_before < 40 << 20
    assert examples[567].images[0].size == (224, 168)
