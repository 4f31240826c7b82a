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
import pickle
import sys

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image

from spmd_grpo.distributed import World, all_gather_objects, init_distributed
from spmd_grpo.dynamic_sampling import select_and_rebalance
from spmd_grpo.rollout import Prompt, Sample
from tests.jobs.common import run_job

PATCH_DIM = 1176  # 3 channels x 2 frames x 14 x 14: Qwen2.5-VL's pixel_values row


# --------------------------------------------------------------------------------- the reference (before)
def exchange_objects(per_destination: list[list]) -> list[list]:
    """The object exchange `select_and_rebalance` used: pickle per destination, all_to_all of sizes and bytes."""
    world = dist.get_world_size()
    payloads = [pickle.dumps(objs, protocol=pickle.HIGHEST_PROTOCOL) for objs in per_destination]
    send_sizes = torch.tensor([len(p) for p in payloads], dtype=torch.long)
    recv_sizes = torch.empty_like(send_sizes)
    dist.all_to_all_single(recv_sizes, send_sizes)
    blob = b"".join(payloads)
    send = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
    recv = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8)
    dist.all_to_all_single(recv, send, recv_sizes.tolist(), send_sizes.tolist())
    out, offset = [], 0
    for size in recv_sizes.tolist():
        out.append(pickle.loads(recv[offset : offset + size].numpy().tobytes()))
        offset += size
    assert len(out) == world
    return out


def pickle_rebalance(samples: list[Sample], target: int, world: World) -> list[Sample]:
    """`select_and_rebalance` as it was: sizes through all_gather_object, samples through pickle."""
    sizes: dict[tuple[int, int], int] = {}
    for s in samples:
        key = (s.gen_batch, s.prompt.uid)
        sizes[key] = sizes.get(key, 0) + 1
    everyone = sorted(kv for part in all_gather_objects(sorted(sizes.items())) for kv in part)
    selected = everyone[:target]
    per_rank = sum(size for _, size in selected) // world.world_size
    offset, order, position = {}, {}, 0
    for index, (key, size) in enumerate(selected):
        offset[key], order[key] = position, index
        position += size
    per_destination: list[list[tuple[int, Sample]]] = [[] for _ in range(world.world_size)]
    for s in sorted(samples, key=lambda s: (s.gen_batch, s.prompt.uid, s.sample_index)):
        key = (s.gen_batch, s.prompt.uid)
        if key in offset:
            s.group_index = order[key]
            pos = offset[key] + s.sample_index
            per_destination[pos // per_rank].append((pos, s))
    received = [item for part in exchange_objects(per_destination) for item in part]
    return [s for _, s in sorted(received, key=lambda item: item[0])]


# ------------------------------------------------------------------------------------ synthetic samples
def grid_of(image: Image.Image) -> list[int]:
    """Qwen2.5-VL's (t, h, w) patch grid of an image (14-pixel patches, 2 x 2 merged)."""
    w, h = image.size
    return [1, 2 * -(-h // 28), 2 * -(-w // 28)]


def synthetic_group(
    uid: int, gen_batch: int, n: int, image_sizes: list[tuple[int, int]], rng: np.random.Generator, **opts
) -> list[Sample]:
    """One prompt's n samples as the rollout leaves them. `opts`: `pixel_values` (attach them, default
    True), `max_response` (default 64), `extras` (image features and old logprobs), `palette` (a 'P' image)."""
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in image_sizes]
    if opts.get("palette") and images:
        images[0] = images[0].convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
        images[0].info["note"] = f"uid {uid}"
    grids = [grid_of(img) for img in images]
    image_tokens = sum(t * h * w // 4 for t, h, w in grids)
    prompt = Prompt(
        uid,
        rng.integers(0, 150_000, 40).tolist(),
        images,
        f"answer {uid}",
        {"data_source": "geo", "problem": "?"},
    )
    pixel_values = grid = None
    if images and opts.get("pixel_values", True):
        num_patches = sum(t * h * w for t, h, w in grids)
        pixel_values = torch.from_numpy(rng.standard_normal((num_patches, PATCH_DIM), dtype=np.float32))
        grid = torch.tensor(grids, dtype=torch.long)
    prompt_ids = rng.integers(0, 150_000, 40 + image_tokens).tolist()
    out = []
    for k in range(n):
        length = int(rng.integers(1, opts.get("max_response", 64) + 1))
        s = Sample(
            prompt, k, list(prompt_ids), rng.integers(0, 150_000, length).tolist(),
            rng.standard_normal(length).tolist(), response_text=f"resp é {uid}.{k}",
            finish_reason=["stop", "length"][k % 2], pixel_values=pixel_values, image_grid_thw=grid,
            gen_batch=gen_batch, group_index=uid, scores={"overall": float(k % 2), "accuracy": k / 3},
        )  # fmt: skip
        if opts.get("extras") and k % 2 == 0:
            s.old_logprobs = torch.randn(length, generator=torch.Generator().manual_seed(k))
            s.image_features = tuple(torch.full((2, 4), float(i)) for i in range(len(images))) or None
        out.append(s)
    return out


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
