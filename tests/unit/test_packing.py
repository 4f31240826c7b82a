"""Padding-free (packed) forward and reused image features give the padded, encode-every-time results.

The MoE and hybrid families (Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE) are checked on one mix with the varlen path.

Tiny random Qwen2.5-VL in fp32 on CPU, with both packed attention paths: transformers' sdpa (it builds the
block-diagonal causal mask from the packed position ids) and the per-sequence varlen sdpa. Compared: per-token logprobs and entropy, and the gradient of every parameter, for
several mixes of prompt/response lengths with images of different sizes, two images in one prompt and a
prompt without images.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from spmd_grpo.actor.image_features import encode_images
from spmd_grpo.actor.logprob_pass import compute_logprobs
from spmd_grpo.actor.spec import UpdateSpec
from spmd_grpo.config.checks import ConfigError
from spmd_grpo.config.loader import load_config
from spmd_grpo.data.samples import Prompt, Sample
from spmd_grpo.models import attention as attention_module
from spmd_grpo.models import build as model_module
from spmd_grpo.models.attention import VARLEN_SDPA
from spmd_grpo.models.inputs import ImageBatch, collate, dummy_image, mrope_position_ids
from spmd_grpo.models.policy import PolicyModule, unsamplable_token_ids
from spmd_grpo.models.shared_flex import FLEX_SHARED
from tests.conftest import tiny_model

# (image sizes of the prompt, response length) per sequence; a response token list is made from its length.
LENGTH_MIXES = {
    "short-long-one": [([(56, 56)], 7), ([(84, 56)], 1), ([(56, 112)], 12)],
    "two-images-and-text-only": [([(56, 56), (84, 84)], 3), ([], 9), ([(56, 84)], 5)],
    "equal-lengths-same-prompt": [([(56, 56)], 5)] * 3 + [([(112, 56)], 5)],
}


@pytest.fixture(scope="module")
def tiny():
    d = tiny_model()
    processor = AutoProcessor.from_pretrained(d)
    hf = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32, attn_implementation="sdpa")
    return processor, PolicyModule(hf, unsamplable_token_ids(hf.config), chunk_size=5)


def _encode(processor, sizes: list[tuple[int, int]], key: int):
    content = [{"type": "image"} for _ in sizes] + [{"type": "text", "text": f"Which color? {key}"}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    images = [Image.new("RGB", size, (40 * key % 255, 90, 200 - 10 * i)) for i, size in enumerate(sizes)]
    enc = processor(text=[text], images=images or None, return_tensors="pt")
    if not sizes:
        return enc["input_ids"][0].tolist(), None, None
    return enc["input_ids"][0].tolist(), enc["pixel_values"], enc["image_grid_thw"]


def _sequences(processor, mix):
    """(prompt ids, response ids, pixels, grids) per sequence; equal specs share one encoded prompt."""
    encoded = {}
    prompts, responses, pixels, grids = [], [], [], []
    for i, (sizes, n) in enumerate(mix):
        key = tuple(sizes)
        if key not in encoded:
            encoded[key] = _encode(processor, sizes, len(encoded))
        ids, pv, grid = encoded[key]
        prompts.append(ids)
        responses.append([(17 * i + 5 * j) % 300 + 20 for j in range(n)])
        pixels.append(pv)
        grids.append(grid)
    return prompts, responses, pixels, grids


def _run(policy: PolicyModule, batch, weights: torch.Tensor):
    """(logprobs, entropy, {name: grad}) of a fixed weighted sum of both, so every token's gradient counts."""
    policy.zero_grad(set_to_none=True)
    lp, ent = policy(batch, temperature=0.7, with_entropy=True)
    ((lp * weights).sum() + 0.3 * (ent * weights).sum()).backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    return lp.detach(), ent.detach(), grads


def _assert_same_grads(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:
        scale = a[name].abs().max().item()
        err = (a[name] - b[name]).abs().max().item()
        assert err <= 1e-5 * scale + 1e-9, f"{name}: max error {err:.3g} vs max |grad| {scale:.3g}"


def _assert_same_pass(policy: PolicyModule, reference, other, weights: torch.Tensor, atol: float):
    """`other` gives `reference`'s logprobs and entropy (within `atol`) and its gradients; returns
    (logprobs, {name: grad}) of `reference` for the caller's own checks."""
    lp_ref, ent_ref, g_ref = _run(policy, reference, weights)
    lp, ent, g = _run(policy, other, weights)
    torch.testing.assert_close(lp, lp_ref, atol=atol, rtol=0)
    torch.testing.assert_close(ent, ent_ref, atol=atol, rtol=0)
    _assert_same_grads(g_ref, g)
    return lp_ref, g_ref


@pytest.fixture(params=["sdpa", VARLEN_SDPA])
def attention(request, tiny):
    """The tiny policy with transformers' sdpa (a packed row gets a dense block-diagonal mask) or the
    per-sequence varlen sdpa (`spmd_grpo.models.attention`, what padding_free=auto packs with on the CPU)."""
    _, policy = tiny
    policy.hf.set_attn_implementation(request.param)
    yield request.param
    policy.hf.set_attn_implementation("sdpa")


@pytest.mark.parametrize("mix", list(LENGTH_MIXES))
def test_packed_forward_equals_padded_logprobs_and_gradients(tiny, mix, attention):
    processor, policy = tiny
    seqs = _sequences(processor, LENGTH_MIXES[mix])
    pad = processor.tokenizer.pad_token_id
    padded = collate(*seqs, pad)
    packed = collate(*seqs, pad, packed=True)
    assert packed.input_ids.shape == (1, int(padded.attention_mask.sum())) and packed.attention_mask is None
    weights = torch.rand(padded.response_mask.shape, generator=torch.Generator().manual_seed(0))
    lp_pad, _ = _assert_same_pass(policy, padded, packed, weights, atol=1e-5)
    assert (lp_pad[padded.response_mask == 0] == 0).all() and (lp_pad[padded.response_mask == 1] < 0).all()


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"])
def test_packed_equals_padded_for_the_moe_and_hybrid_families(family, monkeypatch):
    """MoE: routing is per token with no capacity, so a token's experts do not depend on the row it shares.
    Qwen3.5: the Gated DeltaNet state and its causal convolution restart at each packed sequence; without
    the restart (negative control) the packed row differs from the padded batch."""
    from spmd_grpo.models import policy as policy_module

    d = tiny_model(family=family)
    processor = AutoProcessor.from_pretrained(d)
    hf = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32, attn_implementation=VARLEN_SDPA)
    policy = PolicyModule(hf, unsamplable_token_ids(hf.config), chunk_size=5)
    seqs = _sequences(processor, LENGTH_MIXES["two-images-and-text-only"])
    pad = processor.tokenizer.pad_token_id
    padded, packed = collate(*seqs, pad), collate(*seqs, pad, packed=True)
    weights = torch.rand(padded.response_mask.shape, generator=torch.Generator().manual_seed(0))
    _assert_same_pass(policy, padded, packed, weights, atol=1e-5)
    if family == "qwen3_5":
        hf = AutoModelForImageTextToText.from_pretrained(
            d, dtype=torch.float32, attn_implementation=VARLEN_SDPA
        )
        monkeypatch.setattr(policy_module, "split_packed_linear_attention", lambda *args: 0)
        unsplit = PolicyModule(hf, unsamplable_token_ids(hf.config), chunk_size=5)
        with torch.no_grad():
            lp_pad, lp_packed = unsplit(padded)[0], unsplit(packed)[0]
        assert (lp_pad - lp_packed).abs().max() > 1e-4


def test_varlen_sdpa_batches_equal_lengths_and_builds_no_mask(tiny, monkeypatch):
    processor, policy = tiny
    # 3 sequences of one length (same prompt, same response length) and 1 of another
    seqs = _sequences(processor, LENGTH_MIXES["equal-lengths-same-prompt"])
    packed = collate(*seqs, processor.tokenizer.pad_token_id, packed=True)
    lengths = packed.sequence_lengths.tolist()
    assert len(set(lengths)) == 2 and lengths[0] == lengths[1] == lengths[2] != lengths[3]
    assert attention_module.sequence_bounds(mrope_position_ids(policy.hf, packed)[0, 0]) == [
        0, *packed.sequence_lengths.cumsum(0).tolist()
    ]  # fmt: skip
    calls = []  # (batch, query length) of the causal (text) calls; the vision tower's are not causal
    real = attention_module.sdpa_attention_forward

    def counted(module, query, *args, **kwargs):
        if kwargs.get("is_causal", True):
            calls.append((query.shape[0], query.shape[2]))
        return real(module, query, *args, **kwargs)

    monkeypatch.setattr(attention_module, "sdpa_attention_forward", counted)
    monkeypatch.setattr(
        attention_module, "sdpa_mask", lambda *a, **k: pytest.fail("a packed row built a mask")
    )
    policy.hf.set_attn_implementation(VARLEN_SDPA)
    try:
        with torch.no_grad():
            policy(packed)
    finally:
        policy.hf.set_attn_implementation("sdpa")
    layers = policy.config.text_config.num_hidden_layers
    assert calls == [(3, lengths[0]), (1, lengths[3])] * layers  # one call per length, in every layer


def test_packed_positions_have_a_text_row_without_which_sequences_attend_to_each_other(tiny):
    processor, policy = tiny
    seqs = _sequences(processor, LENGTH_MIXES["short-long-one"])
    pad = processor.tokenizer.pad_token_id
    packed, padded = collate(*seqs, pad, packed=True), collate(*seqs, pad)
    pos = mrope_position_ids(policy.hf, packed)
    assert pos.shape == (4, 1, packed.input_ids.shape[1])
    lengths = packed.sequence_lengths.tolist()
    assert pos[0, 0].tolist() == [t for n in lengths for t in range(n)]
    # Rows 1-3 are the padded batch's mrope positions of the valid tokens, sequence by sequence.
    assert torch.equal(pos[1:, 0], mrope_position_ids(policy.hf, padded)[:, padded.attention_mask.bool()])
    with torch.no_grad():
        hf_inputs = dict(input_ids=packed.input_ids, pixel_values=packed.pixel_values, use_cache=False)
        hf_inputs["image_grid_thw"] = packed.image_grid_thw
        right = policy.hf.model(position_ids=pos, **hf_inputs).last_hidden_state
        wrong = policy.hf.model(position_ids=pos[1:], **hf_inputs).last_hidden_state
    first = lengths[0]  # the first sequence sees nothing before it either way; the others differ
    torch.testing.assert_close(wrong[:, :first], right[:, :first], atol=1e-5, rtol=0)
    assert (wrong[:, first:] - right[:, first:]).abs().max() > 1e-2


def test_packed_positions_hold_when_mixed_precision_casts_the_response_mask_to_bf16(tiny):
    """A response mask in bf16 (as FSDP2's root unit made it when it still cast the batch to param_dtype):
    summed in bf16, a 750-token response counted 752 and a 359-token one 360, and the packed row's boundaries
    moved (a rotary shape error when the totals differed, shifted sequences when not). Counted, the lengths
    hold whatever the mask's dtype."""
    processor, policy = tiny
    seqs = _sequences(processor, [([(56, 56)], 750), ([(84, 56)], 359), ([], 557)])
    packed = collate(*seqs, processor.tokenizer.pad_token_id, packed=True)
    cast = dataclasses.replace(packed, response_mask=packed.response_mask.to(torch.bfloat16))
    assert cast.response_lengths == [750, 359, 557]
    assert torch.equal(mrope_position_ids(policy.hf, cast), mrope_position_ids(policy.hf, packed))


@pytest.mark.parametrize("packed", [False, True])
def test_reused_image_features_give_the_same_logprobs_and_gradients(tiny, packed):
    processor, policy = tiny
    policy.hf.model.visual.requires_grad_(False)
    try:
        prompts, responses, pixels, grids = _sequences(processor, LENGTH_MIXES["two-images-and-text-only"])
        with torch.no_grad():
            features = [
                None if pv is None else tuple(policy(ImageBatch(pv, g)))
                for pv, g in zip(pixels, grids, strict=True)
            ]
        pad = processor.tokenizer.pad_token_id
        encoded = collate(prompts, responses, pixels, grids, pad, packed=packed)
        reused = collate(prompts, responses, pixels, grids, pad, packed=packed, image_features=features)
        assert reused.pixel_values is None and len(reused.image_features) == 3
        weights = torch.rand(encoded.response_mask.shape, generator=torch.Generator().manual_seed(1))
        _, g_a = _assert_same_pass(policy, encoded, reused, weights, atol=1e-6)
        assert not any(n.startswith("hf.model.visual") for n in g_a)
    finally:
        policy.hf.model.visual.requires_grad_(True)


def _samples(processor, mix) -> list[Sample]:
    prompts, responses, pixels, grids = _sequences(processor, mix)
    return [
        Sample(Prompt(i, p), i, p, r, [0.0] * len(r), pixel_values=pv, image_grid_thw=g)
        for i, (p, r, pv, g) in enumerate(zip(prompts, responses, pixels, grids, strict=True))
    ]


def test_encode_images_once_per_prompt_then_every_pass_reuses_them(tiny):
    processor, policy = tiny
    mix = LENGTH_MIXES["equal-lengths-same-prompt"] + LENGTH_MIXES["two-images-and-text-only"]
    spec = UpdateSpec(0.7, processor.tokenizer.pad_token_id, 16, 8, 8, experience_micro_batch_size=2)
    baseline = compute_logprobs(policy, _samples(processor, mix), spec)
    samples = _samples(processor, mix)
    encode_images(policy, samples, spec)  # reuse off: nothing attached
    assert all(s.image_features is None for s in samples)
    spec = dataclasses.replace(spec, image_features="per_step")
    calls = []
    hook = policy.hf.model.visual.register_forward_hook(
        lambda m, args, kwargs, out: calls.append(len(kwargs["grid_thw"])), with_kwargs=True
    )
    try:
        encode_images(policy, samples, spec)
        policy.padding_free = True
        reused = compute_logprobs(policy, samples, spec)
    finally:
        hook.remove()
        policy.padding_free = False
    # 4 distinct pixel tensors (the first 3 samples share one) in chunks of 2 prompts: 2 tower calls.
    assert calls == [2, 3]
    assert samples[0].image_features is samples[1].image_features is samples[2].image_features
    assert samples[5].image_features is None and len(samples[4].image_features) == 2
    for a, b in zip(baseline, reused, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


def test_a_trained_tower_encodes_once_per_forward_only_pass_and_keeps_nothing(tiny):
    """Trained tower (`image_features` per_pass): each `compute_logprobs` pass runs the tower once per prompt
    with its own weights, gives the encode-every-time logprobs, and leaves no features for the next pass."""
    processor, policy = tiny
    mix = LENGTH_MIXES["equal-lengths-same-prompt"] + LENGTH_MIXES["two-images-and-text-only"]
    spec = UpdateSpec(0.7, processor.tokenizer.pad_token_id, 16, 8, 8, experience_micro_batch_size=2)
    calls = []
    hook = policy.hf.model.visual.register_forward_hook(
        lambda m, args, kwargs, out: calls.append(len(kwargs["grid_thw"])), with_kwargs=True
    )
    try:
        baseline = compute_logprobs(policy, _samples(processor, mix), spec)
        every_time = list(calls)
        calls.clear()
        samples = _samples(processor, mix)
        once = compute_logprobs(policy, samples, dataclasses.replace(spec, image_features="per_pass"))
    finally:
        hook.remove()
    # 7 samples (6 with images, 7 images) in micro-batches of 2 encode 2 + 2 + 2 + 1 images; once per pass:
    # 4 distinct pixel tensors in chunks of 2 prompts, 2 + 3 images.
    assert every_time == [2, 2, 2, 1] and calls == [2, 3]
    assert all(s.image_features is None for s in samples)
    for a, b in zip(baseline, once, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


def test_dummy_image_runs_through_the_tower(tiny):
    _, policy = tiny
    with torch.no_grad():
        (features,) = policy(dummy_image(policy.config))
    assert features.shape == (1, policy.config.text_config.hidden_size)


def test_padding_free_setting_picks_packing_and_attention(monkeypatch):
    assert model_module.attention_setup("auto", "cpu") == (True, VARLEN_SDPA)
    assert model_module.attention_setup(False, "cpu") == (False, VARLEN_SDPA)  # padded batches: plain sdpa
    # no flash_attn installed here: flex attention with the row's block mask
    assert model_module.attention_setup("auto", "cuda") == (True, FLEX_SHARED)
    assert model_module.attention_setup(False, "cuda") == (False, FLEX_SHARED)  # padded: sdpa inside it
    assert model_module.attention_setup(True, "npu") == (True, "flash_attention_2")
    monkeypatch.setattr(model_module, "varlen_attention", lambda device_type: "flash_attention_2")
    assert model_module.attention_setup("auto", "cuda") == (True, "flash_attention_2")
    assert model_module.attention_setup(False, "cuda") == (False, "flash_attention_2")
    base = ["worker.actor.model.model_path=x", "data.train_files=x"]
    assert load_config(None, [*base, "worker.actor.padding_free=true"]).worker.actor.padding_free is True
    assert load_config(None, base).worker.actor.padding_free == "auto"
    with pytest.raises(ConfigError, match="padding_free"):
        load_config(None, [*base, "worker.actor.padding_free=sometimes"])


def test_packed_equals_padded_for_video_and_image_video_prompts(tiny):
    """Video prompts (a video; an image and a video; text-only beside them) packed vs padded: logprobs,
    entropy and every gradient, with the tower run on video input in every forward (transformers' sdpa; the
    attention paths themselves are compared above)."""
    from spmd_grpo.rollout.generate import attach_video_inputs
    from tests.jobs.common import chat_text, encode_with_videos, make_video, video_setup

    processor, policy = tiny
    sizes = video_setup(processor)
    samples = []
    for i, (num_images, num_videos, n) in enumerate([(1, 1, 4), (0, 1, 7), (0, 0, 3)]):
        images = [Image.new("RGB", (56, 84), (90, 30 * i, 20))] * num_images
        videos = [make_video([(60 * f, 20 * i, 100) for f in range(4)], sizes.video)] * num_videos
        sample = Sample(Prompt(i, [], images=images, videos=videos), 0, [], [], [])
        attach_video_inputs([sample], processor, sizes, torch.float32)
        text = f"Colors? {i}"
        if videos:
            enc = encode_with_videos(processor, images, videos, text, sizes)
        else:
            chat = chat_text(processor, num_images, text)
            enc = processor(text=[chat], images=images or None, return_tensors="pt")
        if images and not videos:
            sample.pixel_values, sample.image_grid_thw = enc["pixel_values"], enc["image_grid_thw"]
        sample.prompt_ids, sample.response_ids = (
            enc["input_ids"][0].tolist(),
            [(7 * i + j) % 300 + 20 for j in range(n)],
        )
        samples.append(sample)
    pad = processor.tokenizer.pad_token_id
    args = ([s.prompt_ids for s in samples], [s.response_ids for s in samples],
            [s.pixel_values for s in samples], [s.image_grid_thw for s in samples], pad)  # fmt: skip
    flags = {"video_inputs": [s.video_inputs for s in samples], "video_in_forward": True}
    padded, packed = collate(*args, **flags), collate(*args, packed=True, **flags)
    assert padded.video_grid_thw.shape == (2, 3) and padded.second_per_grid_ts.tolist() == [1.0, 1.0]
    weights = torch.rand(padded.response_mask.shape, generator=torch.Generator().manual_seed(0))
    _, g_pad = _assert_same_pass(policy, padded, packed, weights, atol=1e-5)
    assert any(name.startswith("hf.model.visual") for name in g_pad)


@pytest.mark.parametrize(
    "overrides, family, expected, ignored",
    [
        (["worker.actor.model.freeze_vision_tower=true"], "qwen2_5_vl", "per_step", False),
        (["worker.actor.model.freeze_vision_tower=false"], "qwen2_5_vl", "per_pass", False),
        (["worker.actor.reuse_image_features=false"], "qwen2_5_vl", "in_forward", False),
        (["worker.rollout.limit_videos=1"], "qwen2_5_vl", "in_forward", False),  # auto: off with videos
        (["worker.actor.reuse_image_features=true"], "qwen3_vl", "in_forward", True),  # DeepStack: said
        (["worker.actor.model.freeze_vision_tower=true"], "qwen3_vl", "in_forward", False),  # DeepStack
        (["worker.actor.model.freeze_vision_tower=true"], None, "in_forward", False),  # family unknown
    ],
)
def test_image_feature_reuse_is_decided_once_in_the_update_spec(overrides, family, expected, ignored):
    from spmd_grpo.models.families import family_for_type

    cfg = load_config(None, ["worker.actor.model.model_path=/nowhere", "data.train_files=x", *overrides])
    found = family_for_type(family) if family else None
    spec = UpdateSpec.from_config(cfg, world_size=1, pad_token_id=0, family=found)
    assert spec.image_features == expected
    assert bool(spec.ignored) == ignored and all("reuse_image_features" in why for why in spec.ignored)
    # Every pass reads it: the update's forwards encode unless features were made for the whole step.
    assert spec.tower_in_forward(for_update=True) == (expected != "per_step")
    assert spec.tower_in_forward(for_update=False) == (expected == "in_forward")


def test_short_cpu_attention_in_bf16_is_computed_in_fp32_and_long_stays_bf16():
    """The varlen path's sdpa calls on the CPU: bf16 inputs over few keys attend in fp32 (the output cast
    back to bf16), over more keys than `FP32_ATTENTION_MAX_KEYS` in bf16 as given."""
    module = torch.nn.Module()
    gen = torch.Generator().manual_seed(0)
    for keys, upcast in [
        (attention_module.FP32_ATTENTION_MAX_KEYS, True),
        (attention_module.FP32_ATTENTION_MAX_KEYS + 1, False),
    ]:
        q, k, v = (torch.randn(2, 4, keys, 16, generator=gen).to(torch.bfloat16) for _ in range(3))
        out = attention_module._cpu_sdpa(module, q, k, v, None, is_causal=True)
        c = (lambda t: t.float()) if upcast else (lambda t: t)
        want = torch.nn.functional.scaled_dot_product_attention(c(q), c(k), c(v), is_causal=True)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, want.transpose(1, 2).to(torch.bfloat16))


def test_the_sharded_bf16_policy_sees_the_batch_as_collated(monkeypatch):
    """FSDP2's mixed precision casts a unit's floating inputs to param_dtype. At the root that rounded the
    batch's float fields that are not activations: the response mask, and Qwen2.5-VL's `second_per_grid_ts`,
    which must stay the value the engine reads (`attach_video_inputs` rounds it to the rollout dtype, not to
    param_dtype). Here the value an fp32 engine reads, 2 x 61 / 120 s per temporal patch (a 61-frame 30 fps
    clip sampled to 4 frames): cast to bf16 it became 1.015625, and the video's mrope time positions (x 4
    tokens per second, truncated) moved from the 32nd temporal patch on (126.07 -> 125.94). A world of one,
    in-process, the policy sharded as the trainer shards it with param_dtype bf16; the positions computed
    inside its forward must equal those of the collated batch."""
    import torch.distributed as dist

    from spmd_grpo.config.workers import FSDPConfig
    from spmd_grpo.models import policy as policy_module
    from spmd_grpo.models.build import shard_model
    from tests.conftest import ONE_CPU_RANK

    d = tiny_model()
    processor = AutoProcessor.from_pretrained(d)
    hf = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32, attn_implementation="sdpa")
    config, t = hf.config, 32  # temporal patches; each 2 x 2 merged tokens of a 56 x 56 frame pair
    prompt = [
        5,
        config.vision_start_token_id,
        *[config.video_token_id] * (t * 4),
        config.vision_end_token_id,
        7,
    ]
    patch_dim = 3 * config.vision_config.temporal_patch_size * config.vision_config.patch_size**2
    seconds = torch.tensor([2 * 61 / 120], dtype=torch.float32)
    video = {
        "pixel_values_videos": torch.randn(t * 16, patch_dim, generator=torch.Generator().manual_seed(0)),
        "video_grid_thw": torch.tensor([[t, 4, 4]]),
        "second_per_grid_ts": seconds,
    }
    batch = collate([prompt], [[11, 12, 13]], [None], [None], processor.tokenizer.pad_token_id,
                    video_inputs=[video], video_in_forward=True)  # fmt: skip
    expected = mrope_position_ids(hf, batch)
    seen = []

    def spy(hf_model, inner_batch):
        seen.append((inner_batch.second_per_grid_ts, inner_batch.response_mask.dtype))
        return mrope_position_ids(hf_model, inner_batch)

    monkeypatch.setattr(policy_module, "mrope_position_ids", spy)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        policy = shard_model(
            PolicyModule(hf, unsamplable_token_ids(config), chunk_size=5),
            FSDPConfig(param_dtype="bfloat16"),
            ONE_CPU_RANK,
        )
        with torch.no_grad():
            policy(batch)
    finally:
        dist.destroy_process_group()
    ((inner_seconds, mask_dtype),) = seen
    assert inner_seconds.dtype == torch.float32 and mask_dtype == torch.float32
    positions = mrope_position_ids(hf, dataclasses.replace(batch, second_per_grid_ts=inner_seconds))
    assert torch.equal(positions, expected)
    rounded = mrope_position_ids(hf, dataclasses.replace(batch, second_per_grid_ts=seconds.bfloat16()))
    assert not torch.equal(rounded, expected)  # the control: bf16 seconds move the time axis at this length
