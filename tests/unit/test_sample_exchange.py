"""The byte layout DAPO rebalancing sends samples in: every Sample field has a way to travel, and a packed
segment unpacks to the same samples, in process (the exchange under torchrun: tests/distributed)."""

import numpy as np
import torch

from spmd_grpo.data.samples import Prompt, Sample
from spmd_grpo.rollout import sample_exchange as ds
from tests.jobs.dapo_rebalance import compare, synthetic_group


def test_every_sample_field_has_a_way_to_travel():
    handled = {"prompt", *ds.LIST_FIELDS, *ds.TENSOR_FIELDS, *ds.TENSOR_TUPLE_FIELDS, *ds.SCALAR_FIELDS}
    handled |= set(ds.TENSOR_DICT_FIELDS)
    assert handled == set(Sample.__dataclass_fields__)


def test_prompt_videos_and_video_inputs_travel_bitwise():
    from spmd_grpo.data.videos import Video

    frames = np.random.default_rng(1).integers(0, 255, (4, 56, 84, 3), dtype=np.uint8)
    meta = {"fps": 2.0, "frames_indices": [0, 1, 2, 3], "total_num_frames": 4, "duration": 2.0}
    prompt = Prompt(uid=3, prompt_token_ids=[1, 2, 3], videos=[Video(frames, meta)])
    inputs = {"pixel_values_videos": torch.randn(24, 8), "video_grid_thw": torch.tensor([[2, 6, 4]])}
    samples = [Sample(prompt, k, [1, 2], [5], [-0.5], video_inputs=inputs) for k in range(2)]
    (_, a), (_, b) = _round_trip([(0, samples[0]), (1, samples[1])])
    assert (
        a.prompt is b.prompt
        and a.video_inputs["pixel_values_videos"] is b.video_inputs["pixel_values_videos"]
    )
    assert np.array_equal(a.prompt.videos[0].frames, frames) and a.prompt.videos[0].metadata == meta
    assert all(torch.equal(a.video_inputs[k], v) for k, v in inputs.items())


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


def test_pixel_values_after_rebalancing_follow_the_prompt_not_its_uid():
    """After rebalancing a rank can hold uid 3 of two generation batches: two prompts, two images."""
    from transformers import Qwen2VLImageProcessor

    from spmd_grpo.config.schema import DataConfig
    from spmd_grpo.data.prompts import processor_sizes
    from spmd_grpo.rollout.generate import attach_pixel_values

    rng = np.random.default_rng(1)
    samples = synthetic_group(3, 0, 2, [(56, 28)], rng, pixel_values=False)
    samples += synthetic_group(3, 1, 2, [(28, 56)], rng, pixel_values=False)
    processor = Qwen2VLImageProcessor()
    sizes = processor_sizes(DataConfig(min_pixels=784, max_pixels=4 * 784), processor, limit_videos=0)
    attach_pixel_values(samples, processor, sizes)
    assert samples[0].pixel_values is samples[1].pixel_values  # once per prompt
    assert samples[2].pixel_values is samples[3].pixel_values
    assert samples[0].image_grid_thw.tolist() == [[1, 2, 4]] and samples[2].image_grid_thw.tolist() == [
        [1, 4, 2]
    ]
    assert not torch.equal(samples[0].pixel_values, samples[2].pixel_values)
