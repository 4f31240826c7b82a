"""The forward-only logprob pass: old-policy and reference logprobs of the response tokens, micro-batched the
same way as the update (the same count on every rank), with no autograd graph. The pass runs the model in
eval mode (LoRA dropout off: the logprobs vLLM sampled from and the reference have no dropout either). On
the CPU the parameters are gathered once for the whole pass (actor/gathering.py).
"""

from __future__ import annotations

import torch
from torch import nn

from spmd_grpo.actor.gathering import gathered_for_pass
from spmd_grpo.actor.image_features import attach_image_features
from spmd_grpo.actor.micro_batches import collate_for, micro_batches, uses_packing, uses_shared_prompt
from spmd_grpo.actor.routes import keep_recorded
from spmd_grpo.actor.spec import UpdateSpec
from spmd_grpo.data.samples import Sample
from spmd_grpo.models.lora import adapters_disabled


@torch.no_grad()
def compute_logprobs(
    model: nn.Module, samples: list[Sample], spec: UpdateSpec, *, route_pass: str = "old"
) -> list[torch.Tensor]:
    """Per-sample response logprobs (1-D CPU float32 tensors), micro-batched for experience (a padding
    micro-batch runs one of the rank's samples and drops the result). With a trained tower
    (`spec.image_features` per_pass), `model` encodes each prompt's images once for the whole pass instead of once per
    sample: the tower's share of the pass drops by the factor n (Qwen2.5-VL-7B: a 675M-parameter tower over
    ~4 patches per image token, roughly a fifth of a geometry3k sample's forward, run once instead of 5
    times for n = 5). An MoE model's routers compare with or replay the samples' routes as `route_pass`
    (old, ref) asks, and the old pass keeps the routes it used (actor/routes.py)."""
    training = model.training
    model.eval()
    try:
        return _logprobs(model, samples, spec, route_pass)
    finally:
        model.train(training)


def compute_ref_logprobs(
    reference: nn.Module | None, policy: nn.Module, samples: list[Sample], spec: UpdateSpec
) -> list[torch.Tensor]:
    """Reference logprobs: from the reference model, or, with LoRA (no reference model is built), from the
    policy with its adapters disabled (the base weights, verl's LoRA reference)."""
    if reference is not None:
        return compute_logprobs(reference, samples, spec, route_pass="ref")
    with adapters_disabled(policy):
        return compute_logprobs(policy, samples, spec, route_pass="ref")


def _logprobs(
    model: nn.Module, samples: list[Sample], spec: UpdateSpec, route_pass: str
) -> list[torch.Tensor]:
    per_pass = spec.image_features == "per_pass"
    if per_pass:
        attach_image_features(model, samples, spec)
    out: list[torch.Tensor | None] = [None] * len(samples)
    keeps_routes = (
        getattr(model, "moe", None) is not None and route_pass == "old" and spec.routing_replay != "rollout"
    )
    with gathered_for_pass(model):
        shared = uses_shared_prompt(model)
        for rows in micro_batches(
            samples, spec, for_update=False, padded=not uses_packing(model), shared=shared
        ):
            chunk = [samples[i] for i in rows] or samples[:1]
            batch = collate_for(model, chunk, spec, for_update=False, route_pass=route_pass, padding=not rows)
            lp, _ = model(batch, temperature=spec.temperature)
            for j, i in enumerate(rows):
                out[i] = lp[j, : len(samples[i].response_ids)].float().cpu()
            if rows and keeps_routes:
                keep_recorded(model.moe, batch, chunk)
    if per_pass:  # this model's features: not the next pass's, and the update must re-encode with grad
        for s in samples:
            s.image_features = None
    return out
