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
equals the unsharded module's. Both all-to-alls are differentiable (functional collectives'
`all_to_all_single_autograd`, as torchtitan), so the backward sends each row's gradient back to its
token's rank, and each EP rank's expert gradients sum the contributions of every rank's tokens.

In the trainer (`worker.actor.fsdp.expert_parallel_size` = P > 1; `models.build.shard_model`, for the policy
and the reference alike): the world is viewed as a [world / P, P] mesh ("efsdp", "ep", `expert_mesh`), EP
groups being runs of P consecutive ranks, so no device is added; every MoE layer's experts get
`ExpertParallel` over "ep" and then their own FSDP2 unit over "efsdp" (`shard_experts`), before the decoder
layers and the root are `fully_shard`-ed over all ranks as without EP. Expert weights become 2-D DTensors
(experts by EP rank, then rows by efsdp rank), which is what the checkpoint (DCP stores global shapes and
each rank's chunk, so a checkpoint saved at one EP size and world loads at any other), gradient clipping
(one norm per mesh, `actor.optimizer.clip_grad_norm`) and the weight sync (each rank's experts are one
block of rows, gathered in the bucket of their layer, `rollout.weight_sync`) read. Gradients: the experts'
reduce-scatter divides by the world size, not by its own world / P ranks, so experts are averaged over the
data-parallel ranks exactly as the dense weights are (tests/distributed/test_update_invariance.py:
gradients at EP=2 equal EP=1 on 2 CPU ranks).

Cost: per MoE layer and forward, two all-to-alls of [P, e] counts and two of the routed rows (T x K x H
each way), the same again in the backward, and one host sync for the split sizes (`.tolist()`), which
stops the host from running ahead of the device. The shards per rank are those of plain FSDP (E / world
experts' worth); what EP saves is the gathered layer (each rank gathers its E / P experts over world / P
ranks instead of all E over the world: 1 / P of the experts' all-gather traffic and peak) and the grouped
GEMM runs over the local experts only.

Deviations: torchtitan's current `apply_fsdp_to_decoder` shards a block's experts in the block's own FSDP
unit with a per-parameter mesh (`shard_placement_fn` returning a mesh, private FSDP2 API); here the experts
are their own unit (its earlier form: one more all-gather and reduce-scatter per MoE layer, public API). torchtitan turns
FSDP's gradient division off and scales the loss itself; here FSDP divides and only the experts' divisor
changes. No explicit FSDP prefetch (torchtitan sets it under EP because the host sync delays the implicit
one: a GPU cost, not a correctness one); no `Shard(1)` of the experts when world > E (FSDP pads dim 0
instead); no padding of each expert's rows to an alignment (the grouped GEMM here needs aligned strides
only). verl's FSDP engine has no expert parallelism (it reaches EP through Megatron and other engines).
LoRA adds adapters to linear layers only, so the experts stay frozen base weights and EP applies unchanged.
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
from spmd_grpo.parallel.collectives import World, new_groups


class ExpertParallel(ParallelStyle):
    """Shard an experts module by expert index over a 1-D EP mesh, tokens moved by all-to-all."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_stacked_experts(module):
            raise NotImplementedError(f"{type(module).__name__}: not stacked experts")
        if module.num_experts % device_mesh.size() != 0:
            raise ValueError(f"{module.num_experts} experts do not divide over {device_mesh.size()} EP ranks")
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(module, name)
            # Every rank holds the same weights (or meta tensors): each keeps its own experts, no scatter.
            sharded = distribute_tensor(param.data, device_mesh, [Shard(0)], src_data_rank=None)
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


def expert_mesh(world: World, ep: int) -> DeviceMesh:
    """The [world / ep, ep] mesh ("efsdp", "ep") over every rank: EP groups are runs of consecutive ranks
    (rank r is EP rank r % ep), FSDP of the experts runs across them (torchtitan's `dp_shard_mod_ep` x
    `dp_shard_in_ep`). Its groups are made here rather than by `init_device_mesh`, which gives them torch's
    default timeout for their backend: these take the collective timeout (`World.timeout_s`), as every other
    group. Every rank creates every group, in the same order (rows, then columns)."""
    ranks = torch.arange(world.world_size).reshape(world.world_size // ep, ep)
    ep_group = new_groups(world, ranks.tolist())
    efsdp_group = new_groups(world, ranks.T.tolist())
    return DeviceMesh.from_group(
        [efsdp_group, ep_group], world.device_type, mesh=ranks, mesh_dim_names=("efsdp", "ep")
    )


def shard_experts(blocks: list[nn.Module], mesh: DeviceMesh, world_size: int, **fsdp_kwargs) -> None:
    """Expert-parallel and FSDP-shard the experts of every MoE block in `blocks`, before the decoder layers
    are `fully_shard`-ed (each layer then skips the experts' parameters, which already have their unit).

    Each experts module: `ExpertParallel` over `mesh["ep"]`, then its own FSDP unit over `mesh["efsdp"]`
    (its weights become 2-D DTensors, experts by EP rank, then rows by FSDP rank). Gradients: an EP rank's
    expert gradient already sums the tokens of its whole EP group (the all-to-all's backward), the
    reduce-scatter sums over the efsdp ranks, and dividing by the world size (not the efsdp size, FSDP's
    default) gives every expert the same average over data-parallel ranks as a dense weight. Over several
    efsdp ranks the division is a sum then a post-division (`set_force_sum_reduction_for_comms`; gloo has
    no pre-multiplied sum); over one, FSDP divides without a collective, and forcing the sum there would
    divide twice (torch 2.13). The experts' inputs (routing weights included) stay in their dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mp = fsdp_kwargs.pop("mp_policy")
    mp = MixedPrecisionPolicy(
        param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype, cast_forward_inputs=False
    )
    for block in blocks:
        parallelize_module(block.experts, mesh["ep"], ExpertParallel())
        fully_shard(
            block.experts, mesh=mesh["efsdp"], mp_policy=mp, reshard_after_forward=True, **fsdp_kwargs
        )
        block.experts.set_gradient_divide_factor(float(world_size))
        block.experts.set_force_sum_reduction_for_comms(mesh["efsdp"].size() > 1)
