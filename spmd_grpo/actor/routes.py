"""Routing replay between the trainer's passes (`worker.actor.moe.routing_replay`) for MoE policies.

Shapes: B sequences of a micro-batch, L its padded length (T tokens when packed), Y decoder layers, K experts
per token; a sample's routes are [its tokens, Y, K] int16 (`Sample.routes`, vLLM's layout).

What each pass gives its routers (`models.moe.routing`):

    mode      old-logprob pass                 reference pass     update
    none      records the routes it used       compares           compares
    old       records the routes it used       replays them       replays them
    rollout   replays vLLM's routes            replays vLLM's     replays vLLM's

"compares": the router keeps its own top-k and counts how many of those decisions differ from the
sample's routes (`moe/route_diff/<pass>`); with `rollout` the old pass's count is trainer vs vLLM. With
`old`, the routes must exist before the reference pass, so the old-logprob pass runs separately even on an
exactly on-policy step (`UpdateSpec.old_logprobs_in_update`): one more forward pass per step.
"""

from __future__ import annotations

import torch

from spmd_grpo.data.samples import Sample
from spmd_grpo.models.inputs import SequenceBatch
from spmd_grpo.models.moe.routing import NO_ROUTE, MoEState


def _sequence_slots(batch: SequenceBatch, lengths: list[int]) -> list[int]:
    """Flattened row of each sequence's first token in the batch (packed: back to back; padded: b x L)."""
    if batch.packed:
        return [sum(lengths[:i]) for i in range(len(lengths))]
    width = batch.input_ids.shape[1]
    return [i * width for i in range(len(lengths))]


def batch_routes(batch: SequenceBatch, samples: list[Sample], state: MoEState) -> torch.Tensor | None:
    """The samples' routes laid out like the batch's flattened rows: [B x L or T, Y, K] int16, -1 where
    a token has none (padding, a token vLLM did not report); None when no sample has routes."""
    if all(s.routes is None for s in samples):
        return None
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    out = torch.full((batch.input_ids.numel(), state.num_layers, state.top_k), NO_ROUTE, dtype=torch.int16)
    for s, start, n in zip(samples, _sequence_slots(batch, lengths), lengths, strict=True):
        if s.routes is not None:
            m = min(n, s.routes.shape[0])
            out[start : start + m] = s.routes[:m]
    return out.to(batch.input_ids.device)


def attach_routes(
    batch: SequenceBatch, samples: list[Sample], state: MoEState, *, mode: str, route_pass: str
) -> SequenceBatch:
    """Mark `batch` for `route_pass` (old, ref, update) under replay `mode` (the table above). In place."""
    batch.route_pass = route_pass
    given = mode == "rollout" or route_pass != "old"
    batch.replay_routes = mode == "rollout" or (mode == "old" and route_pass != "old")
    batch.routes = batch_routes(batch, samples, state) if given else None
    return batch


def keep_recorded(state: MoEState, batch: SequenceBatch, samples: list[Sample]) -> None:
    """After an old-logprob forward: each sample's routes = the experts its tokens used (on the CPU)."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    recorded = state.routes.recorded.cpu()
    for s, start, n in zip(samples, _sequence_slots(batch, lengths), lengths, strict=True):
        s.routes = recorded[start : start + n].clone()
