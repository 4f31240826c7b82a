"""torchrun job: GRPO advantages when one prompt's group is split across ranks (real gloo collectives).

    torchrun --nproc_per_node 2 tests/jobs/split_group_advantages.py OUT_PREFIX

Global batch: 3 groups. Group 0 lives on rank 0, group 2 on rank 1, and group 1 is split: 3 samples on rank 0
and 2 on rank 1 (as after TP scatter or DAPO rebalancing). Each rank saves its advantages.
"""

import sys

import torch

from spmd_grpo.algorithm.advantage import compute_batch_std_advantages, compute_grpo_advantages
from spmd_grpo.parallel.collectives import all_reduce_sum, init_distributed
from tests.jobs.common import run_job

SCORES = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9, 0.4, 0.7, 0.1, 0.3, 1.0, 0.0, 0.6])
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2])
RANK_SLICES = [slice(0, 6), slice(6, 12)]  # rank 0: group 0 + 3 of group 1; rank 1: 2 of group 1 + group 2


def main() -> None:
    """Runs only under torchrun: importing this module (the test does, for SCORES/GROUPS) must not
    create a process group or touch the environment of the importing process."""
    world = init_distributed("cpu")
    mine = RANK_SLICES[world.rank]
    out = {}
    for name, fn, kwargs in [
        ("grpo", compute_grpo_advantages, {}),
        ("drgrpo", compute_grpo_advantages, {"norm_by_std": False}),
        ("batch_std", compute_batch_std_advantages, {}),
    ]:
        adv, _ = fn(SCORES[mine], GROUPS[mine], 3, all_reduce_sum=all_reduce_sum, **kwargs)
        out[name] = adv
    torch.save(out, f"{sys.argv[1]}.rank{world.rank}.pt")


if __name__ == "__main__":
    run_job(main)
