"""torchrun job: the gradient of one mini-batch must not depend on micro-batch size or world size.

    torchrun --nproc_per_node W tests/jobs/grad_invariance.py MODEL_DIR OUT.pt --micro 8,1 --modes token-mean,...
        [--budgets 1,86] [--fused] [--device cuda]

Builds the same global batch of 8 multimodal samples on every rank (fixed seeds; responses of different
lengths, one of them empty, old/ref logprobs perturbed so clipping and KL are active), gives each rank its
contiguous share, and for every (loss aggregation mode, micro-batch size) accumulates the gradient with
`mini_batch_backward` in the same process (one torchrun launch for all of them). Rank 0 saves
{(mode, micro): full gradient}, and with `--budgets` {(mode, "budget<B>"): ...} for token-budget
micro-batches of B tokens, plus {(mode, "budget<B>-uneven"): ...} where rank 0 holds 3 samples and rank 1
holds 5 (uneven token counts and micro-batch counts: rank 0 pads with zero-weight micro-batches).
With `--fused`: {("fused", "separate" | "forward"): (gradient, losses)} on an exactly on-policy mini-batch,
old logprobs from a forward-only pass or from the update's own forward, and the rank's micro-batch counts
{("num_micro_batches", case): [per rank]}.
With `--expert-parallel` (an MoE model): {("ep", micro): gradient} of the token-mean loss at
`expert_parallel_size` = world size, for each micro-batch size, and {("ep-lora", P): ...} of LoRA adapters
at EP = 1 and EP = world size, and {("ep-ref", P): logprobs} of the policy at EP = 1 and of the reference
built at EP = world size.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime

import torch
from PIL import Image

from spmd_grpo.actor.image_features import encode_images
from spmd_grpo.actor.logprob_pass import compute_logprobs
from spmd_grpo.actor.optimizer import clip_grad_norm
from spmd_grpo.actor.spec import UpdateSpec
from spmd_grpo.actor.update import mini_batch_backward
from spmd_grpo.config.workers import ActorConfig, FSDPConfig, LoRAConfig, ModelConfig, RefConfig
from spmd_grpo.data.samples import Prompt, Sample
from spmd_grpo.models.build import build_policy, build_reference
from spmd_grpo.models.families import family_of
from spmd_grpo.models.shared_flex import shared_prompt_attention
from spmd_grpo.parallel.collectives import all_gather_objects, init_distributed
from tests.jobs.common import encode, run_job

NUM_SAMPLES = 8
TIMEOUT_S = 600  # the collective timeout: not torch's 30 min default, so a subgroup without it shows


def make_samples(
    processor, vocab_limit: int, share_from: int | None = None, *, pairs: bool = False
) -> list[Sample]:
    """NUM_SAMPLES samples with their own images; with `share_from` k, samples k.. all take sample k's prompt
    and image (one pixel tensor, as the n samples of one prompt); with `pairs`, samples 2j and 2j + 1 are
    one prompt's group (one `Prompt` record, one pixel tensor: what shared-prompt passes share)."""
    gen = torch.Generator().manual_seed(1234)
    samples = []
    for i in range(NUM_SAMPLES):
        image = Image.new("RGB", (56, 56 + 28 * (i % 2)), ((40 * i) % 255, 100, 200))
        if (share_from is None or i <= share_from) and not (pairs and i % 2):
            enc = encode(processor, [image], f"Which color? {i}")
        length = 0 if i == 2 else 3 + (5 * i) % 9  # 3..11 tokens: uneven micro-batches; one empty
        response = torch.randint(0, vocab_limit, (length,), generator=gen).tolist()
        if not (pairs and i % 2):
            prompt = Prompt(uid=i // 2, prompt_token_ids=[], images=[image])
        samples.append(
            Sample(
                prompt,
                i % 2,
                enc["input_ids"][0].tolist(),
                response,
                [0.0] * length,
                pixel_values=enc["pixel_values"],
                image_grid_thw=enc["image_grid_thw"],
            )
        )
    return samples


def set_inputs(policy, samples: list[Sample], spec: UpdateSpec, old_noise: float = 0.3) -> None:
    """Old/ref logprobs and advantages from fixed seeds around the current logprobs (clipping and the KL
    term are active unless `old_noise` is 0)."""
    gen = torch.Generator().manual_seed(99)
    current = compute_logprobs(policy, samples, spec)
    for s, c in zip(samples, current, strict=True):
        s.old_logprobs = c + old_noise * torch.randn(c.shape, generator=gen)
    for s, c in zip(samples, current, strict=True):
        s.ref_logprobs = c + 0.5 * torch.randn(c.shape, generator=gen)
    advantages = torch.randn(NUM_SAMPLES, generator=gen)
    for s, a in zip(samples, advantages.tolist(), strict=True):
        s.advantage = a


def rank_rows(world, uneven: bool = False) -> slice:
    """This rank's contiguous share: equal, or (world 2) 3 samples on rank 0 and 5 on rank 1."""
    if uneven and world.world_size == 2:
        return slice(0, 3) if world.rank == 0 else slice(3, NUM_SAMPLES)
    share = NUM_SAMPLES // world.world_size
    return slice(world.rank * share, (world.rank + 1) * share)


def backward(policy, samples: list[Sample], spec: UpdateSpec, world, **kwargs) -> tuple[dict, dict]:
    """(full gradient, metric sums) of `samples` (this rank's share) under `spec`."""
    for p in policy.parameters():
        p.grad = None
    sums = mini_batch_backward(policy, samples, spec, world, **kwargs)
    grads = {n: p.grad.full_tensor() for n, p in policy.named_parameters() if p.grad is not None}
    # The clipping norm must be the GLOBAL norm over all shards (same on every rank, any world size).
    grads["__clip_grad_norm__"] = torch.tensor(clip_grad_norm(policy, max_norm=1e9))
    return grads, sums


def gradient(policy, samples: list[Sample], spec: UpdateSpec, world, uneven: bool = False) -> dict:
    set_inputs(policy, samples, spec)
    return backward(policy, samples[rank_rows(world, uneven)], spec, world)[0]


def fused_cases(policy, samples: list[Sample], spec: UpdateSpec, world) -> dict:
    """An exactly on-policy mini-batch, old logprobs from a separate forward-only pass (same micro-batches)
    or from the update's own forward: {("fused", how): (gradient, metric sums, old logprobs)}."""
    set_inputs(policy, samples, spec, old_noise=0.0)
    mine = samples[rank_rows(world)]
    out = {}
    for how in ("separate", "forward"):
        if how == "forward":
            for s in mine:
                s.old_logprobs = None
        grads, sums = backward(policy, mine, spec, world, old_from_forward=how == "forward")
        olds = all_gather_objects([s.old_logprobs for s in mine])
        out["fused", how] = (grads, sums, [lp for part in olds for lp in part])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--micro", required=True, help="comma-separated micro-batch sizes")
    ap.add_argument("--modes", default="token-mean", help="comma-separated loss aggregation modes")
    ap.add_argument("--variants", action="store_true", help="also packed / reused-image-feature cases")
    ap.add_argument("--budgets", default="", help="comma-separated token budgets (dynamic batching)")
    ap.add_argument("--fused", action="store_true", help="old logprobs from the update's forward vs a pass")
    ap.add_argument("--expert-parallel", action="store_true", help="MoE: also the policy at EP=world")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for the accelerator tier (tests/gpu)")
    args = ap.parse_args()
    from transformers import AutoProcessor

    world = init_distributed(args.device, timeout_s=TIMEOUT_S)
    processor = AutoProcessor.from_pretrained(args.model_dir)
    actor = ActorConfig(model=ModelConfig(model_path=args.model_dir), fsdp=FSDPConfig(param_dtype="float32"))
    policy = build_policy(actor, world)
    samples = make_samples(processor, vocab_limit=256)
    base = UpdateSpec(
        temperature=1.0,
        pad_token_id=processor.tokenizer.pad_token_id,
        max_response_length=16,
        mini_batch_size=NUM_SAMPLES // world.world_size,
        micro_batch_size=1,
        experience_micro_batch_size=1,
        clip_ratio_high=0.28,
        entropy_coef=0.01,
        use_kl_loss=True,
        kl_coef=0.1,
    )
    out = {}
    for mode in args.modes.split(","):
        for micro in map(int, args.micro.split(",")):
            spec = dataclasses.replace(
                base, loss_agg_mode=mode, micro_batch_size=micro, experience_micro_batch_size=micro
            )
            out[(mode, micro)] = gradient(policy, samples, spec, world)
        for budget in [int(b) for b in args.budgets.split(",") if b]:
            spec = dataclasses.replace(base, loss_agg_mode=mode, dynamic_batching=True)
            spec = dataclasses.replace(
                spec, max_token_len_for_update=budget, max_token_len_for_experience=budget
            )
            for uneven in (False, True):
                out[(mode, f"budget{budget}" + ("-uneven" if uneven else ""))] = gradient(
                    policy, samples, spec, world, uneven
                )
    if args.variants:
        out.update(variants(policy, actor, processor, dataclasses.replace(base, micro_batch_size=2), world))
    if args.fused:
        spec = dataclasses.replace(base, micro_batch_size=2, experience_micro_batch_size=2)
        out.update(fused_cases(policy, samples, spec, world))
    if args.expert_parallel:
        micros = list(map(int, args.micro.split(",")))
        out.update(expert_parallel_grads(policy, actor, processor, base, micros, world))
    if world.rank == 0:
        torch.save(out, args.out)


def expert_parallel_grads(
    policy, actor: ActorConfig, processor, spec: UpdateSpec, micros: list[int], world
) -> dict:
    """{("ep", micro): gradient} of the policy built with `worker.actor.fsdp.expert_parallel_size` = the
    world size (experts sharded by index over the ranks, all-to-all dispatch, the experts' own FSDP unit
    over the remaining ranks), for the same samples as the unsharded cases; {("ep-lora", P): gradient} of
    rank-4 LoRA adapters on the frozen base at EP = P (1 and the world size), the first micro-batch size;
    {("ep-ref", P): rank 0's logprobs} of `policy` (P = 1) and of the reference built at EP = world size."""
    ep = world.world_size
    fsdp = dataclasses.replace(actor.fsdp, expert_parallel_size=ep)
    mine = make_samples(processor, 256)[rank_rows(world)]
    out = {("ep-ref", 1): compute_logprobs(policy, mine, spec)}
    reference = build_reference(dataclasses.replace(actor, fsdp=fsdp), RefConfig(), world)
    out["ep-ref", ep] = compute_logprobs(reference, mine, spec)
    del reference
    for lora_rank, size in ((0, ep), (4, 1), (4, ep)):
        model = dataclasses.replace(actor.model, lora=LoRAConfig(rank=lora_rank, alpha=8.0))
        fsdp = dataclasses.replace(actor.fsdp, expert_parallel_size=size)
        policy = build_policy(dataclasses.replace(actor, model=model, fsdp=fsdp), world)
        experts = [p for n, p in policy.named_parameters() if n.endswith("experts.gate_up_proj")]
        assert experts and all(p.device_mesh.ndim == (2 if size > 1 else 1) for p in experts)
        if size > 1:  # the expert mesh's groups take the collective timeout, not torch's default (30 min)
            mesh = experts[0].device_mesh
            timeouts = {
                mesh[d].get_group()._get_backend(torch.device("cpu")).options._timeout
                for d in mesh.mesh_dim_names
            }
            assert timeouts == {datetime.timedelta(seconds=world.timeout_s)}, timeouts
        for micro in micros if not lora_rank else micros[:1]:
            case = dataclasses.replace(spec, micro_batch_size=micro, experience_micro_batch_size=micro)
            key = ("ep-lora", size) if lora_rank else ("ep", micro)
            out[key] = gradient(policy, make_samples(processor, 256), case, world)
    return out


def variants(policy, actor: ActorConfig, processor, spec: UpdateSpec, world) -> dict:
    """("other_gathering",): micro-batches of one with the other `gather_once_per_pass`; ("packed",): the
    padding-free forward; ("offload",), on an accelerator: the policy with `fsdp.offload_params`; ("shared", ...):
    shared-prompt passes (`shared_prompt_cases`); ("frozen",) / ("reuse",): a policy with a frozen vision tower
    without / with image features encoded once (`encode_images`). Rank 1's samples 4.. share one image, so
    the ranks have different numbers of images to encode (8 against 5 calls of one prompt: rank 1 runs
    3 dummy images to keep FSDP's collectives aligned)."""
    out = {}
    # The other FSDP gathering (the CPU default keeps parameters gathered through a pass; accelerators
    # gather per micro-batch and reduce every micro-batch's gradient): the same gradient.
    policy.gather_once_per_pass = not policy.gather_once_per_pass
    one_each = dataclasses.replace(spec, micro_batch_size=1, experience_micro_batch_size=1)
    out[("other_gathering",)] = gradient(policy, make_samples(processor, 256), one_each, world)
    policy.gather_once_per_pass = not policy.gather_once_per_pass
    policy.padding_free = True
    out[("packed",)] = gradient(policy, make_samples(processor, 256), spec, world)
    policy.padding_free = False
    # Shards in host memory, computing on the accelerator (on the CPU both are host memory: model_load.py)
    if world.device_type != "cpu":
        fsdp = dataclasses.replace(actor.fsdp, offload_params=True)
        offloaded = build_policy(dataclasses.replace(actor, fsdp=fsdp), world)
        grads = gradient(offloaded, make_samples(processor, 256), spec, world)
        out[("offload",)] = {n: g.to(world.device) for n, g in grads.items()}
        del offloaded
    frozen = build_policy(
        dataclasses.replace(actor, model=dataclasses.replace(actor.model, freeze_vision_tower=True)), world
    )
    share_from = 4 if world.rank == 1 else None
    out[("frozen",)] = gradient(frozen, make_samples(processor, 256, share_from), spec, world)
    reuse = dataclasses.replace(spec, image_features="per_step")
    samples = make_samples(processor, 256, share_from)
    encode_images(frozen, samples, reuse)
    assert all(s.image_features is not None for s in samples)
    out[("reuse",)] = gradient(frozen, samples, reuse, world)
    family = family_of(policy.config)
    # The shared-prompt cases under FSDP: the dense family's job (the MoE and hybrid layouts: unit tests,
    # tests/unit/test_shared_prompt_moe.py)
    if not (family.moe or family.linear_attention):
        out.update(shared_prompt_cases(policy, processor, spec, world))
    return out


def shared_prompt_cases(policy, processor, spec: UpdateSpec, world) -> dict:
    """("shared", split, on): the gradient of groups of two samples (one prompt each) with each prompt held
    once (on) or per sample, packed, in micro-batches of 2 samples or of a 45-token budget (which cuts
    rank 0's first group: its prompt and both responses do not fit)."""
    out = {}
    budget = dataclasses.replace(
        spec, dynamic_batching=True, max_token_len_for_update=45, max_token_len_for_experience=45
    )
    before = policy.padding_free, policy.shared_prompt, policy.hf.config._attn_implementation
    policy.padding_free = True
    for split, case in (("micro2", spec), ("budget45", budget)):
        for on in (False, True):
            policy.shared_prompt = on  # with the kernel the build picks for it (flex attention on CUDA)
            policy.hf.set_attn_implementation(shared_prompt_attention(world.device_type) if on else before[2])
            out[("shared", split, on)] = gradient(
                policy, make_samples(processor, 256, pairs=True), case, world
            )
    policy.padding_free, policy.shared_prompt, _ = before
    policy.hf.set_attn_implementation(before[2])
    return out


if __name__ == "__main__":
    run_job(main)
