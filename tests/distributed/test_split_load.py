"""`load_dataset` split across 2 real ranks: each rank checks only its half, and both hold exactly the rows (and
images, and errors) of the single-process load."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import torch
import transformers

from spmd_grpo.config.schema import DataConfig
from spmd_grpo.data.dataset import load_dataset
from tests.conftest import tiny_model, torchrun
from tests.unit.test_data_streaming import _directory


def test_two_ranks_hold_the_single_process_rows(tmp_path):
    data_dir, _ = _directory(tmp_path)
    model_dir = tiny_model()
    torchrun(["tests/jobs/split_load.py", str(model_dir), str(data_dir), str(tmp_path / "out")], nproc=2)
    ranks = [torch.load(tmp_path / f"out.rank{r}.pt", weights_only=False) for r in range(2)]

    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    cfg = replace(DataConfig(), train_files=str(data_dir), max_bad_fraction=0.2, max_prompt_length=100)
    single = load_dataset(cfg, processor)
    rows = [
        (e.index, e.problem, e.answer, e.data_source, e.prompt_token_ids, e.num_prompt_tokens) for e in single
    ]
    digests = []
    for e in single:
        h = hashlib.sha256()
        for image in e.images:
            h.update(f"{image.mode}{image.size}".encode())
            h.update(image.tobytes())
        digests.append(h.hexdigest())

    assert 30 < len(rows) < 54
    for got in ranks:
        assert got["rows"] == rows
        assert got["digests"] == digests  # every rank decodes every row's images, also the other rank's
    # each rank read and checked only its half of the 60 rows (files of 21, 19 and 20 rows)
    halves = [[("a.parquet", r) for r in range(21)] + [("b.parquet", r) for r in range(9)]]
    halves.append([("b.parquet", r) for r in range(9, 19)] + [("c.parquet", r) for r in range(20)])
    assert [got["checked"] for got in ranks] == halves
    # too many bad rows: the same error on both ranks, naming the file and the rows
    assert ranks[0]["error"] == ranks[1]["error"]
    assert ranks[0]["error"].startswith(f"{data_dir / 'a.parquet'}: 2 of 21 rows are bad")
    assert "row 2 undecodable image" in ranks[0]["error"]
