"""A group split across 2 real ranks gets the advantages of the single-process computation."""

import torch

from spmd_grpo.algorithm.advantage import compute_batch_std_advantages, compute_grpo_advantages
from tests.conftest import torchrun
from tests.jobs.split_group_advantages import GROUPS, SCORES


def test_split_group_matches_single_process(tmp_path):
    torchrun(["tests/jobs/split_group_advantages.py", str(tmp_path / "adv")], nproc=2)
    parts = [torch.load(tmp_path / f"adv.rank{r}.pt") for r in range(2)]
    expected = {
        "grpo": compute_grpo_advantages(SCORES, GROUPS, 3)[0],
        "drgrpo": compute_grpo_advantages(SCORES, GROUPS, 3, norm_by_std=False)[0],
        "batch_std": compute_batch_std_advantages(SCORES, GROUPS, 3)[0],
    }
    # Hand check of the split group 1 = [0.2, 0.9, 0.4, 0.7, 0.1]: mean 0.46, unbiased std 0.3362...
    g1 = torch.tensor([0.2, 0.9, 0.4, 0.7, 0.1], dtype=torch.float64)
    assert torch.allclose(expected["grpo"][3:8].double(), (g1 - g1.mean()) / (g1.std() + 1e-6), atol=1e-6)
    for name, full in expected.items():
        torch.testing.assert_close(torch.cat([parts[0][name], parts[1][name]]), full, rtol=0, atol=1e-6)
