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

Shared prompts (`worker.actor.shared_prompt`): a sample's routes stay [P + R, Y, K] in every layout. In a
shared row the group's one copy of the prompt takes the prompt routes of the group's first sample in the
micro-batch and each response its own (`batch_routes`); the old pass gives every sample of a group the
routes its one prompt copy used (`keep_recorded`), so the reference and update passes replay, token for
token, what the old pass computed, in either layout. Where routes are replayed (`old` in the reference and
update passes, `rollout` in all), samples of one prompt whose prompt routes differ do not share a copy
(`micro_batches.prompt_groups`, `by_routes`): each holds its own prompt, routed its own way, so the result
is the unshared layout's exactly, at the cost of that prompt's tokens. When can they differ? vLLM's routes
are per request; vLLM 0.32 keys the routes of each full KV block by the block's prefix-cache hash (read
in its source, not run here: the route source needs its GPU model runner), so with prefix caching the
prompt's full blocks carry the same routes for every sample of a group, while the tokens of its last,
partial block are computed per request and can differ on a near tie. With `old`, a group that fixed-count
micro-batches cut in the old pass is routed once per part and can differ the same way.
"""

from __future__ import annotations

import torch

from spmd_grpo.data.samples import Sample
from spmd_grpo.models.inputs import SequenceBatch
from spmd_grpo.models.moe.routing import NO_ROUTE, MoEState


def _placements(batch: SequenceBatch, samples: list[Sample]) -> list[tuple[int, int, int]]:
    """Per sample, (column of its prompt's first token, column of its response's first token, its length
    P + R) in the flattened batch: padded b x L with the response after the prompt; packed back to back;
    packed with a shared prompt, a sample that shares its group's prompt points at the group's one copy."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    if not batch.packed:
        width = batch.input_ids.shape[1]
        return [(i * width, i * width + len(s.prompt_ids), lengths[i]) for i, s in enumerate(samples)]
    _, response_starts, prompt_ends = batch.segments()
    return [
        (end - len(s.prompt_ids), start, n)
        for s, start, end, n in zip(samples, response_starts, prompt_ends, lengths, strict=True)
    ]


def batch_routes(batch: SequenceBatch, samples: list[Sample], state: MoEState) -> torch.Tensor | None:
    """The samples' routes laid out like the batch's flattened rows: [B x L or T, Y, K] int16, -1 where
    a token has none (padding, a token vLLM did not report); None when no sample has routes. A shared
    prompt gets the routes of its group's first sample in the batch (`prompt_groups` keeps samples whose
    prompt routes differ apart when they are replayed)."""
    if all(s.routes is None for s in samples):
        return None
    out = torch.full((batch.input_ids.numel(), state.num_layers, state.top_k), NO_ROUTE, dtype=torch.int16)
    shared = batch.shares_prompt.tolist() if batch.shares_prompt is not None else [False] * len(samples)
    for s, (prompt, response, n), holds_prompt in zip(
        samples, _placements(batch, samples), [not x for x in shared], strict=True
    ):
        if s.routes is None:
            continue
        p = len(s.prompt_ids)
        if holds_prompt:
            m = min(p, s.routes.shape[0])
            out[prompt : prompt + m] = s.routes[:m]
        m = max(min(n, s.routes.shape[0]) - p, 0)
        out[response : response + m] = s.routes[p : p + m]
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
    """After an old-logprob forward: each sample's routes = the experts its tokens used (on the CPU), [P + R,
    Y, K]: with a shared prompt, those of the group's one copy of the prompt, then its response's."""
    recorded = state.routes.recorded.cpu()
    for s, (prompt, response, n) in zip(samples, _placements(batch, samples), strict=True):
        p = len(s.prompt_ids)
        s.routes = torch.cat([recorded[prompt : prompt + p], recorded[response : response + n - p]])
