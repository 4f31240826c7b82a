"""DAPO rebalancing: the pickled-object exchange it replaced against the raw-byte tensor exchange, in one run.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 8 benchmarks/dapo_rebalance.py [--prompts-per-rank 8] [--group-size 8]

Every rank holds what one rank of a 64-rank geometry3k job holds after DAPO's filtering: `--gen-batches`
generation batches of `--prompts-per-rank` prompts x `--group-size` samples, each group kept with probability
`--keep` (the same draw on every rank), one `--image`-pixel square RGB image per prompt (geometry3k's ~500 x
500, as smart_resize leaves it for min_pixels 512 x 512: 532 x 532, 1444 patches, 361 image tokens),
responses of 1 to `--max-response` tokens, random token ids and float64 logprobs (`dapo_samples.py`
builds them). The target is `--prompts-per-rank` groups per rank. Three ways, each timed `--reps` times
(the slowest rank's time, median over reps):

  * `object`: the previous code: pixel values attached before filtering, samples pickled with their prompt,
    images and pixel values (`pickle_rebalance`);
  * `tensor+pixels`: `select_and_rebalance` on the same samples (pixel values travel as raw float32 bytes);
  * `tensor+images`: what the trainer does now: no pixel values before rebalancing, only the images travel,
    and each rank runs the image processor on the prompts it received.

The image processor (transformers' Qwen2VLImageProcessor at min_pixels 262144, as the geo3k configs) is timed
apart: before, every generated prompt of a rank was processed (kept or not); now, the received ones.
Bytes are counted from the uint8 `all_to_all_single` calls (to other ranks; a rank's own share does not
cross the network, but the object path pickles and unpickles it too).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.dapo_samples import pickle_rebalance, synthetic_group  # noqa: E402
from spmd_grpo.config.schema import DataConfig  # noqa: E402
from spmd_grpo.data.prompts import processor_sizes  # noqa: E402
from spmd_grpo.parallel.collectives import all_reduce_max, all_reduce_sum, init_distributed  # noqa: E402
from spmd_grpo.rollout.dynamic_sampling import select_and_rebalance  # noqa: E402
from spmd_grpo.rollout.generate import attach_pixel_values  # noqa: E402

BYTES_SENT = [0, 0]  # to other ranks, to itself: counted from uint8 all_to_all_single calls
_all_to_all_single = dist.all_to_all_single


def _counting_all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
    if input.dtype == torch.uint8 and input_split_sizes is not None:
        me = dist.get_rank()
        BYTES_SENT[0] += sum(input_split_sizes) - input_split_sizes[me]
        BYTES_SENT[1] += input_split_sizes[me]
    return _all_to_all_single(output, input, output_split_sizes, input_split_sizes, **kw)


dist.all_to_all_single = _counting_all_to_all_single


def rank_samples(
    rank: int, world_size: int, args: argparse.Namespace, pixel_values: bool
) -> tuple[list, int]:
    """This rank's kept samples and the target (groups); every rank draws the same keep pattern."""
    pattern = np.random.default_rng(1)
    num_prompts = args.prompts_per_rank * world_size
    keys = [
        (gb, uid)
        for gb in range(args.gen_batches)
        for uid in range(num_prompts)
        if pattern.random() < args.keep
    ]
    target = min(len(keys), args.prompts_per_rank * world_size)
    rng = np.random.default_rng(100 + rank)
    samples = []
    for gb, uid in keys:
        if uid // args.prompts_per_rank == rank:
            opts = dict(pixel_values=pixel_values, max_response=args.max_response)
            samples += synthetic_group(uid, gb, args.n, [(args.image, args.image)], rng, **opts)
    return samples, target


def timed(fn, reps: int, device) -> tuple[float, float, object]:
    """(median over reps of the slowest rank's seconds, bytes this rank sent to others per rep, last result)."""
    times, out = [], None
    BYTES_SENT[:] = [0, 0]
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        out = fn()
        times.append(float(all_reduce_max(torch.tensor([time.perf_counter() - start], device=device))))
    return statistics.median(times), BYTES_SENT[0] / reps, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts-per-rank", type=int, default=8)
    # Not `--n`: torchrun's parser reads an abbreviation of its own options after the script name too, and
    # `--n` stopped the command with "ambiguous option: --n could match --nnodes, --nproc-per-node, ...".
    p.add_argument("--group-size", dest="n", type=int, default=8, help="samples per prompt")
    p.add_argument("--gen-batches", type=int, default=2)
    p.add_argument("--keep", type=float, default=0.6)
    p.add_argument("--image", type=int, default=532)
    p.add_argument("--max-response", type=int, default=2048)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    world = init_distributed("cpu")
    from transformers import Qwen2VLImageProcessor

    processor = Qwen2VLImageProcessor(size={"shortest_edge": 262144, "longest_edge": 4194304})
    data = DataConfig(min_pixels=262144, max_pixels=4194304)
    sizes = processor_sizes(data, SimpleNamespace(image_processor=processor), limit_videos=0)
    W, ng = world.world_size, args.gen_batches
    with_pixels, target = rank_samples(world.rank, W, args, pixel_values=True)
    images_only, _ = rank_samples(world.rank, W, args, pixel_values=False)
    rows = {}
    rows["object"] = timed(lambda: pickle_rebalance(with_pixels, target, world), args.reps, world.device)
    rows["tensor+pixels"] = timed(
        lambda: select_and_rebalance(with_pixels, target, world, ng, args.prompts_per_rank * W),
        args.reps,
        world.device,
    )
    rows["tensor+images"] = timed(
        lambda: select_and_rebalance(images_only, target, world, ng, args.prompts_per_rank * W),
        args.reps,
        world.device,
    )
    received = rows["tensor+images"][2]
    # The processor: before, on every generated prompt of the rank; now, on the prompts it received.
    image = received[0].prompt.images[0] if received else with_pixels[0].prompt.images[0]
    before = timed(
        lambda: [processor(images=[image], return_tensors="pt") for _ in range(ng * args.prompts_per_rank)],
        1,
        world.device,
    )[0]
    after = timed(lambda: attach_pixel_values(received, processor, sizes), 1, world.device)[0]
    report(world, args, target, rows, before, after, len({id(s.prompt) for s in received}))


def report(world, args, target, rows, processor_before, processor_after, received_prompts) -> None:
    sent = {
        name: all_reduce_sum(torch.tensor([row[1]], dtype=torch.float64)) / world.world_size
        for name, row in rows.items()
    }
    sent_max = {
        name: all_reduce_max(torch.tensor([row[1]], dtype=torch.float64)) for name, row in rows.items()
    }
    prompts_max = int(all_reduce_max(torch.tensor([received_prompts])))
    if not world.is_main:
        return
    samples = target * args.n // world.world_size
    print(
        f"world {world.world_size}; {args.gen_batches} generation batches x {args.prompts_per_rank} prompts/rank x n={args.n}, "
        f"keep {args.keep}; target {target} groups = {samples} samples/rank; image {args.image}x{args.image}; "
        f"responses 1..{args.max_response} tokens"
    )
    print(
        f"{'path':<15} {'exchange s':>10} {'MB sent/rank (mean, max)':>26} {'processor s':>12} {'total s':>8}"
    )
    for name, (seconds, _, _) in rows.items():
        proc = processor_after if name == "tensor+images" else processor_before
        mb = f"{float(sent[name]) / 1e6:.1f}, {float(sent_max[name]) / 1e6:.1f}"
        print(f"{name:<15} {seconds:>10.3f} {mb:>26} {proc:>12.3f} {seconds + proc:>8.3f}")
    print(
        f"processor: before {args.gen_batches * args.prompts_per_rank} images/rank (every generated prompt); "
        f"now at most {prompts_max} (received prompts)"
    )


if __name__ == "__main__":
    main()
    dist.barrier()
    dist.destroy_process_group()
