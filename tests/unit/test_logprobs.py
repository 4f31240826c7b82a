"""Trainer-side logprobs: chunked vocabulary projection equals the plain full log-softmax; masks and mrope."""

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from spmd_grpo.models.inputs import collate, mrope_position_ids
from spmd_grpo.models.policy import PolicyModule, unsamplable_token_ids
from tests.conftest import tiny_model


def _batch(processor):
    prompts, pixels, grids = [], [], []
    for i, size in enumerate([(56, 56), (84, 56)]):
        content = [{"type": "image"}, {"type": "text", "text": f"Which color? {i}"}]
        text = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True
        )
        enc = processor(text=[text], images=[Image.new("RGB", size, (200, 20 * i, 30))], return_tensors="pt")
        prompts.append(enc["input_ids"][0].tolist())
        pixels.append(enc["pixel_values"])
        grids.append(enc["image_grid_thw"])
    responses = [[5, 17, 99, 3, 250], [42, 7]]
    return collate(prompts, responses, pixels, grids, processor.tokenizer.pad_token_id), responses


def test_chunked_logprobs_and_entropy_equal_full_softmax():
    d = tiny_model()
    processor = AutoProcessor.from_pretrained(d)
    hf = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32)
    suppress = unsamplable_token_ids(hf.config)
    vision = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    assert sorted(suppress) == sorted(getattr(hf.config, k) for k in vision)
    batch, responses = _batch(processor)
    temperature = 0.7
    with torch.no_grad():
        lp_chunked, ent_chunked = PolicyModule(hf, suppress, chunk_size=3)(
            batch, temperature, with_entropy=True
        )
        lp_big, _ = PolicyModule(hf, suppress, chunk_size=4096)(batch, temperature)
        # Reference: the plain HF forward with the same explicit positions, full [B, L, V] log-softmax.
        logits = (
            hf(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                position_ids=mrope_position_ids(hf, batch),
                pixel_values=batch.pixel_values,
                image_grid_thw=batch.image_grid_thw,
            ).logits.float()
            / temperature
        )
        logits[..., suppress] = float("-inf")
        logp = torch.log_softmax(logits, -1)
        probs = logp.exp()
        entropy = -(probs * logp.masked_fill(probs == 0, 0)).sum(-1)
    for i, resp in enumerate(responses):
        start = int(batch.prompt_lengths[i])
        expected = torch.stack([logp[i, start - 1 + j, tok] for j, tok in enumerate(resp)])
        torch.testing.assert_close(lp_chunked[i, : len(resp)], expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(
            ent_chunked[i, : len(resp)], entropy[i, start - 1 : start - 1 + len(resp)], atol=1e-4, rtol=0
        )
        assert (lp_chunked[i, len(resp) :] == 0).all() and (batch.response_mask[i, len(resp) :] == 0).all()
    torch.testing.assert_close(lp_chunked, lp_big, atol=1e-6, rtol=0)


def test_mrope_positions_continue_after_image_for_response_tokens():
    d = tiny_model()
    processor = AutoProcessor.from_pretrained(d)
    hf = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32)
    batch, responses = _batch(processor)
    pos = mrope_position_ids(hf, batch)  # [3, B, L]
    assert pos.shape == (3, *batch.input_ids.shape)
    for i, resp in enumerate(responses):
        end = int(batch.prompt_lengths[i]) + len(resp)
        text_tail = pos[:, i, end - len(resp) - 1 : end]
        # After the image, text/response tokens advance by 1 in all three rows, from the same value.
        assert (text_tail[0] == text_tail[1]).all() and (text_tail[1] == text_tail[2]).all()
        assert (text_tail[0].diff() == 1).all()
        # The image compresses positions: the last position is smaller than the sequence length.
        assert int(pos[0, i, end - 1]) < end - 1


def test_micro_batches_go_to_the_compute_device_not_the_parameters_device():
    """With `fsdp.offload_params` on an accelerator, FSDP2 holds the parameter shards in host memory and
    computes on the accelerator, where `fully_shard` put the buffers: a micro-batch built on the parameters'
    device would meet the gathered weights on another device. This machine has no accelerator, so the
    buffers go to `meta` here while the parameters stay on the CPU."""
    from spmd_grpo.actor.micro_batches import collate_for
    from spmd_grpo.actor.spec import UpdateSpec
    from spmd_grpo.data.samples import Prompt, Sample

    hf = AutoModelForImageTextToText.from_pretrained(tiny_model(), dtype=torch.float32)
    policy = PolicyModule(hf, unsamplable_token_ids(hf.config))
    policy.suppress_ids = policy.suppress_ids.to("meta")
    assert next(policy.parameters()).device.type == "cpu" and policy.compute_device.type == "meta"
    samples = [Sample(Prompt(i, []), 0, [5, 6, 7 + i], [8, 9], []) for i in range(2)]
    spec = UpdateSpec(
        temperature=1.0,
        pad_token_id=0,
        max_response_length=4,
        mini_batch_size=2,
        micro_batch_size=2,
        experience_micro_batch_size=2,
    )
    batch = collate_for(policy, samples, spec, for_update=True)
    assert batch.input_ids.device.type == "meta" and batch.response_mask.device.type == "meta"


# (LoRA rank, freeze_vision_tower, gather_once_per_pass, old logprobs from the update, KL): bf16 FSDP2 set-ups
# whose first step failed in its first backward while each feature passed alone.
FIRST_STEP_CASES = {
    # LoRA's reference pass (adapters disabled) was the policy's first forward; FSDP's per-micro-batch
    # reduction then handed bf16 adapter gradients to their fp32 shards.
    "lora-reference-pass-first": (4, False, False, True, True),
    # Text-only step, frozen tower with reused features: the tower never ran, and holding its (absent)
    # gradient back between micro-batches failed inside FSDP.
    "frozen-tower-never-gathered": (0, True, "auto", False, False),
}


@pytest.mark.parametrize("case", list(FIRST_STEP_CASES))
def test_the_first_step_of_a_bf16_sharded_policy_runs_its_passes_in_the_trainers_order(case):
    """The trainer's calls on a policy built and sharded as the trainer builds it (a world of one,
    in-process, fsdp.param_dtype bf16): image features, old logprobs unless the update takes them,
    reference logprobs with the KL term, then one update of two micro-batches of text-only samples."""
    import torch.distributed as dist

    from spmd_grpo.actor.image_features import encode_images
    from spmd_grpo.actor.logprob_pass import compute_logprobs, compute_ref_logprobs
    from spmd_grpo.actor.optimizer import build_optimizer
    from spmd_grpo.actor.spec import UpdateSpec
    from spmd_grpo.actor.update import update_policy
    from spmd_grpo.config.workers import ActorConfig, FSDPConfig, LoRAConfig, ModelConfig, OptimConfig
    from spmd_grpo.data.samples import Prompt, Sample
    from spmd_grpo.models.build import build_policy
    from tests.conftest import ONE_CPU_RANK

    rank, freeze, gather, old_from_update, kl = FIRST_STEP_CASES[case]
    model = ModelConfig(model_path=str(tiny_model()), freeze_vision_tower=freeze, lora=LoRAConfig(rank=rank))
    actor = ActorConfig(
        model=model,
        fsdp=FSDPConfig(param_dtype="bfloat16", gather_once_per_pass=gather),
        optim=OptimConfig(lr=1e-2),
    )
    spec = UpdateSpec(
        temperature=1.0, pad_token_id=0, max_response_length=4, mini_batch_size=2, micro_batch_size=1,
        experience_micro_batch_size=1, use_kl_loss=kl, kl_coef=0.1, old_logprobs_from_update=old_from_update,
        image_features="per_step" if freeze else "in_forward",
    )  # fmt: skip
    samples = [Sample(Prompt(i, []), 0, [5, 6, 7 + i], [8, 9, 10 + i], []) for i in range(2)]
    for s, advantage in zip(samples, (1.0, -1.0), strict=True):
        s.advantage = advantage
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        policy = build_policy(actor, ONE_CPU_RANK)
        optim = build_optimizer(policy, actor.optim, total_steps=1)
        trained = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
        encode_images(policy, samples, spec)
        if not spec.old_logprobs_in_update(len(samples)):
            for s, lp in zip(samples, compute_logprobs(policy, samples, spec), strict=True):
                s.old_logprobs = lp
        if kl:
            for s, lp in zip(samples, compute_ref_logprobs(None, policy, samples, spec), strict=True):
                s.ref_logprobs = lp
        metrics = update_policy(policy, optim, samples, spec, ONE_CPU_RANK)
        moved = [n for n, p in policy.named_parameters() if n in trained and not torch.equal(p, trained[n])]
    finally:
        dist.destroy_process_group()
    assert torch.isfinite(torch.tensor(metrics["actor/grad_norm"])) and metrics["actor/grad_norm"] > 0
    assert metrics["train/num_micro_batches_max"] == 2
    assert moved and (not rank or any("lora_B" in n for n in moved)), moved
