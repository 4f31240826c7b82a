"""torchrun job: policy and reference built on the meta device and filled from the checkpoint equal
`from_pretrained`, at any world size.

    torchrun --nproc_per_node W tests/jobs/model_load.py OUT.pt MODEL_DIR [MODEL_DIR ...] [--remote-code DIR]

For every model directory (the tests pass the tied and the untied tiny model), every rank builds:
  * the policy (fp32; on tied models with a frozen vision tower and activation checkpointing, as the
    engine tests train) and compares every parameter (gathered), every buffer (the text and the vision
    rotary `inv_freq`) and the full fp32 logits of a multimodal prompt, plus the trainer's logprobs of 8
    multimodal samples, with a `from_pretrained` fp32 model: all must be bit-identical (`torch.equal`);
  * the reference with `worker.ref.dtype=bfloat16`: its dtypes, and parameters, buffers and logprobs against
    `from_pretrained(dtype=bfloat16)`;
  * the reference with `worker.ref.offload_params` (fp32 here, CPU: unpinned host shards): the same
    logprobs as without offload;
  * the policy with `worker.actor.fsdp.offload_params`: one forward/backward/AdamW step, after which its
    parameters equal those of the policy without offload after the same step;
  * the policy with LoRA (`worker.actor.model.lora`): its base equals `from_pretrained`, its adapter
    gradients and their norm equal those of a single-process PEFT model (`peft.get_peft_model`, the same
    adapter values, B made non-zero so A gets a gradient too), only adapters reach the optimizer, with
    adapters disabled it gives the base model's logprobs exactly (the KL reference), and with
    `fsdp.param_dtype=bfloat16` the base is held in bf16 and the adapters in fp32.
Model directories after `--policy-and-lora` (the MoE and hybrid families) get the policy and LoRA checks
only: the loader reads their experts from the layout their file holds (transposed, per expert) into
transformers' layout, bit-identical to `from_pretrained`; `lora_targets` lists the adapted modules.
With `--remote-code DIR` (a checkpoint shipping its own model and config classes through `auto_map`) it
also builds the policy with `worker.actor.model.trust_remote_code` off and on and records which classes
`build_policy` made. Rank 0 saves {model name: {check: result}}; the checks that need every rank's view
(buffers, logits) are combined over ranks first.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from PIL import Image
from torch.distributed.tensor import DTensor

from spmd_grpo.actor.logprob_pass import compute_logprobs
from spmd_grpo.actor.micro_batches import collate_samples
from spmd_grpo.actor.optimizer import build_optimizer, clip_grad_norm
from spmd_grpo.actor.spec import UpdateSpec
from spmd_grpo.config.workers import ActorConfig, FSDPConfig, LoRAConfig, ModelConfig, RefConfig
from spmd_grpo.models.build import attention_setup, build_policy, build_reference
from spmd_grpo.models.lora import adapters_disabled, is_adapter_name, set_full_tensor
from spmd_grpo.models.policy import PolicyModule, unsamplable_token_ids
from spmd_grpo.parallel.collectives import all_gather_objects, init_distributed
from tests.jobs.common import encode, run_job
from tests.jobs.grad_invariance import make_samples

WRAPPERS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def clean(name: str) -> str:
    for w in WRAPPERS:
        name = name.replace(w, "")
    return name


def plain(model_dir: str, dtype: torch.dtype) -> PolicyModule:
    """The reference implementation: transformers' own loading, no FSDP, with the attention and the layout
    (packed or padded) that `padding_free=auto` gives the trainer's models on this device."""
    from transformers import AutoModelForImageTextToText

    packed, attention = attention_setup("auto", "cpu")
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype, attn_implementation=attention)
    return PolicyModule(hf, unsamplable_token_ids(hf.config), padding_free=packed).eval()


def full_state(model: PolicyModule) -> dict[str, torch.Tensor]:
    """Every parameter (gathered if sharded) and buffer of the HF model, by clean name."""
    out = {}
    for name, t in model.hf.state_dict().items():
        out[clean(name)] = t.full_tensor() if hasattr(t, "full_tensor") else t
    for name, b in model.hf.named_buffers():
        out[clean(name)] = b
    return out


def mismatches(got: dict, want: dict) -> list[str]:
    bad = [
        n for n in want if n not in got or got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n])
    ]
    return bad + sorted(set(got) - set(want))


def full_logits(model: PolicyModule, enc: dict) -> torch.Tensor:
    """Logits of the HF model over the whole prompt (the FSDP root's own parameters gathered around it)."""
    sharded = hasattr(model, "unshard")
    if sharded:
        model.unshard()
    with torch.no_grad():
        logits = model.hf(**enc, use_cache=False).logits
    if sharded:
        model.reshard()
    return logits


def spec_for(processor) -> UpdateSpec:
    pad = processor.tokenizer.pad_token_id
    return UpdateSpec(1.0, pad, 16, mini_batch_size=8, micro_batch_size=4, experience_micro_batch_size=4)


def logprobs(model, samples, spec) -> list[torch.Tensor]:
    with torch.no_grad():
        return compute_logprobs(model, samples, spec)


def equal_lists(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def every_rank(flag: bool) -> bool:
    return all(all_gather_objects(bool(flag)))


def check_policy(model_dir: str, actor: ActorConfig, world, inputs) -> dict:
    enc, samples, spec = inputs
    want = plain(model_dir, torch.float32)
    policy = build_policy(actor, world)
    lp, want_lp = logprobs(policy, samples, spec), logprobs(want, samples, spec)
    logits, want_logits = full_logits(policy, enc), full_logits(want, enc)
    want_state = full_state(want)
    hf = policy.hf
    return {
        "policy_mismatches": mismatches(full_state(policy), want_state),
        "policy_checked": len(want_state),
        "policy_dtypes": sorted({str(p.dtype) for p in policy.parameters()}),
        "policy_logits_equal": every_rank(torch.equal(logits, want_logits)),
        "policy_logprobs_equal": every_rank(equal_lists(lp, want_lp)),
        "policy_tied": hf.lm_head.weight is hf.get_input_embeddings().weight,
        "rotary_buffers": sorted(n for n in want_state if n.endswith("inv_freq")),
    }


def check_reference(model_dir: str, actor: ActorConfig, world, inputs) -> dict:
    _, samples, spec = inputs
    want = plain(model_dir, torch.bfloat16)
    ref = build_reference(actor, RefConfig(dtype="bfloat16"), world)
    lp, want_lp = logprobs(ref, samples, spec), logprobs(want, samples, spec)
    # (the shared samples include an empty response: nothing to compare there)
    diff = max((a - b).abs().max().item() for a, b in zip(lp, want_lp, strict=True) if a.numel())
    return {
        "ref_dtypes": sorted({str(p.dtype) for p in ref.parameters()}),
        "ref_requires_grad": any(p.requires_grad for p in ref.parameters()),
        "ref_mismatches": mismatches(full_state(ref), full_state(want)),
        "ref_logprobs_equal": every_rank(equal_lists(lp, want_lp)),
        "ref_logprobs_max_diff": diff,
    }


def check_offload(actor: ActorConfig, world, inputs) -> dict:
    """Offloaded reference: same logprobs. Offloaded policy: same parameters after one step."""
    _, samples, spec = inputs
    ref = build_reference(actor, RefConfig(), world)
    ref_off = build_reference(actor, RefConfig(offload_params=True), world)
    same_ref = equal_lists(logprobs(ref, samples, spec), logprobs(ref_off, samples, spec))
    stepped = []
    for offload in (False, True):
        fsdp = FSDPConfig(param_dtype="float32", offload_params=offload)
        policy = build_policy(ActorConfig(model=actor.model, fsdp=fsdp), world)
        optim = build_optimizer(policy, actor.optim, total_steps=1).optimizer
        lp, _ = policy(collate_samples(samples[:4], spec.pad_token_id, world.device))
        lp.sum().backward()
        optim.step()
        stepped.append({clean(n).removeprefix("hf."): p.full_tensor() for n, p in policy.named_parameters()})
    before = full_state(plain(actor.model.model_path, torch.float32))
    return {
        "ref_offload_logprobs_equal": every_rank(same_ref),
        # after its forwards the offloaded reference holds host shards only (its root resharded too)
        "ref_offload_on_host": all(
            isinstance(p, DTensor) and p.to_local().device.type == "cpu" for p in ref_off.parameters()
        ),
        "policy_offload_mismatches": mismatches(stepped[1], stepped[0]),
        "policy_step_changed": sum(not torch.equal(t, before[n]) for n, t in stepped[0].items()),
        "policy_trainable": sum(p.requires_grad for p in policy.parameters()),
    }


def check_lora(model_dir: str, actor: ActorConfig, world, inputs) -> dict:
    """LoRA policy against a single-process PEFT model of the same adapters (see the module docstring)."""
    from dataclasses import replace

    from peft import LoraConfig, get_peft_model

    _, samples, spec = inputs
    lora = LoRAConfig(rank=4, alpha=8.0)
    policy = build_policy(replace(actor, model=replace(actor.model, lora=lora)), world)
    ours = {clean(n).removeprefix("hf."): p for n, p in policy.named_parameters() if is_adapter_name(n)}
    gen = torch.Generator().manual_seed(1)
    for p in ours.values():  # B non-zero (0 at init): A's gradient would vanish and prove nothing
        set_full_tensor(p, p.full_tensor() + 0.05 * torch.randn(p.shape, generator=gen))
    plain_model = plain(model_dir, torch.float32)
    base_lp = logprobs(plain_model, samples, spec)
    targets = sorted({n.split(".lora_")[0] for n in ours})
    peft_cfg = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=targets)
    peft_model = get_peft_model(plain_model.hf, peft_cfg)  # wraps plain_model.hf's layers in place
    theirs = {
        n.removeprefix("base_model.model."): p for n, p in peft_model.named_parameters() if p.requires_grad
    }
    with torch.no_grad():
        for n, p in theirs.items():
            p.copy_(ours[n].full_tensor())
    batch = collate_samples(samples[:4], spec.pad_token_id, world.device)
    for model in (policy, plain_model):
        lp, _ = model(batch)
        lp.sum().backward()
    grad_diff = max((ours[n].grad.full_tensor() - p.grad).abs().max().item() for n, p in theirs.items())
    their_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in theirs.values()])).item()
    with adapters_disabled(policy):
        disabled_lp = logprobs(policy, samples, spec)
    bf16 = build_policy(
        replace(actor, model=replace(actor.model, lora=lora), fsdp=FSDPConfig(param_dtype="bfloat16")), world
    )
    return {
        "lora_names_match": sorted(ours) == sorted(theirs) and len(theirs) > 0,
        "lora_targets": targets,
        "lora_grad_max_diff": grad_diff,
        "lora_grad_max": max(p.grad.abs().max().item() for p in theirs.values()),
        "lora_grad_norm": (clip_grad_norm(policy, 1e9), their_norm),
        "lora_optimizer_tensors": (
            sum(len(g["params"]) for g in build_optimizer(policy, actor.optim, 1).optimizer.param_groups),
            len(ours),
        ),
        "lora_base_mismatches": mismatches(
            {base_name_of(n): t for n, t in full_state(policy).items() if not is_adapter_name(n)},
            full_state(plain(model_dir, torch.float32)),
        ),
        "lora_disabled_equals_base": every_rank(equal_lists(disabled_lp, base_lp)),
        "lora_enabled_differs": not equal_lists(logprobs(policy, samples, spec), base_lp),
        "lora_bf16_dtypes": sorted(
            {(str(p.dtype), is_adapter_name(n), p.requires_grad) for n, p in bf16.named_parameters()}
        ),
    }


def base_name_of(name: str) -> str:
    return name.replace(".base_layer.", ".")


def check_remote_code(model_dir: str, world) -> dict:
    """{trust_remote_code: (model class, config class)} of the policy `build_policy` makes from the config."""
    classes = {}
    for trust in (False, True):
        model = ModelConfig(model_path=model_dir, trust_remote_code=trust)
        policy = build_policy(ActorConfig(model=model, fsdp=FSDPConfig(param_dtype="float32")), world)
        classes[trust] = (type(policy.hf).__name__, type(policy.hf.config).__name__)
        del policy
    return classes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("model_dirs", nargs="*")
    ap.add_argument("--policy-and-lora", nargs="*", default=[], metavar="MODEL_DIR")
    ap.add_argument("--remote-code", help="a checkpoint with its own classes (auto_map)")
    args = ap.parse_args()
    from transformers import AutoProcessor

    torch.manual_seed(0)
    world = init_distributed("cpu")
    results = {"world_size": world.world_size}
    for model_dir in args.model_dirs + args.policy_and_lora:
        processor = AutoProcessor.from_pretrained(model_dir)
        enc = dict(encode(processor, [Image.new("RGB", (56, 84), (200, 30, 90))], "Which color?"))
        inputs = (enc, make_samples(processor, vocab_limit=256), spec_for(processor))
        tied = plain(model_dir, torch.float32).hf.config.tie_word_embeddings
        model = ModelConfig(
            model_path=model_dir, freeze_vision_tower=tied, enable_gradient_checkpointing=tied
        )
        actor = ActorConfig(model=model, fsdp=FSDPConfig(param_dtype="float32"))
        out = {"tied": tied}
        out.update(check_policy(model_dir, actor, world, inputs))
        if model_dir not in args.policy_and_lora:
            out.update(check_reference(model_dir, actor, world, inputs))
            out.update(check_offload(actor, world, inputs))
        out.update(check_lora(model_dir, actor, world, inputs))
        results[Path(model_dir).name] = out
    if args.remote_code:
        results["remote_code"] = check_remote_code(args.remote_code, world)
    if world.rank == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    run_job(main)
