"""Shared-prompt passes give the unshared packed results: each group's prompt (and its images and videos) once
in the row, its responses after it.

Tiny random Qwen2.5-VL in fp32 on CPU with the varlen sdpa (the packed path on the CPU). Compared with the
unshared packed forward: per-token logprobs and entropy and the gradient of every parameter, with the tower
trained and frozen (features encoded once), video and image + video prompts, LoRA; then the whole
old-logprob pass and the update's backward (KL term, rollout correction with rejection, DAPO's partial and
interleaved groups, fixed counts and token budgets that cut a group). A layout in which a response sees
another response's tokens must fail the same comparison.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from spmd_grpo.actor.image_features import attach_image_features
from spmd_grpo.actor.logprob_pass import compute_logprobs
from spmd_grpo.actor.micro_batches import collate_samples, micro_batches, shared_prompt_units
from spmd_grpo.actor.spec import UpdateSpec
from spmd_grpo.actor.update import mini_batch_backward, padded_correction
from spmd_grpo.algorithm.correction import CorrectionSpec
from spmd_grpo.config.checks import ConfigError
from spmd_grpo.config.loader import load_config
from spmd_grpo.data.samples import Prompt, Sample
from spmd_grpo.models import policy as policy_module
from spmd_grpo.models.attention import VARLEN_SDPA, attention_plan
from spmd_grpo.models.build import shared_prompt_setup
from spmd_grpo.models.policy import PolicyModule, unsamplable_token_ids
from tests.conftest import ONE_CPU_RANK, tiny_model
from tests.unit.test_packing import _encode, _run

# Per group: (image sizes of the prompt, response lengths). Groups of 3, 2, 2, 1: a prompt with two images,
# a text-only one, a group of one (nothing shared), equal and unequal response lengths.
GROUPS = [([(56, 56)], [7, 1, 12]), ([(56, 56), (84, 84)], [3, 3]), ([], [9, 4]), ([(56, 84)], [5])]


@pytest.fixture(scope="module")
def tiny():
    d = tiny_model()
    processor = AutoProcessor.from_pretrained(d)
    hf = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32, attn_implementation=VARLEN_SDPA)
    policy = PolicyModule(hf, unsamplable_token_ids(hf.config), chunk_size=5, padding_free=True)
    return processor, policy


def group_samples(processor, groups=GROUPS) -> list[Sample]:
    """A group's samples share one `Prompt` and its pixel tensors, as `attach_pixel_values` leaves them."""
    samples = []
    for g, (sizes, lengths) in enumerate(groups):
        ids, pv, grid = _encode(processor, sizes, g)
        prompt = Prompt(g, ids)
        for i, n in enumerate(lengths):
            response = [(17 * i + 5 * j + 3 * g) % 300 + 20 for j in range(n)]
            samples.append(Sample(prompt, i, ids, response, [0.0] * n, pixel_values=pv, image_grid_thw=grid))
    return samples


def video_samples(processor) -> list[Sample]:
    """A video prompt (3 samples), an image + video prompt (2), a text-only one (2)."""
    from spmd_grpo.rollout.generate import attach_video_inputs
    from tests.jobs.common import chat_text, encode_with_videos, make_video, video_setup

    sizes = video_setup(processor)
    samples = []
    for g, (num_images, num_videos, lengths) in enumerate(
        [(0, 1, [4, 7, 2]), (1, 1, [3, 5]), (0, 0, [6, 2])]
    ):
        images = [Image.new("RGB", (56, 84), (90, 30 * g, 20))] * num_images
        videos = [make_video([(60 * f, 20 * g, 100) for f in range(4)], sizes.video)] * num_videos
        prompt = Prompt(g, [], images=images, videos=videos)
        if videos:
            ids = encode_with_videos(processor, images, videos, f"Colors? {g}", sizes)["input_ids"][
                0
            ].tolist()
        else:
            ids = processor(text=[chat_text(processor, 0, f"Colors? {g}")])["input_ids"][0]
        for i, n in enumerate(lengths):
            samples.append(
                Sample(prompt, i, list(ids), [(7 * g + 3 * i + j) % 300 + 20 for j in range(n)], [])
            )
    attach_video_inputs(samples, processor, sizes, torch.float32)
    return samples


def _same(a, b, atol=1e-5) -> None:
    """Logprobs/entropy within `atol`, every gradient within 1e-5 of its largest entry."""
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = a, b
    torch.testing.assert_close(lp_b, lp_a, atol=atol, rtol=0)
    torch.testing.assert_close(ent_b, ent_a, atol=atol, rtol=0)
    assert g_a.keys() == g_b.keys() and g_a
    for name in g_a:
        scale, err = g_a[name].abs().max().item(), (g_a[name] - g_b[name]).abs().max().item()
        assert err <= 1e-5 * scale + 1e-9, f"{name}: max error {err:.3g} vs max |grad| {scale:.3g}"


def _both(policy, samples, pad, **flags):
    """(unshared, shared) results of one packed micro-batch of `samples` (`_run`'s weighted loss)."""
    unshared = collate_samples(samples, pad, packed=True, **flags)
    shared = collate_samples(samples, pad, packed=True, shared_prompt=True, **flags)
    assert shared.input_ids.shape[1] < unshared.input_ids.shape[1]
    weights = torch.rand(unshared.response_mask.shape, generator=torch.Generator().manual_seed(0))
    return _run(policy, unshared, weights), _run(policy, shared, weights), shared


def test_the_shared_row_holds_each_prompt_once_with_positions_continuing_from_it(tiny):
    processor, policy = tiny
    samples = group_samples(processor)
    batch = collate_samples(samples, processor.tokenizer.pad_token_id, packed=True, shared_prompt=True)
    prompts = [len(s.prompt_ids) for s in samples]
    responses = [len(s.response_ids) for s in samples]
    firsts = [0, 3, 5, 7]
    assert batch.shares_prompt.tolist() == [i not in firsts for i in range(8)]
    assert batch.input_ids.shape[1] == sum(prompts[i] for i in firsts) + sum(responses)
    assert batch.image_grid_thw.shape[0] == 4  # the group of two images once, not twice
    pos = policy_module.mrope_position_ids(policy.hf, batch)[:, 0]  # [4, T]
    unshared = collate_samples(samples, processor.tokenizer.pad_token_id, packed=True)
    full = policy_module.mrope_position_ids(policy.hf, unshared)[:, 0]
    at, out = 0, 0
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        keep = slice(at, at + p + r) if i in firsts else slice(at + p, at + p + r)
        n = keep.stop - keep.start
        assert torch.equal(pos[:, out : out + n], full[:, keep])  # all four rows, response after response
        at, out = at + p + r, out + n
    plan = attention_plan(pos[0])
    # causal: the three shared prompts and the group of one whole; prefixed: each group's responses,
    # padded to its longest
    assert sorted(n for n, _ in plan.causal) == sorted([prompts[0], prompts[3], prompts[5], prompts[7] + 5])
    assert sorted((p, rq, q.shape[0]) for p, rq, q, *_ in plan.prefixed) == sorted(
        [(prompts[0], 12, 3), (prompts[3], 3, 2), (prompts[5], 9, 2)]
    )


@pytest.mark.parametrize("case", ["trained-tower", "frozen-tower-features", "video", "lora"])
def test_shared_prompt_gives_the_unshared_logprobs_entropy_and_gradients(tiny, case):
    processor, policy = tiny
    pad = processor.tokenizer.pad_token_id
    model, flags = policy, {}
    if case == "frozen-tower-features":
        policy.hf.model.visual.requires_grad_(False)
        samples = group_samples(processor)
        spec = UpdateSpec(1.0, pad, 16, 8, 8, experience_micro_batch_size=2, image_features="per_step")
        attach_image_features(policy, samples, spec)
        flags["tower_in_forward"] = False
    elif case == "video":
        samples, flags["video_in_forward"] = video_samples(processor), True
    else:
        samples = group_samples(processor)
    if case == "lora":
        model = _lora_copy(policy)
    try:
        unshared, shared, batch = _both(model, samples, pad, **flags)
    finally:
        policy.hf.model.visual.requires_grad_(True)
    _same(unshared, shared)
    tower = [n for n in shared[2] if n.startswith("hf.model.visual")]
    assert bool(tower) == (case in ("trained-tower", "video"))  # the tower's gradient, from every response
    if case == "video":
        assert batch.video_grid_thw.shape[0] == 2 and batch.pixel_values.shape[0] > 0
    if case == "lora":
        assert all("lora_" in n for n in shared[2])


def _lora_copy(policy: PolicyModule) -> PolicyModule:
    """A LoRA policy over a fresh tiny model: adapters on the language model's linear layers, B non-zero
    so that they change the logits."""
    from spmd_grpo.config.workers import LoRAConfig
    from spmd_grpo.models.lora import add_adapters, lora_layers

    hf = AutoModelForImageTextToText.from_pretrained(
        tiny_model(), dtype=torch.float32, attn_implementation=VARLEN_SDPA
    )
    hf = add_adapters(hf, LoRAConfig(rank=4))
    gen = torch.Generator().manual_seed(3)
    for _, layer in lora_layers(hf):
        for lin in (layer.lora_A["default"], layer.lora_B["default"]):
            lin.weight = torch.nn.Parameter(0.2 * torch.randn(lin.weight.shape, generator=gen))
    return PolicyModule(hf, policy.suppress_ids.tolist(), chunk_size=5, padding_free=True)


def test_a_response_that_sees_another_response_fails_the_comparison(tiny, monkeypatch):
    """Negative control: positions that chain a group's responses (row 0 running on from one response into
    the next) make each response attend to the earlier responses of its group. The comparison above must
    catch it on exactly those responses."""
    processor, policy = tiny
    real = policy_module.mrope_position_ids

    def chained(hf, batch):
        pos = real(hf, batch)
        if batch.shares_prompt is not None:
            pos[0, 0] = torch.cat([torch.arange(n) for n in _group_lengths(batch)])
        return pos

    samples = group_samples(processor)
    pad = processor.tokenizer.pad_token_id
    monkeypatch.setattr(policy_module, "mrope_position_ids", chained)
    (lp_a, _, _), (lp_b, _, _), _ = _both(policy, samples, pad)
    err = (lp_a - lp_b).abs().amax(dim=1)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(lp_b, lp_a, atol=1e-5, rtol=0)
    # The first response of each group sees nothing else; every later one sees its predecessors, except in
    # sample 1's logprob: one token, predicted by the prompt's last hidden state.
    assert (err[[0, 1, 3, 5, 7]] < 1e-5).all() and (err[[2, 4, 6]] > 1e-3).all()


def _group_lengths(batch) -> list[int]:
    """Row lengths of each group of a shared batch (prompt + all its responses)."""
    lengths, shares = [], batch.shares_prompt.tolist()
    for p, r, s in zip(batch.prompt_lengths.tolist(), batch.response_lengths, shares, strict=True):
        if s:
            lengths[-1] += r
        else:
            lengths.append(p + r)
    return lengths


def dapo_samples(processor) -> list[Sample]:
    """Partial groups after DAPO's filtering and rebalancing, interleaved: groups of 3, 1 and 2 samples of
    prompts whose other samples went elsewhere, with old/ref/rollout logprobs and advantages."""
    samples = group_samples(processor, [([(56, 56)], [7, 2, 9]), ([], [5]), ([(84, 56)], [4, 6])])
    order = [0, 3, 4, 1, 5, 2]  # group A, B, C, A, C, A
    return [samples[i] for i in order]


BASE = UpdateSpec(
    temperature=0.9, pad_token_id=0, max_response_length=12, mini_batch_size=6, micro_batch_size=6,
    experience_micro_batch_size=6, clip_ratio_high=0.28, entropy_coef=0.01, use_kl_loss=True, kl_coef=0.1,
    rollout_correction=CorrectionSpec(rollout_is="token", rollout_rs="token", rollout_rs_threshold=1.5),
)  # fmt: skip


@pytest.mark.parametrize(
    "split", [{}, {"micro_batch_size": 4, "experience_micro_batch_size": 4}, {"dynamic_batching": True}]
)
def test_old_logprob_pass_and_update_match_unshared_on_partial_interleaved_groups(tiny, split):
    """The passes as the trainer runs them (`compute_logprobs`, `mini_batch_backward`) with shared prompts
    on and off: the same logprobs, losses, metrics and gradient. Splits: one micro-batch; fixed counts that
    cut group A; a token budget below group A's prompt + responses (its rule cuts the group)."""
    processor, policy = tiny
    samples = dapo_samples(processor)
    prompt = len(samples[0].prompt_ids)
    budget = prompt + 12  # group A (7 + 2 + 9) does not fit with its prompt
    spec = dataclasses.replace(
        BASE, pad_token_id=processor.tokenizer.pad_token_id, max_token_len_for_update=budget,
        max_token_len_for_experience=budget, **split,
    )  # fmt: skip
    results = {}
    for shared in (False, True):
        policy.shared_prompt = shared
        old = compute_logprobs(policy, samples, spec)
        gen = torch.Generator().manual_seed(5)
        for s, lp in zip(samples, old, strict=True):
            s.old_logprobs, s.ref_logprobs = lp, lp + 0.2 * torch.rand(lp.shape, generator=gen)
            s.rollout_logprobs = (lp - 0.8 * torch.rand(lp.shape, generator=gen)).tolist()
            s.advantage = float(torch.randn((), generator=gen))
        policy.zero_grad(set_to_none=True)
        sums = mini_batch_backward(policy, samples, spec, ONE_CPU_RANK)
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        results[shared] = (old, sums, grads)
    policy.shared_prompt = False
    (old_a, sums_a, g_a), (old_b, sums_b, g_b) = results[False], results[True]
    for a, b in zip(old_a, old_b, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    saved = sums_b.pop("perf/shared_prompt_tokens_saved")[0]
    assert saved > 0 and "perf/shared_prompt_tokens_saved" not in sums_a
    assert sums_a.keys() == sums_b.keys()
    for name in set(sums_a) - {"train/num_micro_batches"}:  # a budget holds more samples when shared
        torch.testing.assert_close(
            torch.tensor(sums_b[name]), torch.tensor(sums_a[name]), atol=1e-5, rtol=1e-5
        )
    kept = padded_correction(samples, spec).keep
    assert 0 < kept.sum() < sum(len(s.response_ids) for s in samples)  # some tokens rejected, most trained
    _same((torch.zeros(1), torch.zeros(1), g_a), (torch.zeros(1), torch.zeros(1), g_b))


def test_token_budget_counts_each_prompt_once_and_cuts_a_group_over_it(tiny):
    processor, _ = tiny
    samples = dapo_samples(processor)
    p_a, p_c = len(samples[0].prompt_ids), len(samples[2].prompt_ids)
    units, costs = shared_prompt_units(samples, p_a + 12)
    # group A (responses 7, 2, 9 at positions 0, 3, 5) is cut after 7 + 2; B and C fit whole
    assert units == [[0, 3], [5], [1], [2, 4]]
    assert costs == [p_a + 9, p_a + 9, len(samples[1].prompt_ids) + 5, p_c + 10]
    spec = dataclasses.replace(
        BASE, dynamic_batching=True, max_token_len_for_update=p_a + 12, max_token_len_for_experience=10**6
    )
    parts = micro_batches(samples, spec, for_update=True, shared=True)
    assert sorted(i for p in parts for i in p) == list(range(6))
    for part in parts:  # each part lists its groups' samples consecutively
        keys = [samples[i].prompt.uid for i in part]
        assert keys == sorted(keys, key=keys.index)
    assert micro_batches(samples, spec, for_update=False, shared=True) == [[0, 3, 5, 1, 2, 4]]


def test_shared_prompt_setting_resolves_per_device():
    """Every family shares (MoE routes per token of the row, a hybrid's linear-attention state seeded)."""
    assert shared_prompt_setup("auto", True, "cpu") is True
    assert shared_prompt_setup("auto", True, "cuda") is True  # flex attention (tests/gpu passed on an H200)
    assert shared_prompt_setup("auto", True, "npu") is False  # nothing has run on an NPU
    assert shared_prompt_setup(True, True, "cuda") is True  # through flex attention (shared_flex.py)
    assert shared_prompt_setup("auto", False, "cpu") is False  # padded batches
    assert shared_prompt_setup(False, True, "cpu") is False
    base = ["worker.actor.model.model_path=x", "data.train_files=x"]
    assert load_config(None, base).worker.actor.shared_prompt == "auto"
    with pytest.raises(ConfigError, match="worker.actor.shared_prompt=true needs padding_free"):
        load_config(None, [*base, "worker.actor.shared_prompt=true", "worker.actor.padding_free=false"])
