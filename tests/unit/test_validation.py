"""`data.val_batch_size`: validation generates in batches of that many prompts over all ranks, and every rank
runs the same number of batches (the ranks of a TP group gather each batch together, so unequal counts hang);
the metric names and values validation reports."""

import pytest
import torch

from spmd_grpo.data.samples import Prompt, Sample
from spmd_grpo.rollout import validation
from spmd_grpo.rollout.validation import _batches, _generations, _metrics


def test_whole_set_in_one_batch_by_default():
    assert _batches(["a", "b", "c"], 5, 2, -1) == [["a", "b", "c"]]


def test_batches_of_val_batch_size_over_the_ranks():
    # 5 examples over 2 ranks (strided: 3 and 2 prompts), 4 prompts per batch = 2 per rank: 2 batches each.
    assert _batches(["e0", "e2", "e4"], 5, 2, 4) == [["e0", "e2"], ["e4"]]
    assert _batches(["e1", "e3"], 5, 2, 4) == [["e1", "e3"], []]


def test_same_number_of_batches_on_every_rank():
    for num_examples in range(1, 12):
        for batch_size in (1, 2, 3, 5, 1024):
            shares = [list(range(r, num_examples, 3)) for r in range(3)]
            counts = {len(_batches(share, num_examples, 3, batch_size)) for share in shares}
            assert len(counts) == 1, (num_examples, batch_size, counts)
            for share in shares:  # nothing lost or repeated
                assert sum(_batches(share, num_examples, 3, batch_size), []) == share


def _val_samples(sources: list[str]) -> list[Sample]:
    return [
        Sample(Prompt(i, [1], extra={"data_source": src}), 0, [1], [2], [-0.1])
        for i, src in enumerate(sources)
    ]


def test_core_metric_is_the_accuracy_under_acc_and_the_reward_under_reward():
    # verl's val-core variable is `acc` when the reward returns one, else `reward`: a reward without an
    # accuracy must not be reported as an accuracy.
    samples = _val_samples(["geo", "geo", "chart"])
    with_acc = {"overall": torch.tensor([0.9, 0.1, 1.0]), "accuracy": torch.tensor([1.0, 0.0, 1.0])}
    m = _metrics(samples, with_acc, 1)
    assert m["val-core/geo/acc/mean@1"] == pytest.approx(0.5)
    assert m["val-core/chart/acc/mean@1"] == pytest.approx(1.0)
    assert m["val/reward/overall"] == pytest.approx(2.0 / 3)
    no_acc = {"overall": torch.tensor([0.9, 0.1, 1.0])}
    m = _metrics(samples, no_acc, 1)
    assert not [k for k in m if "/acc/" in k]
    assert m["val-core/geo/reward/mean@1"] == pytest.approx(0.5)
    assert m["val-core/chart/reward/mean@1"] == pytest.approx(1.0)


def test_the_logged_generations_are_the_sets_first_at_any_world_size(monkeypatch):
    """The table's rows are the first generations of the set (example, then sample), not of rank 0's strided
    share: a resume at another world size logs the same examples as the run it continues."""
    samples = [
        Sample(Prompt(i, [1], extra={"data_source": "c", "problem": f"p{i}"}), k, [1], [2], [-0.1],
               response_text=f"r{i}.{k}")
        for i in range(5) for k in range(2)
    ]  # fmt: skip
    rewards = torch.arange(10, dtype=torch.float32)

    def logged(world_size: int) -> list[str]:
        shares = [
            [j for j, s in enumerate(samples) if s.prompt.uid % world_size == r] for r in range(world_size)
        ]
        sent = []  # what each rank gives the all-gather, then the gather's answer on rank 0
        monkeypatch.setattr(validation, "all_gather_objects", lambda obj: sent.append(obj) or [obj])
        for share in shares:
            _generations([samples[j] for j in share], {"overall": rewards[share]}, 3)
        monkeypatch.setattr(validation, "all_gather_objects", lambda obj: sent)
        rows = _generations([samples[j] for j in shares[0]], {"overall": rewards[shares[0]]}, 3)
        return [(r["response"], r["score"]) for r in rows]

    assert logged(1) == logged(2) == logged(3) == [("r0.0", 0.0), ("r0.1", 1.0), ("r1.0", 2.0)]
