"""Any mix of modalities on any rank (2 ranks, real torchrun, gloo, FSDP2, fp32): text-only prompts, one
image, three images, a video, an image and a video in one prompt, and zero-weight padding micro-batches, on
different ranks in the same micro-batch slot, for every dense family and one MoE model of each generation
(Qwen3-VL-MoE; Qwen3.5-MoE, whose hybrid layers are Qwen3.5's), padded and packed, trained and frozen vision
tower (tests/jobs/mixed_modalities.py; one launch runs every family in turn).

No collective may mismatch (gloo: "Received data size doesn't match"), the forward-only pass must give each
sample the logprobs it gets alone in a plain single-process model, and the update's gradient must be finite.
The negative controls remove the mechanism (`PolicyModule._idle_tower`, the dummy tower call of a
micro-batch without pixels), or only its dummy video call, and expect the job to fail.
"""

import json

import pytest

from tests.conftest import tiny_model, torchrun

JOB = "tests/jobs/mixed_modalities.py"
TOL = 1e-5  # fp32; the two models compute the same sums, but kernels may order them differently
CASES = [f"{scenario}-{tower}-{layout}" for scenario in ("one_rank_text_only", "random")
         for tower in ("trained", "frozen") for layout in ("padded", "packed")]  # fmt: skip


FAMILIES = ["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5_moe"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every family's results, rank by rank, from one launch of the job (one start-up for all of them)."""
    out = tmp_path_factory.mktemp("mixed") / "out"
    torchrun([JOB, *(str(tiny_model(family=f)) for f in FAMILIES), str(out)])
    return [json.loads(out.with_name(f"out.rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_composition_on_every_rank(family, results):
    ranks = [r[str(tiny_model(family=family))] for r in results]
    for r in ranks:
        assert sorted(r) == sorted(CASES)
        for case, result in r.items():
            assert result["logprob_diff_max"] <= TOL, (case, result)
            assert result["grad_finite"], (case, result)
    text_only, images = (
        ranks[1]["one_rank_text_only-trained-padded"],
        ranks[0]["one_rank_text_only-trained-padded"],
    )
    assert text_only["images"] == [0, 0, 0, 0] and 3 in images["images"]
    assert text_only["micro_batch_sizes"][1] == [
        1,
        0,
        0,
        0,
    ]  # three padding micro-batches beside rank 0's images
    assert any(0 in r["random-trained-padded"]["images"] for r in ranks)
    mixes = [
        list(zip(r["random-trained-padded"]["images"], r["random-trained-padded"]["videos"], strict=True))
        for r in ranks
    ]
    assert {(1, 1), (0, 1), (3, 0), (1, 0), (0, 0)} <= set(mixes[0] + mixes[1]), mixes
    assert any((a[1] > 0) != (b[1] > 0) for a, b in zip(*mixes, strict=True)), (
        mixes
    )  # a video beside none, same slot
    # rank 1's padding micro-batches (and its one image-only sample) beside rank 0's videos
    assert ranks[1]["random-trained-padded"]["micro_batch_sizes"][1] == [1, 0, 0, 0]
    assert mixes[0][0] == (1, 1) and mixes[1][0] == (1, 0)


@pytest.mark.parametrize(
    "removed",
    [["--without-idle-tower"], ["--without-idle-video", "--scenarios", "random"]],
    ids=["tower", "video"],
)
def test_without_the_mechanism_the_ranks_disagree(removed, tmp_path):
    proc = torchrun([JOB, str(tiny_model()), str(tmp_path / "out"), *removed], check=False)
    assert proc.returncode != 0
    assert "Received data size doesn't match" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[
        -3000:
    ]
