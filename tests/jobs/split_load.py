"""torchrun job: `load_dataset` split across real ranks (gloo `all_gather_objects`).

    torchrun --nproc_per_node 2 tests/jobs/split_load.py MODEL_DIR DATA_DIR OUT_PREFIX

Each rank checks its half of the rows of DATA_DIR (a directory of parquet files), then saves to
OUT_PREFIX.rank<r>.pt what it holds: every kept row (index, texts, token ids, expanded length), a digest of
every row's images decoded on this rank, the (file, row) pairs this rank read to check, and the error it
raised for a `max_bad_fraction` the data exceeds.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import replace

import torch

import spmd_grpo.data.dataset as data
import spmd_grpo.data.sources as sources
from spmd_grpo.config.schema import DataConfig
from spmd_grpo.parallel.collectives import all_gather_objects, init_distributed
from tests.jobs.common import run_job


def image_digest(example) -> str:
    h = hashlib.sha256()
    for image in example.images:
        h.update(f"{image.mode}{image.size}".encode())
        h.update(image.tobytes())
    return h.hexdigest()


def main() -> None:
    """Runs only under torchrun (importing this module must not create a process group)."""
    import transformers

    model_dir, data_dir, out = sys.argv[1:4]
    world = init_distributed("cpu")
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    cfg = replace(DataConfig(), train_files=data_dir, max_bad_fraction=0.2, max_prompt_length=100)
    checked = []  # (file, row) of every row this rank reads to check it
    read = sources._ParquetRows.read

    def recording_read(self, start, stop):
        for row, values in read(self, start, stop):
            checked.append((self.path.name, row))
            yield row, values

    sources._ParquetRows.read = recording_read
    load = dict(rank=world.rank, world_size=world.world_size, all_gather=all_gather_objects)
    examples = data.load_dataset(cfg, processor, **load)
    sources._ParquetRows.read = read
    try:
        data.load_dataset(replace(cfg, max_bad_fraction=0.05), processor, **load)
        error = None
    except ValueError as e:
        error = str(e)
    rows = [
        (e.index, e.problem, e.answer, e.data_source, e.prompt_token_ids, e.num_prompt_tokens)
        for e in examples
    ]
    digests = [image_digest(e) for e in examples]
    torch.save(
        {"rows": rows, "digests": digests, "checked": checked, "error": error}, f"{out}.rank{world.rank}.pt"
    )


if __name__ == "__main__":
    run_job(main)
