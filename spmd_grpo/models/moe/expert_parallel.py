"""Expert parallelism as a `ParallelStyle` applied to an experts module from outside (torchtitan's shape).

Shapes: T local tokens, K experts per token, N = T x K routed pairs, E experts, P = EP degree (ranks of the
EP group), e = E / P local experts, R pairs received for the local experts.

`parallelize_module(experts, ep_mesh, ExpertParallel())` shards the stacked expert weights by expert index
(`Shard(0)`: EP rank p holds experts p*e .. p*e + e - 1) and replaces the module's forward with:

    sort_by_expert        the local pairs in expert order (experts.py)
    dispatch              all-to-all of the per-expert counts [P, e], then of the rows: every rank gets the
                          rows routed to its experts, ordered by (source rank, local expert)
    regroup               a stable sort of the received rows by local expert: one grouped GEMM over them
    expert_mlp            the same grouped GEMM as without EP, on the local weights
    combine               the inverse permutation, the all-to-all back, weights and the per-token sum

The router and everything else stay replicated; only the experts module knows about EP, and its result
equals the unsharded module's (tests/distributed/test_update_invariance.py: gradients at EP=2 equal EP=1 on
2 CPU ranks). Both all-to-alls are differentiable (functional collectives' `all_to_all_single_autograd`, as torchtitan),
so the backward sends each row's gradient back to its token's rank, and each EP rank's expert gradients
sum the contributions of every rank's tokens: combined with data parallelism over other ranks, those
gradients must be averaged over the data-parallel ranks only (FSDP's divide factor), not the world.

Not done here: FSDP-sharding the experts over the ranks outside the EP group, the trainer's config key,
checkpoints and the weight sync of EP-sharded experts. The dispatch syncs with the host once per layer (the
split sizes), as torchtitan's does.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DeviceMesh, DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from spmd_grpo.models.moe.experts import combine, expert_mlp, is_stacked_experts, sort_by_expert


class ExpertParallel(ParallelStyle):
    """Shard an experts module by expert index over a 1-D EP mesh, tokens moved by all-to-all."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_stacked_experts(module):
            raise NotImplementedError(f"{type(module).__name__}: not stacked experts")
        if module.num_experts % device_mesh.size() != 0:
            raise ValueError(f"{module.num_experts} experts do not divide over {device_mesh.size()} EP ranks")
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(module, name)
            sharded = distribute_tensor(param.data, device_mesh, [Shard(0)])
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.ep_group = device_mesh.get_group()
        module.forward = types.MethodType(expert_parallel_forward, module)
        return module


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _exchange_counts(tokens_per_expert: torch.Tensor, group) -> torch.Tensor:
    """[E] local pairs per expert -> [P, e]: pairs each source rank sends to each of this rank's experts."""
    ep = dist.get_world_size(group)
    send = tokens_per_expert.view(ep, -1).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received


def expert_parallel_forward(
    experts: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts' forward under EP: same arguments and result as the HF module's (hidden [T, H])."""
    group = experts.ep_group
    ep = dist.get_world_size(group)
    sorted_tokens = sort_by_expert(hidden, top_k_index, top_k_weights, experts.num_experts)
    received = _exchange_counts(sorted_tokens.tokens_per_expert, group)  # [P, e]
    send_splits = sorted_tokens.tokens_per_expert.view(ep, -1).sum(1).tolist()
    recv_splits = received.sum(1).tolist()
    rows = all_to_all_single_autograd(sorted_tokens.hidden, recv_splits, send_splits, group)
    num_local = received.shape[1]
    local_expert = torch.arange(num_local, device=hidden.device).repeat(ep)  # [P * e], (source, expert)
    regroup = torch.argsort(torch.repeat_interleave(local_expert, received.reshape(-1)), stable=True)
    out = expert_mlp(
        rows[regroup],
        received.sum(0),
        _local(experts.gate_up_proj),
        _local(experts.down_proj),
        experts.act_fn,
    )
    inverse = torch.empty_like(regroup)
    inverse[regroup] = torch.arange(regroup.numel(), device=regroup.device)
    back = all_to_all_single_autograd(out[inverse], send_splits, recv_splits, group)
    return combine(back, sorted_tokens).to(hidden.dtype)
