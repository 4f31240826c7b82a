"""DAPO rebalancing moves samples as raw-byte tensors and gives every rank exactly what the pickled-object
exchange gave (3 real ranks, gloo; the scenarios are in tests/jobs/dapo_rebalance.py)."""

import json

from tests.conftest import torchrun

JOB = "tests/jobs/dapo_rebalance.py"


def test_tensor_rebalance_equals_object_rebalance(tmp_path):
    torchrun([JOB, str(tmp_path / "out")], nproc=3)
    ranks = [json.loads((tmp_path / f"out.rank{r}.json").read_text()) for r in range(3)]
    for name in ("straddle", "random"):
        assert [r[name]["mismatches"] for r in ranks] == [[], [], []], name
        # The comparison sees a single changed image byte wherever a rank holds an image.
        assert all(r[name]["flipped_pixel_caught"] for r in ranks if r[name]["num_images"]), name
        assert sum(r[name]["num_images"] for r in ranks) > 0
    # Groups (gen_batch, uid) in global order (0,0) (0,1) (0,4) (1,1) (1,2); (1,3) is surplus. 15 samples in
    # 3 x 5: (0,1) straddles ranks 0-1, (1,1) ranks 1-2; rank 0 gets nothing from ranks 1 and 2.
    received = [[tuple(x) for x in r["straddle"]["received"]] for r in ranks]
    assert received == [
        [(0, 0, 0, 0), (0, 0, 1, 0), (0, 0, 2, 0), (0, 1, 0, 1), (0, 1, 1, 1)],
        [(0, 1, 2, 1), (0, 4, 0, 2), (0, 4, 1, 2), (0, 4, 2, 2), (1, 1, 0, 3)],
        [(1, 1, 1, 3), (1, 1, 2, 3), (1, 2, 0, 4), (1, 2, 1, 4), (1, 2, 2, 4)],
    ]
    random = [[tuple(x) for x in r["random"]["received"]] for r in ranks]
    assert len({len(part) for part in random}) == 1  # every rank trains on as many samples
    flat = [x for part in random for x in part]
    assert [x[3] for x in flat] == sorted(x[3] for x in flat)  # group indices in global order
    assert sorted({x[3] for x in flat}) == list(range(len(flat) // 4))  # whole groups of n = 4
