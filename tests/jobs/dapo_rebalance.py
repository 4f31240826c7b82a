"""torchrun job: DAPO rebalancing through raw-byte tensors equals the pickled-object exchange it replaced.

    torchrun --nproc_per_node 3 tests/jobs/dapo_rebalance.py OUT_PREFIX

Each rank builds synthetic kept samples (`synthetic_samples`: random token ids, float64 logprobs that are not
float32 values, real PIL images, pixel values shared by a prompt's samples), runs the reference
(`pickle_rebalance`: every sample pickled with its prompt and images, as `select_and_rebalance` did before)
and `dynamic_sampling.select_and_rebalance` on copies, and writes `OUT_PREFIX.rank<r>.json`: the mismatches
(`compare`, every field, images and tensors bitwise, which samples share a prompt / a pixel tensor), where
each received sample came from, and whether `compare` catches one flipped image byte.

Scenarios (3 ranks; `uids_per_rank` prompts per rank and generation batch; rank r owns uids
[r * uids_per_rank, (r + 1) * uids_per_rank)):
  * `straddle`: 6 uids, n = 3, 2 generation batches; kept (gen_batch, uid): (0,0) (0,1) (0,4) (1,1) (1,2)
    (1,3), target 5 (the last one is surplus). Positions 0-14 cut into 3 x 5: group (0,1) straddles ranks 0
    and 1, group (1,1) ranks 1 and 2; rank 0 receives nothing from ranks 1 and 2; uid 1 appears in both
    generation batches (different prompts, different images); uid 1 has 2 images, uid 4 none (text only).
  * `random`: 9 uids, n = 4, 3 generation batches, each group kept with probability 0.5; prompts with 0-2
    images, a palette ('P') image with `info`, prompts without pixel values (attached after rebalancing), and
    samples carrying image features and old logprobs.
"""

from __future__ import annotations

import copy
import json
import sys

import numpy as np
import torch
from PIL import Image

from benchmarks.dapo_samples import pickle_rebalance, synthetic_group
from spmd_grpo.data.samples import Prompt, Sample
from spmd_grpo.parallel.collectives import init_distributed
from spmd_grpo.rollout.dynamic_sampling import select_and_rebalance
from tests.jobs.common import run_job


# ------------------------------------------------------------------------------------------ comparison
def _image_key(img: Image.Image) -> tuple:
    return (img.mode, img.size, img.getpalette(), dict(img.info), img.tobytes())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))
        )  # fmt: skip
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Image.Image) and isinstance(b, Image.Image):
        return _image_key(a) == _image_key(b)
    return type(a) is type(b) and a == b


def compare(got: list[Sample], want: list[Sample]) -> list[str]:
    """Every difference between two ranks' rebalanced samples: fields, prompts, and what the samples share."""
    if len(got) != len(want):
        return [f"{len(got)} samples, expected {len(want)}"]
    out = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        for name in Sample.__dataclass_fields__:
            if name != "prompt" and not _same(getattr(g, name), getattr(w, name)):
                out.append(f"sample {i}: {name} differs")
        for name in Prompt.__dataclass_fields__:
            if not _same(getattr(g.prompt, name), getattr(w.prompt, name)):
                out.append(f"sample {i}: prompt.{name} differs")
    for field in ("prompt", "pixel_values", "image_grid_thw"):
        shared_got = [[getattr(a, field) is getattr(b, field) for b in got] for a in got]
        shared_want = [[getattr(a, field) is getattr(b, field) for b in want] for a in want]
        if shared_got != shared_want:
            out.append(f"samples sharing {field} differ")
    return out


# ---------------------------------------------------------------------------------------------- the job
def straddle(rank: int, rng: np.random.Generator) -> tuple[list[Sample], int, int, int]:
    kept = {
        (0, 0): [(60, 40)],
        (0, 1): [(30, 30), (90, 50)],
        (0, 4): [],
        (1, 1): [(50, 70)],
        (1, 2): [(40, 40)],
    }
    kept[(1, 3)] = [(28, 28)]
    groups = [(key, sizes) for key, sizes in sorted(kept.items()) if key[1] // 2 == rank]
    return [s for (gb, uid), sizes in groups for s in synthetic_group(uid, gb, 3, sizes, rng)], 5, 2, 6


def random_groups(rank: int, rng: np.random.Generator) -> tuple[list[Sample], int, int, int]:
    """Every rank draws the same keep pattern (seeded alike), then builds only its own groups."""
    pattern = np.random.default_rng(7)
    keys = [(gb, uid) for gb in range(3) for uid in range(9) if pattern.random() < 0.5]
    target = len(keys) // 3 * 3 - 3  # n = 4 on 3 ranks: a multiple of 3 groups splits evenly; 3 surplus
    samples = []
    for gb, uid in keys:
        num_images = int(pattern.integers(0, 3))
        sizes = [tuple(int(x) for x in pattern.integers(20, 120, 2)) for _ in range(num_images)]
        opts = dict(pixel_values=uid % 3 != 0, extras=uid % 2 == 0, palette=uid == 5, max_response=200)
        group = synthetic_group(uid, gb, 4, sizes, rng, **opts)  # every rank draws: same random stream
        if uid // 3 == rank:
            samples += group
    return samples, target, 3, 9


def main() -> None:
    world = init_distributed("cpu")
    results = {}
    for name, build in [("straddle", straddle), ("random", random_groups)]:
        samples, target, num_gen_batches, num_prompts = build(world.rank, np.random.default_rng(0))
        want = pickle_rebalance(copy.deepcopy(samples), target, world)
        got = select_and_rebalance(copy.deepcopy(samples), target, world, num_gen_batches, num_prompts)
        flipped = copy.deepcopy(got)
        with_image = [s for s in flipped if s.prompt.images]
        if with_image:  # one pixel's first byte + 1: `compare` must see it
            img = with_image[-1].prompt.images[-1]
            px = img.getpixel((0, 0))
            img.putpixel((0, 0), (px + 1) % 16 if img.mode == "P" else ((px[0] + 1) % 256, *px[1:]))
        results[name] = {
            "mismatches": compare(got, want),
            "flipped_pixel_caught": bool(with_image) and compare(flipped, want) != [],
            "received": [(s.gen_batch, s.prompt.uid, s.sample_index, s.group_index) for s in got],
            "num_images": sum(len(s.prompt.images) for s in got),
        }
    with open(f"{sys.argv[1]}.rank{world.rank}.json", "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    run_job(main)
