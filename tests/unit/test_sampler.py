"""Prompt sampling: per-rank shards of a global batch, epoch shuffling with drop_last, exact resume, size
checks."""

from __future__ import annotations

import pytest

from spmd_grpo.data.sampler import PromptSampler


def _step(samplers: list[PromptSampler]) -> list[list[tuple[int, int]]]:
    return [s.next_batch() for s in samplers]


def test_sampler_shards_a_global_batch():
    samplers = [PromptSampler(20, 8, rank, 4, seed=0, shuffle=True) for rank in range(4)]
    one_rank = PromptSampler(20, 8, 0, 1, seed=0, shuffle=True)  # the same global batches, unsplit
    assert samplers[0].steps_per_epoch == 2
    for _ in range(5):
        per_rank = _step(samplers)
        assert [pos for pairs in per_rank for _, pos in pairs] == [pos for _, pos in one_rank.next_batch()]
        for rank, pairs in enumerate(per_rank):
            assert [uid for uid, _ in pairs] == [2 * rank, 2 * rank + 1]
        positions = [pos for pairs in per_rank for _, pos in pairs]
        assert len(set(positions)) == 8  # distinct prompts, together one global batch
        assert sorted(uid for pairs in per_rank for uid, _ in pairs) == list(range(8))


def test_sampler_epochs_shuffle_and_drop_last():
    sampler = PromptSampler(10, 4, 0, 1, seed=3, shuffle=True)
    epochs = []
    for _ in range(3):
        batches = [[pos for _, pos in sampler.next_batch()] for _ in range(sampler.steps_per_epoch)]
        assert sampler.epoch == len(epochs)
        flat = [p for b in batches for p in b]
        assert len(flat) == 8 and len(set(flat)) == 8  # 2 of 10 dropped, no repeats within an epoch
        epochs.append(flat)
    assert epochs[0] != epochs[1] != epochs[2]
    plain = PromptSampler(10, 4, 0, 1, seed=3, shuffle=False)
    assert [[p for _, p in plain.next_batch()] for _ in range(3)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [0, 1, 2, 3],
    ]
    assert plain.epoch == 1


def test_sampler_resume_is_exact():
    reference = PromptSampler(25, 6, 1, 2, seed=7, shuffle=True)  # 4 steps per epoch
    for _ in range(7):
        reference.next_batch()
    state = reference.state_dict()
    resumed = PromptSampler(25, 6, 1, 2, seed=7, shuffle=True)
    resumed.load_state_dict(state)
    assert resumed.epoch == reference.epoch == 1
    assert [resumed.next_batch() for _ in range(10)] == [reference.next_batch() for _ in range(10)]
    assert reference.epoch == 4
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(25, 6, 1, 2, seed=8, shuffle=True).load_state_dict(state)


def test_sampler_rejects_bad_sizes():
    with pytest.raises(ValueError, match="32.*10"):
        PromptSampler(10, 32, 0, 1, seed=0, shuffle=True)
    with pytest.raises(ValueError, match="divisible"):
        PromptSampler(10, 6, 0, 4, seed=0, shuffle=True)
