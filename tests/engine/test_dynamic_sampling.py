"""DAPO dynamic sampling under real torchrun with 2 ranks that keep different numbers of groups.

A user reward (loaded from a file, `path.py:fn`) gives accuracy spread only to prompt uids 0 and 1 of each
generation batch, which both live on rank 0: rank 0 keeps 2 groups per generation batch, rank 1 keeps none.
Reaching 4 groups needs 2 generation batches; the kept groups must then be rebalanced so that both ranks run
the same number of micro-batches (otherwise FSDP's collectives would hang). The run shares one launch with
the session's other training runs (the `trained` fixture).
"""

import json
from pathlib import Path

import pytest

from tests.conftest import tiny_model, trainer_run

REWARD = """
def reward(samples):
    out = []
    for s in samples:
        acc = float(s["sample_index"] % 2) if s["uid"] < 2 else 0.0
        out.append({"overall": acc, "accuracy": acc})
    return out
"""


def _arguments(work: Path) -> list[str]:
    reward_file = work / "uneven_reward.py"
    reward_file.write_text(REWARD)
    return [
        "configs/smoke_dapo.yaml",
        f"worker.actor.model.model_path={tiny_model()}", f"trainer.output_dir={work}",
        "trainer.experiment_name=dapo", "trainer.max_steps=2", "trainer.val_before_train=false",
        "trainer.val_freq=-1", f"worker.reward.reward_function={reward_file}:reward",
        "data.rollout_batch_size=4", "worker.rollout.n=2", "algorithm.filter_groups.train_batch_size=4",
        "algorithm.filter_groups.max_num_gen_batches=5", "worker.actor.global_batch_size=8",
        "worker.actor.micro_batch_size_per_device_for_update=2",
    ]  # fmt: skip


RUN = trainer_run("dapo_uneven_groups", __file__, _arguments)


def test_ranks_keeping_different_group_counts_train_in_step(trained):
    work, _ = trained(RUN)
    rows = [json.loads(line) for line in (work / "dapo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train/num_gen_batches"] == 2  # > 1: the first batch did not hold enough groups
        assert r["train/kept_group_frac"] == pytest.approx(0.5)  # 4 kept of 8 generated
        # Both ranks ran the same number of forward/backward passes: 8 samples / 2 ranks / micro 2.
        assert r["train/num_micro_batches_min"] == r["train/num_micro_batches_max"] == 2
        assert (
            r["timing_s/rebalance"] > 0 and r["timing_s/pixel_values"] > 0
        )  # kept samples moved, then processed
        # The trained batch holds only groups with spread: half the samples are accurate. The score also
        # carries the overlong shaping (4-token responses, buffer 2, factor 0.1: -0.1 each).
        assert r["reward/accuracy"] == pytest.approx(0.5)
        assert r["reward/overlong_penalty"] == pytest.approx(-0.1)
        assert r["critic/score/mean"] == pytest.approx(0.5 - 0.1)
