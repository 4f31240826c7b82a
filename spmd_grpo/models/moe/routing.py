"""Top-k routing with replay, route recording and per-layer load and disagreement counts.

Shapes: T tokens of one forward (the MoE block's flattened rows: B x L padded, or the T of a packed row),
E experts, K experts per token, Y decoder layers (every layer has a slot, vLLM's layout; dense layers
keep -1).

The router's forward is replaced (`use_routing`) by `routed_forward`, which computes what transformers'
Qwen3-VL-MoE / Qwen3.5-MoE `TopKRouter` computes (logits = x W^T; softmax in fp32; top-k; the chosen
probabilities divided by their sum, the model's own top-k normalisation, cast to the logits' dtype) with
one change: when the forward carries routes to replay (`Routes.replay`), each token's experts are the
given ones instead of its own top-k, and their weights are still the router's current probabilities
of those experts, normalised over them, so the router's gradient flows as it would have for that choice.
Tokens without a given route (-1: padding, the last token of a vLLM sequence) keep their own top-k.

Every forward also
  * records the experts each token used (`Routes.recorded`, [T, Y, K] int16): the old-logprob pass keeps
    them as the routes the update and the reference replay with `routing_replay=old`;
  * counts, against the given routes, how many of the router's own top-k choices are not among them
    (`moe/route_diff/<pass>`: a decision = one (token, layer, slot));
  * counts tokens per expert per layer (for `moe/load/*`) over the valid tokens;
  * weighs every count (and the load-balancing terms below) by the sequences a token stands for
    (`MoEState.begin`'s `copies`): a prompt held once for its group's n samples counts n times, so a
    shared-prompt forward reports what the unshared one does;
  * with `aux_loss_coef` > 0, accumulates the Switch-Transformer load-balancing terms (transformers'
    `load_balancing_loss_func`: E x sum_e f_e P_e, f_e the fraction of top-k slots given to expert e and
    P_e its mean router probability, over all MoE layers' valid tokens).

Activation checkpointing runs a layer's forward again in the backward: each layer records and counts only
once per forward of the model (`Routes.seen`), and the recomputation replays the routes the first
run used (the recorded ones when nothing was given), so both runs compute the same sub-network; it also
computes the load-balancing terms again without keeping them, since checkpointing needs the recomputation
to save the same tensors for the backward as the first run did.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

NO_ROUTE = -1


@dataclass
class Routes:
    """What one forward of the model gives its routers and gets back from them (held by `MoEState`)."""

    valid: torch.Tensor  # [T] bool: real tokens (not padding)
    copies: torch.Tensor  # [T] float64: the sequences each token stands for (0 on padding; see `begin`)
    given: torch.Tensor | None = None  # [T, Y, K] long, NO_ROUTE where none: the reference routes
    replay: bool = False  # use `given` (else only compare with it)
    recorded: torch.Tensor | None = None  # [T, Y, K] int16, filled by each MoE layer (NO_ROUTE: dense layer)
    seen: set[int] = field(default_factory=set)  # layers that already ran in this forward


@dataclass
class MoEState:
    """Per model: the current forward's routes and the counts since the last `take_metrics`."""

    num_layers: int
    num_experts: int
    top_k: int
    aux_loss_coef: float = 0.0
    """> 0: forwards with gradients accumulate the load-balancing loss terms (`aux_loss_value`)."""
    routes: Routes | None = None
    pass_name: str = "update"
    load: torch.Tensor | None = None  # [Y, E] float64 tokens per expert, on the device
    diff: dict[str, torch.Tensor] = field(default_factory=dict)  # pass -> [differing, compared] float64
    aux_terms: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def begin(
        self,
        valid: torch.Tensor,
        given: torch.Tensor | None,
        *,
        replay: bool,
        pass_name: str,
        copies: torch.Tensor | None = None,
    ) -> None:
        """Set up the next forward of the model (its valid-token mask [T] and routes [T, Y, K] or None).
        `copies` [T]: how many sequences each token stands for (a shared prompt's tokens: its group's
        samples in the batch; None: 1 each). The load counts, the route differences and the load-balancing
        terms weigh each token by it, so they equal those of the unshared layout, where each sample
        computes its own copy of the prompt."""
        shape = (valid.numel(), self.num_layers, self.top_k)
        recorded = torch.full(shape, NO_ROUTE, dtype=torch.int16, device=valid.device)
        weight = valid.double() if copies is None else valid.double() * copies.to(valid.device, torch.float64)
        self.routes = Routes(valid, weight, given, replay, recorded)
        self.pass_name = pass_name
        self.aux_terms.clear()

    def take_metrics(self) -> dict[str, torch.Tensor]:
        """Local sums since the last call: `load` [Y, E] and `diff/<pass>` [differing, compared]."""
        out = {f"diff/{name}": v.cpu() for name, v in self.diff.items()}
        if self.load is not None:
            out["load"] = self.load.cpu()
        self.load, self.diff = None, {}
        return out

    def aux_loss_value(self) -> torch.Tensor | None:
        """transformers' load-balancing loss over this forward's MoE layers (None without terms)."""
        if not self.aux_terms:
            return None
        counts = sum(t[0] for t in self.aux_terms)
        probs = sum(t[1] for t in self.aux_terms)
        rows = sum(t[2] for t in self.aux_terms).clamp(min=1)
        return self.num_experts * torch.sum((counts / rows) * (probs / rows))


def _not_in(own: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """[T, K] bool: own[t, j] is not one of given[t, :]."""
    return ~(own[:, :, None] == given[:, None, :]).any(-1)


def _first_run(router: nn.Module, routes: Routes, own: torch.Tensor) -> None:
    """Record, count load, differences and the aux loss for this layer's first run in this forward."""
    state, layer = router.moe_state, router.moe_layer
    routes.seen.add(layer)
    copies = routes.copies
    if routes.given is not None:
        given = routes.given[:, layer]
        compared = copies * (given >= 0).all(-1)
        sums = torch.stack([(_not_in(own, given).sum(-1) * compared).sum(), compared.sum() * state.top_k])
        state.diff[state.pass_name] = state.diff.get(state.pass_name, 0) + sums
    used = routes_used(routes, layer, own).reshape(-1)
    weights = copies.repeat_interleave(state.top_k)
    counts = torch.bincount(used, weights=weights, minlength=state.num_experts)
    if state.load is None:
        state.load = torch.zeros(state.num_layers, state.num_experts, dtype=torch.float64, device=own.device)
    state.load[layer] += counts.double()
    routes.recorded[:, layer] = routes_used(routes, layer, own).to(torch.int16)


def routes_used(routes: Routes, layer: int, own: torch.Tensor) -> torch.Tensor:
    """[T, K] long: the given routes where they replay, else the router's own top-k."""
    if not routes.replay or routes.given is None:
        return own
    given = routes.given[:, layer]
    return torch.where((given >= 0).all(-1, keepdim=True), given, own)


def routed_forward(router: nn.Module, hidden_states: torch.Tensor):
    """Drop-in for the HF TopKRouter's forward: (router_logits [T, E], weights [T, K], indices [T, K])."""
    hidden_states = hidden_states.reshape(-1, router.hidden_dim)
    logits = F.linear(hidden_states, router.weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    own = torch.topk(probs, router.top_k, dim=-1).indices
    state: MoEState = router.moe_state
    routes, layer = state.routes, router.moe_layer
    if routes is None or routes.valid.numel() != own.shape[0]:  # a forward nobody set up: plain top-k
        chosen = own
    else:
        recomputed = layer in routes.seen  # activation checkpointing's recomputation: the first run's routes
        if not recomputed:
            _first_run(router, routes, own)
        chosen = routes.recorded[:, layer].long() if recomputed else routes_used(routes, layer, own)
        if state.aux_loss_coef > 0 and torch.is_grad_enabled():
            # The recomputation computes the terms again, unused: checkpointing restores the tensors the
            # first run saved for the backward by recomputing the same operations in the same order.
            terms = _aux_terms(state.num_experts, routes.copies, probs, chosen)
            if not recomputed:
                state.aux_terms.append(terms)
    weights = probs.gather(1, chosen)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(logits.dtype), chosen


def _aux_terms(num_experts: int, copies: torch.Tensor, probs: torch.Tensor, chosen: torch.Tensor) -> tuple:
    """One layer's load-balancing terms (`MoEState.aux_loss_value`): slots per expert, summed router
    probabilities per expert, tokens; each token weighed by the sequences it stands for."""
    mask = copies.to(probs.dtype)
    counts = torch.zeros(num_experts, dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(0, chosen.reshape(-1), mask.repeat_interleave(chosen.shape[1]))
    return counts, (probs * mask[:, None]).sum(0), mask.sum()


def use_routing(router: nn.Module, state: MoEState, layer: int) -> None:
    """Swap one HF TopKRouter's forward for `routed_forward`, reporting to `state` as decoder layer `layer`."""
    for name in ("weight", "top_k", "hidden_dim"):
        if not hasattr(router, name):
            raise NotImplementedError(f"{type(router).__name__}: a router without `{name}`")
    router.moe_state, router.moe_layer = state, layer
    router.forward = types.MethodType(routed_forward, router)
