"""MoE compute and routing controls on tiny random Qwen3-VL-MoE and Qwen3.5-MoE models built in memory (fp32).

* Grouped experts (models/moe/experts.py), with `F.grouped_mm` and with the looped fallback, give the
  logprobs and every parameter's gradient of transformers' eager experts (<= 1e-5 relative).
* Routing replay: a router with near ties flips experts between two trainer passes; replaying the first
  pass's routes makes the second pass's logprobs (the step-start importance ratio) exactly equal.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

from spmd_grpo.actor.micro_batches import collate_for
from spmd_grpo.models.moe import experts as experts_module
from spmd_grpo.models.moe.install import install_moe, moe_blocks
from tests.jobs.common import logprobs, moe_tokens, tiny_moe_model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5_moe"])
@pytest.mark.parametrize("backend", ["grouped_mm", "looped"])
def test_grouped_experts_equal_eager(family, backend):
    eager = tiny_moe_model(family)
    ours = copy.deepcopy(eager)
    assert install_moe(ours) is not None and len(moe_blocks(ours)) == 2
    ids, mask = moe_tokens()
    weights = torch.randn(ids.shape[0], ids.shape[1] - 1, generator=torch.Generator().manual_seed(2))
    lp_eager = logprobs(eager, ids, mask)
    (lp_eager * weights).sum().backward()
    runs = (lambda *_: False) if backend == "looped" else experts_module._grouped_mm_runs
    with mock.patch.object(experts_module, "_grouped_mm_runs", runs):
        lp_ours = logprobs(ours, ids, mask)
        (lp_ours * weights).sum().backward()
    assert _rel(lp_ours, lp_eager) <= 1e-5
    grads = dict(eager.named_parameters())
    checked = 0
    for name, p in ours.named_parameters():
        ref = grads[name].grad
        if ref is None:  # the vision tower: not in a text-only forward
            assert p.grad is None, name
            continue
        assert _rel(p.grad, ref) <= 1e-5, name
        checked += 1
    assert checked >= 12  # experts, routers, attention, norms, embeddings, head
    assert any(n.endswith("experts.gate_up_proj") for n, p in ours.named_parameters() if p.grad is not None)


def test_grouped_mm_path_is_taken_on_this_cpu():
    """The exactness test above covers the kernel the CPU actually runs (not only the fallback)."""
    assert experts_module._grouped_mm_runs("cpu", torch.float32)


# ------------------------------------------------------------------------------------------- routing replay
@pytest.fixture
def near_tie_policy():
    """A tiny Qwen3-VL-MoE policy whose routers hold near-identical rows (experts 0,1,2 / 3,4,5 / 6,7 differ
    by 1e-7 relative): top-2 then chooses between near ties, and rounding decides."""
    from spmd_grpo.models.policy import PolicyModule

    hf = tiny_moe_model("qwen3_vl_moe")
    torch.manual_seed(3)
    for _, block in moe_blocks(hf):
        w = block.gate.weight.data
        for a, b in ((0, 1), (0, 2), (3, 4), (3, 5), (6, 7)):
            w[b] = w[a] * (1 + 1e-7 * torch.randn_like(w[a]))
    policy = PolicyModule(hf, [], chunk_size=64)
    policy.moe = install_moe(hf)
    return policy


def _samples(num: int = 4):
    from spmd_grpo.data.samples import Prompt, Sample

    g = torch.Generator().manual_seed(5)
    ids = lambda n: torch.randint(0, 300, (n,), generator=g).tolist()  # noqa: E731
    return [Sample(Prompt(i, []), 0, ids(5 + 3 * i), ids(4 + 2 * i), []) for i in range(num)]


def _spec(mode: str, experience_micro_batch: int):
    from spmd_grpo.actor.spec import UpdateSpec

    return UpdateSpec(
        temperature=1.0,
        pad_token_id=0,
        max_response_length=16,
        mini_batch_size=4,
        micro_batch_size=1,
        experience_micro_batch_size=experience_micro_batch,
        routing_replay=mode,
    )


def _step_start_log_ratios(policy, samples, spec) -> list[torch.Tensor]:
    """Old-logprob pass, then the update's forward of each sample (micro-batches of 1, train mode, with
    gradients): log(pi / pi_old) per response token before any optimizer step."""
    from spmd_grpo.actor.logprob_pass import compute_logprobs

    old = compute_logprobs(policy, samples, spec)
    policy.train()
    ratios = []
    for s, o in zip(samples, old, strict=True):
        lp, _ = policy(collate_for(policy, [s], spec, for_update=True), temperature=1.0)
        ratios.append(lp[0, : len(s.response_ids)].detach() - o)
    return ratios


def _diff_fraction(policy, name: str) -> float:
    differing, compared = policy.moe.take_metrics()[f"diff/{name}"].tolist()
    return differing / compared


@pytest.mark.parametrize("packed", [False, True])
def test_routing_replay_old_removes_expert_flips(near_tie_policy, packed):
    """Old pass: the 4 samples in one micro-batch; update: one at a time. Rounding differs between the two
    layouts and flips near-tie experts: without replay the step-start ratio is off by up to 1e-2 in log
    space; with `old` the update runs the old pass's experts and only rounding is left. The router's own
    choices still differ (logged as moe/route_diff/update either way)."""
    near_tie_policy.padding_free = packed
    samples = _samples()
    worst = {}
    for mode in ("none", "old"):
        for s in samples:
            s.routes = None
        ratios = _step_start_log_ratios(near_tie_policy, samples, _spec(mode, experience_micro_batch=4))
        worst[mode] = max(r.abs().max().item() for r in ratios)
        assert _diff_fraction(near_tie_policy, "update") > 0.01, mode
        assert all(s.routes.shape == (len(s.prompt_ids) + len(s.response_ids), 2, 2) for s in samples)
    assert worst["none"] > 1e-3
    assert worst["old"] < 1e-5


def test_routing_replay_old_makes_the_step_start_ratio_exactly_one(near_tie_policy):
    """The same micro-batches in both passes: replaying the recorded routes changes nothing."""
    samples = _samples()
    ratios = _step_start_log_ratios(near_tie_policy, samples, _spec("old", experience_micro_batch=1))
    assert all(torch.equal(r, torch.zeros_like(r)) for r in ratios)


def test_routing_replay_rollout_uses_the_given_routes(near_tie_policy):
    """Routes from elsewhere (here: recorded with a perturbed router, standing in for vLLM's; the last token
    left out, as vLLM may): every trainer pass replays them, so the trainer's own disagreement is logged
    (route_diff/old > 0) and the step-start ratio is exactly 1; the router still gets gradients."""
    samples = _samples()
    blocks = moe_blocks(near_tie_policy.hf)
    saved = [b.gate.weight.detach().clone() for _, b in blocks]
    with torch.no_grad():
        for _, b in blocks:
            b.gate.weight.mul_(1 + 1e-2 * torch.randn_like(b.gate.weight))
    _step_start_log_ratios(near_tie_policy, samples, _spec("none", experience_micro_batch=1))
    with torch.no_grad():
        for (_, b), w in zip(blocks, saved, strict=True):
            b.gate.weight.copy_(w)
    for s in samples:
        s.routes = s.routes[:-1]  # "vLLM's" routes
    near_tie_policy.moe.take_metrics()
    ratios = _step_start_log_ratios(near_tie_policy, samples, _spec("rollout", experience_micro_batch=1))
    assert all(torch.equal(r, torch.zeros_like(r)) for r in ratios)
    assert _diff_fraction(near_tie_policy, "old") > 0.01
    batch = collate_for(near_tie_policy, samples[:1], _spec("rollout", 1), for_update=True)
    assert batch.replay_routes and (batch.routes[-1] == -1).all()  # the token vLLM did not report
    near_tie_policy(batch)[0].sum().backward()
    assert all(b.gate.weight.grad is not None and b.gate.weight.grad.abs().sum() > 0 for _, b in blocks)


def test_vllm_routes_become_int16_sample_routes():
    import numpy as np

    from spmd_grpo.rollout.generate import _routes

    routes = _routes(np.array([[[3, 7], [0, 255]]], dtype=np.uint8))  # [tokens, layers, top-k], uint8 as vLLM
    assert routes.dtype == torch.int16 and routes.tolist() == [[[3, 7], [0, 255]]]
    assert _routes(None) is None


# ------------------------------------------------------------------------------- load metrics and aux loss
def test_load_and_route_diff_metrics():
    """Hand-made counts: layer 0 balanced (max/mean 1), layer 1 with one expert holding half the tokens."""
    from spmd_grpo.models.moe.metrics import moe_metrics
    from spmd_grpo.models.moe.routing import MoEState

    class Holder:
        moe = MoEState(num_layers=3, num_experts=4, top_k=2)

    state = Holder.moe
    state.load = torch.tensor([[2.0, 2, 2, 2], [4, 2, 1, 1], [0, 0, 0, 0]], dtype=torch.float64)
    state.diff = {"update": torch.tensor([3.0, 12.0], dtype=torch.float64)}
    twice = lambda t: 2 * t  # noqa: E731  (two ranks with the same counts)
    m = moe_metrics([Holder(), None], twice)
    assert m == {
        "moe/load/max_over_mean": pytest.approx((1 + 2) / 2),
        "moe/load/max_over_mean_max": pytest.approx(2.0),
        "moe/route_diff/update": pytest.approx(0.25),
    }
    assert moe_metrics([Holder()], twice) == {}  # counts are reset after each step's metrics
    assert moe_metrics([None], twice) == {}  # a dense model: no metrics, no collective


def test_padding_micro_batches_count_no_routes(near_tie_policy, monkeypatch):
    """A rank with fewer token-budget micro-batches than the agreed count runs zero-weight ones on one of
    its samples (forced here as if another rank needed 3 more): they keep FSDP's calls aligned but hold
    no data, so the old pass's and the update's load and route-difference counts, and the load-balancing
    loss, are those of the same samples without them."""
    import dataclasses

    import spmd_grpo.actor.micro_batches as micro_batches_module
    from spmd_grpo.actor.logprob_pass import compute_logprobs
    from spmd_grpo.actor.update import mini_batch_backward
    from tests.conftest import ONE_CPU_RANK

    near_tie_policy.moe.aux_loss_coef = 0.01
    samples = _samples(2)
    for s in samples:
        s.advantage = 1.0

    def counts(spec):
        for s in samples:
            s.routes = None
        for s, lp in zip(samples, compute_logprobs(near_tie_policy, samples, spec), strict=True):
            s.old_logprobs = lp
        sums = mini_batch_backward(near_tie_policy, samples, spec, ONE_CPU_RANK)
        return near_tie_policy.moe.take_metrics(), sums

    fixed = dataclasses.replace(_spec("none", experience_micro_batch=1), micro_batch_size=1)
    expected, expected_sums = counts(fixed)
    monkeypatch.setattr(micro_batches_module, "all_reduce_max", lambda t: t + 3)
    budget = dict(max_token_len_for_update=1, max_token_len_for_experience=1)  # one sample per part
    got, sums = counts(dataclasses.replace(fixed, dynamic_batching=True, **budget))
    assert sums["train/num_micro_batches"][0] == 5 and expected_sums["train/num_micro_batches"][0] == 2
    assert got.keys() == expected.keys() >= {"load", "diff/update"}
    for name in expected:
        assert torch.equal(got[name], expected[name]), (name, got[name], expected[name])
    aux, expected_aux = sums["actor/router_aux_loss"][0], expected_sums["actor/router_aux_loss"][0]
    assert aux == pytest.approx(expected_aux, rel=1e-6)


def test_router_aux_loss_equals_transformers(monkeypatch):
    """The routers' load-balancing terms give transformers' `aux_loss` for the same padded batch."""
    model = tiny_moe_model("qwen3_vl_moe")
    state = install_moe(model, aux_loss_coef=0.01)
    ids, mask = moe_tokens()
    state.begin(mask.reshape(-1).bool(), None, replay=False, pass_name="update")
    out = model(input_ids=ids, attention_mask=mask, output_router_logits=True, use_cache=False)
    ours = state.aux_loss_value()
    assert ours.requires_grad and torch.allclose(ours, out.aux_loss, rtol=1e-6), (ours, out.aux_loss)
    load = state.take_metrics()["load"]
    assert load.sum().item() == mask.sum().item() * 2 * 2  # valid tokens x layers x top-k


def test_aux_loss_default_follows_the_model_config():
    from spmd_grpo.models.moe.install import router_aux_loss_coef

    config = tiny_moe_model("qwen3_vl_moe").config
    assert router_aux_loss_coef(None, config) == 0.0  # output_router_logits is false in the config
    config.text_config.output_router_logits = True
    assert router_aux_loss_coef(None, config) == config.text_config.router_aux_loss_coef
    assert router_aux_loss_coef(0.5, config) == 0.5


def test_update_replays_old_routes_and_adds_the_aux_loss(near_tie_policy):
    """The real update (`update_policy`, one process): with `old` the step-start KL between the update's
    forward and the old pass (other micro-batches) is rounding only, without replay expert flips show; the
    aux loss enters the loss and its metric when its coefficient is set."""
    import dataclasses

    from spmd_grpo.actor.logprob_pass import compute_logprobs
    from spmd_grpo.actor.optimizer import build_optimizer
    from spmd_grpo.actor.update import update_policy
    from spmd_grpo.config.workers import OptimConfig
    from spmd_grpo.parallel.collectives import World

    world = World(rank=0, world_size=1, local_rank=0, device_type="cpu", backend="gloo")
    weights = {n: p.detach().clone() for n, p in near_tie_policy.named_parameters()}
    kl = {}
    for mode in ("none", "old"):
        near_tie_policy.load_state_dict(weights, strict=False)
        near_tie_policy.moe.aux_loss_coef = 0.01 if mode == "old" else 0.0
        samples = _samples()
        for s in samples:
            s.advantage = 1.0
        spec = dataclasses.replace(_spec(mode, experience_micro_batch=4), micro_batch_size=2)
        for s, lp in zip(samples, compute_logprobs(near_tie_policy, samples, spec), strict=True):
            s.old_logprobs = lp
        optim = build_optimizer(near_tie_policy, OptimConfig(lr=1e-3), total_steps=1)
        metrics = update_policy(near_tie_policy, optim, samples, spec, world)
        kl[mode] = abs(metrics["actor/ppo_kl"])
        assert ("actor/router_aux_loss" in metrics) == (mode == "old"), metrics
    print(kl)
    assert kl["none"] > 1e-5 and kl["old"] < 1e-7, kl
    assert metrics["actor/router_aux_loss"] > 0


@pytest.mark.parametrize("mode,aux", [("none", 0.0), ("old", 0.0), ("old", 0.01)])
def test_activation_checkpointing_recomputes_the_same_experts(near_tie_policy, mode, aux):
    """The backward's recomputation of a checkpointed layer uses the experts of its first run (its routes
    are recorded once per forward), so the gradients equal those without checkpointing, and it is not
    counted again in the load metrics. With the load-balancing loss in the loss, the recomputation saves
    the same tensors as the first run (checkpointing refuses a different count: `CheckpointError`) and
    the loss counts each layer once."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    samples = _samples()
    spec = _spec(mode, experience_micro_batch=4)
    _step_start_log_ratios(near_tie_policy, samples, spec)  # the old pass: routes recorded
    grads = []
    for wrap in (True, False):
        experts_module._grouped_mm_runs.cache_clear()  # the kernel probe inside a checkpointed layer
        model = copy.deepcopy(near_tie_policy)
        model.moe = install_moe(model.hf, aux_loss_coef=aux)
        if wrap:
            layers = model.hf.model.language_model.layers
            for i, layer in enumerate(layers):
                layers[i] = checkpoint_wrapper(layer)
        model.train()
        loss = model(collate_for(model, samples, spec, for_update=True))[0].sum()
        if aux:
            assert len(model.moe.aux_terms) == 2  # one per MoE layer
            loss = loss + aux * model.moe.aux_loss_value()
        loss.backward()
        assert len(model.moe.aux_terms) == (2 if aux else 0)  # the recomputation added none
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        assert model.moe.take_metrics()["load"].sum().item() == tokens * 2 * 2  # x layers x top-k
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert set(grads[1]) == {n.replace("._checkpoint_wrapped_module", "") for n in grads[0]}
    for name, g in grads[0].items():
        assert _rel(g, grads[1][name.replace("._checkpoint_wrapped_module", "")]) <= 1e-6, name
