"""Invariance of the update under real torchrun (fp32, tiny model): micro-batches 1x8 vs 8x1, world 1 vs 2,
token-budget micro-batches (even and uneven per-rank token counts, with zero-weight padding micro-batches),
and old logprobs taken from the update's own forward vs a separate forward-only pass.

Losses are normalised by GLOBAL token/sequence counts, so the gradient of a mini-batch must not depend on
how it is split. verl's legacy mean of micro-batch means would fail these (short micro-batches weigh more).
Two torchrun launches (world 1 and world 2) compute every (mode, micro-batch size) case between them.
"""

import pytest
import torch

from tests.conftest import tiny_model, torchrun

MODES = ["token-mean", "seq-mean-token-mean"]
# 1: one sample per micro-batch, rank 0 (3 samples when uneven) pads to rank 1's 5; 86: rank 0's 4 samples
# (172 prompt+response tokens) need 2 micro-batches and rank 1's (180) need 3, agreed to 3.
BUDGETS = [1, 86]


@pytest.fixture(scope="module")
def grads(tiny_untied, tmp_path_factory):
    """{(world, mode, micro): gradient} for world 1 (micro 8 and 1) and world 2 (micro 4 and 1), token
    budgets of 1 and 86 tokens on both, the on-policy old-logprob cases on world 2, and
    {(world, variant): gradient} for the packed / frozen-tower / reused-feature variants."""
    out = {}
    for world, micros in [(1, "8,1"), (2, "4,1")]:
        path = tmp_path_factory.mktemp("grads") / f"w{world}.pt"
        job = ["tests/jobs/grad_invariance.py", str(tiny_untied), str(path), "--micro", micros]
        job += ["--budgets", ",".join(map(str, BUDGETS))]
        job += ["--fused"] if world == 2 else []
        torchrun([*job, "--modes", ",".join(MODES), "--variants"], nproc=world)
        out.update({(world, *key): g for key, g in torch.load(path).items()})
    return out


def _max_rel(a, b):
    worst = 0.0
    for name in a:
        if name.startswith("__"):
            continue
        denom = a[name].norm().item()
        if denom > 0:
            worst = max(worst, (a[name] - b[name]).norm().item() / denom)
    return worst


def test_moe_and_hybrid_gradient_does_not_depend_on_the_micro_batch(tmp_path):
    """Qwen3.5-MoE (routed experts with no capacity, a shared expert, Gated DeltaNet layers), 2 ranks: one
    sample per micro-batch and 4 per micro-batch give the same gradient, padded and packed (a token's
    experts and its linear-attention state depend on its own sequence only); with expert parallelism
    (worker.actor.fsdp.expert_parallel_size=2) the policy, its LoRA adapters and the reference give the
    numbers of EP=1."""
    path = tmp_path / "moe.pt"
    job = [
        "tests/jobs/grad_invariance.py",
        str(tiny_model(family="qwen3_5_moe")),
        str(path),
        "--micro",
        "4,1",
    ]
    job += ["--modes", "token-mean", "--budgets", "86", "--variants", "--expert-parallel"]
    torchrun(job, nproc=2)
    g = torch.load(path)
    assert _max_rel(g["token-mean", 4], g["token-mean", 1]) <= 1e-5
    assert _max_rel(g["token-mean", 4], g["token-mean", "budget86"]) <= 1e-5
    assert _max_rel(g["token-mean", 1], g["packed",]) <= 1e-5
    assert any(".experts." in n and t.abs().max() > 0 for n, t in g["token-mean", 1].items())
    # The trainer's policy with expert_parallel_size=2 (each rank 4 of the 8 experts, all-to-all dispatch,
    # the experts' FSDP over the remaining rank, gradients averaged over the data-parallel ranks): every
    # gradient and the clipping norm of EP=1, per-micro-batch and with the mini-batch's micro-batches.
    for micro in (4, 1):
        unsharded, sharded = g["token-mean", micro], g["ep", micro]
        assert set(unsharded) == set(sharded) and any(n.endswith("experts.gate_up_proj") for n in sharded)
        assert all(t.abs().max() > 0 for n, t in sharded.items() if n.endswith("experts.down_proj"))
        assert _max_rel(unsharded, sharded) <= 1e-5, micro
        norm = unsharded["__clip_grad_norm__"].item()
        assert abs(sharded["__clip_grad_norm__"].item() - norm) <= 1e-5 * norm
    # The reference (forward only, built as the trainer builds it) at EP=2: the EP=1 policy's logprobs.
    assert len(g["ep-ref", 2]) == 4 and sum(t.numel() for t in g["ep-ref", 2]) > 0
    for a, b in zip(g["ep-ref", 1], g["ep-ref", 2], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    # LoRA on the frozen expert-parallel base: the adapters' gradients (reaching the layers below the
    # experts through the all-to-all's backward) are those of EP=1.
    lora1, lora2 = g["ep-lora", 1], g["ep-lora", 2]
    assert set(lora1) == set(lora2) and len(lora2) > 10
    assert all(".lora_" in n for n in lora2 if not n.startswith("__"))
    assert _max_rel(lora1, lora2) <= 1e-5


@pytest.mark.parametrize("mode", MODES)
def test_gradient_same_for_micro_batches_and_world_size(grads, mode):
    one_by_eight, eight_by_one = grads[1, mode, 8], grads[1, mode, 1]
    two_ranks, two_ranks_micro1 = grads[2, mode, 4], grads[2, mode, 1]
    assert set(one_by_eight) == set(two_ranks) and len(one_by_eight) > 10
    assert any(g.abs().max() > 0 for g in one_by_eight.values())
    assert _max_rel(one_by_eight, eight_by_one) <= 1e-5
    assert _max_rel(one_by_eight, two_ranks) <= 1e-5
    assert _max_rel(one_by_eight, two_ranks_micro1) <= 1e-5
    # Gradient clipping sees the true global norm: equal to the full gradient's norm, on 1 or 2 ranks.
    full_norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g) for n, g in one_by_eight.items() if not n.startswith("__")])
    )
    for g in (one_by_eight, two_ranks):
        assert abs(g["__clip_grad_norm__"].item() - full_norm.item()) <= 1e-5 * full_norm.item()


def test_modes_give_different_gradients(grads):
    """The two aggregation modes weigh tokens differently: the cases above compare distinct gradients."""
    assert _max_rel(grads[1, MODES[0], 8], grads[1, MODES[1], 8]) > 1e-3


@pytest.mark.parametrize("world", [1, 2])
def test_gathering_once_per_pass_or_per_micro_batch_gives_the_same_gradient(grads, world):
    """FSDP's per-micro-batch gather and reduction (accelerators) and the CPU's gather once per pass with one
    reduction of the accumulated gradient: the same sum of the same micro-batch gradients."""
    assert _max_rel(grads[world, "token-mean", 1], grads[world, "other_gathering"]) <= 1e-5


@pytest.mark.parametrize("world", [1, 2])
def test_packed_forward_and_reused_image_features_keep_the_gradient_under_fsdp(grads, world):
    """Packed micro-batches give the padded gradient; with a frozen vision tower, image features encoded
    once per step give the gradient of encoding in every forward, also when the ranks have different
    numbers of images to encode (world 2: dummy images keep the tower's collectives aligned)."""
    assert _max_rel(grads[world, "token-mean", 1], grads[world, "packed"]) <= 1e-5
    frozen, reused = grads[world, "frozen"], grads[world, "reuse"]
    assert set(frozen) == set(reused) and not any(".visual." in n for n in frozen)
    assert any(".visual." in n for n in grads[world, "packed"])
    assert _max_rel(frozen, reused) <= 1e-5


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("split", ["micro2", "budget45"])
def test_shared_prompt_keeps_the_gradient_under_fsdp(grads, world, split):
    """Each group's prompt held once (FSDP2, trained tower): the gradient of holding it per sample, also
    when a token budget cuts a group, and the same on 1 and 2 ranks."""
    unshared, shared = grads[world, "shared", split, False], grads[world, "shared", split, True]
    assert any(".visual." in n for n in shared) and any(g.abs().max() > 0 for g in shared.values())
    assert _max_rel(unshared, shared) <= 1e-5
    assert _max_rel(grads[1, "shared", split, True], shared) <= 1e-5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("budget", BUDGETS)
def test_gradient_same_with_token_budget_micro_batches(grads, mode, budget):
    reference = grads[1, mode, 8]
    for world in (1, 2):
        for case in (f"budget{budget}", f"budget{budget}-uneven"):
            assert _max_rel(reference, grads[world, mode, case]) <= 1e-5, (world, case)
            g = grads[world, mode, case]["__clip_grad_norm__"].item()
            assert abs(g - reference["__clip_grad_norm__"].item()) <= 1e-5 * g


def test_old_logprobs_from_update_forward_are_exact(grads):
    """On an on-policy mini-batch (2 ranks, FSDP2, 2 micro-batches each), old logprobs from the update's
    own forward give the same gradient, losses and old logprobs as a separate forward-only pass."""
    (g_sep, sums_sep, old_sep), (g_fwd, sums_fwd, old_fwd) = (
        grads[2, "fused", "separate"],
        grads[2, "fused", "forward"],
    )
    assert set(g_sep) == set(g_fwd) and any(g.abs().max() > 0 for g in g_sep.values())
    for name in g_sep:
        assert torch.equal(g_sep[name], g_fwd[name]), name
    assert sums_sep == sums_fwd and sums_sep["actor/pg_loss"][0] != 0
    assert len(old_fwd) == 8 and all(torch.equal(a, b) for a, b in zip(old_sep, old_fwd, strict=True))
