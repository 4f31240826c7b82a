"""GPU tier job: the default process group that `init_distributed("cuda")` creates reduces host tensors (the
bookkeeping collectives: counts, metric sums, timers) and device tensors (FSDP, the weight push). Each rank
contributes rank + 1, so the sums show that every rank took part. Prints one JSON line per rank; exits
non-zero when either collective fails."""

import json

import torch
import torch.distributed as dist

from spmd_grpo.parallel.collectives import init_distributed
from tests.jobs.common import run_job


def main() -> None:
    world = init_distributed("cuda")
    host = torch.full((2,), float(world.rank + 1))
    dist.all_reduce(host)
    device = torch.full((2,), float(world.rank + 1), device=world.device)
    dist.all_reduce(device)
    report = {"backend": str(dist.get_backend()), "world": world.world_size}
    print(json.dumps({**report, "host": host.tolist(), "device": device.tolist()}))


if __name__ == "__main__":
    run_job(main)
