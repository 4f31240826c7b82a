"""Synthetic DAPO samples and the pickled-object rebalance the raw-byte exchange replaced: shared by
`benchmarks/dapo_rebalance.py` (what it times) and `tests/jobs/dapo_rebalance.py` (the reference it compares with).
"""

from __future__ import annotations

import pickle

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image

from spmd_grpo.data.samples import Prompt, Sample
from spmd_grpo.parallel.collectives import World, all_gather_objects

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
