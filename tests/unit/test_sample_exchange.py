"""The byte layout DAPO rebalancing sends samples in: every Sample field has a way to travel, and a packed
segment unpacks to the same samples, in process (the exchange under torchrun: tests/distributed)."""

import numpy as np
import torch

from spmd_grpo import dynamic_sampling as ds
from spmd_grpo.rollout import Sample
from tests.jobs.dapo_rebalance import compare, synthetic_group


def test_every_sample_field_has_a_way_to_travel():
    handled = {"prompt", *ds.LIST_FIELDS, *ds.TENSOR_FIELDS, *ds.TENSOR_TUPLE_FIELDS, *ds.SCALAR_FIELDS}
    assert handled == set(Sample.__dataclass_fields__)


def _round_trip(items):
    header, packer = ds._pack(items)
    segment = torch.empty(ds._segment_size(header, packer), dtype=torch.uint8)
    ds._write_segment(segment, header, packer)
    return ds._unpack(segment)


def test_packed_samples_unpack_identical_and_share_what_they_shared():
    rng = np.random.default_rng(0)
    samples = synthetic_group(3, 1, 4, [(50, 30), (28, 60)], rng, extras=True, palette=True)
    samples += synthetic_group(3, 2, 2, [], rng) + synthetic_group(
        4, 2, 3, [(40, 40)], rng, pixel_values=False
    )
    got = _round_trip(list(enumerate(samples)))
    assert [pos for pos, _ in got] == list(range(len(samples)))
    assert compare([s for _, s in got], samples) == []
    assert got[0][1].pixel_values is got[3][1].pixel_values  # one tensor per prompt, as before packing
    assert got[0][1].prompt is not got[4][1].prompt  # same uid, other generation batch: another prompt
    got[0][1].prompt.images[1].putpixel((0, 0), (1, 2, 3))
    assert compare([s for _, s in got], samples) != []
