"""Per-rank prompt sampling: which dataset positions each rank rolls out at each step.

`PromptSampler` gives each rank its contiguous share of every global batch of `rollout_batch_size` prompts
(all samples of a prompt stay on its rank, so GRPO groups are rank-local). Each epoch is a permutation of the
dataset; the incomplete tail of an epoch is dropped (drop_last) so every step has a full global batch.
"""

from __future__ import annotations

import torch


class PromptSampler:
    """Per-rank sharding of a global batch of prompts, epoch shuffling, exact resumable state.

    Epoch e is `torch.randperm(num_examples)` from a generator seeded with `seed + e` (identity without
    shuffle); step k of an epoch is the slice [k * global_batch_size, (k + 1) * global_batch_size). The tail
    (num_examples % global_batch_size prompts) is dropped each epoch, so every step has a full batch. Rank r
    gets global uids [r * per_rank, (r + 1) * per_rank) of each batch. Every rank holds the same state.
    """

    def __init__(
        self,
        num_examples: int,
        global_batch_size: int,
        rank: int,
        world_size: int,
        *,
        seed: int,
        shuffle: bool,
    ):
        if global_batch_size <= 0 or world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(
                f"bad sampler sizes: global_batch_size={global_batch_size}, rank={rank}/{world_size}"
            )
        if global_batch_size % world_size:
            raise ValueError(
                f"global batch size {global_batch_size} is not divisible by world size {world_size}"
            )
        if global_batch_size > num_examples:
            raise ValueError(
                f"global batch size (data.rollout_batch_size) {global_batch_size} is larger than the dataset "
                f"({num_examples} examples)"
            )
        self.num_examples, self.global_batch_size = num_examples, global_batch_size
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.per_rank = global_batch_size // world_size
        self._epoch = 0
        self._position = 0  # batches already drawn from the current epoch
        self._order: tuple[int, list[int]] | None = None  # (epoch, permutation) cache

    @property
    def epoch(self) -> int:
        """Epoch of the most recently drawn batch (0 before the first)."""
        return self._epoch

    @property
    def steps_per_epoch(self) -> int:
        return self.num_examples // self.global_batch_size

    def _permutation(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(self.num_examples, generator=generator).tolist()
            else:
                order = list(range(self.num_examples))
            self._order = (epoch, order)
        return self._order[1]

    def next_batch(self) -> list[tuple[int, int]]:
        """This rank's (global_uid_in_step, example_position) pairs for the next step."""
        if self._position >= self.steps_per_epoch:  # drop the tail, start the next epoch
            self._epoch, self._position = self._epoch + 1, 0
        start = self._position * self.global_batch_size
        batch = self._permutation(self._epoch)[start : start + self.global_batch_size]
        self._position += 1
        uids = range(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)
        return [(uid, batch[uid]) for uid in uids]

    def state_dict(self) -> dict:
        return {
            "epoch": self._epoch,
            "position": self._position,
            "num_examples": self.num_examples,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, d: dict) -> None:
        for key in ("num_examples", "global_batch_size", "seed", "shuffle"):
            if d[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state was saved with {key}={d[key]} but this run has {key}={getattr(self, key)}; "
                    "resuming would change the prompt order"
                )
        self._epoch, self._position = int(d["epoch"]), int(d["position"])
