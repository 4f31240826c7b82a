"""The sharded weight stream from the FSDP2 policy into vLLM.

Parameters are grouped in buckets of about `worker.rollout.weight_sync_bucket_mb` (a decoder layer or
vision block is never split), each bucket all-gathered once in the rollout dtype (the local shard is cast first, so fp32 masters
never travel) and handed to vLLM's `reload_weights` as `(hf_name, full_tensor)` pairs, in the same order on
every rank. With tied embeddings `lm_head.weight` is sent too (vLLM keeps the old head otherwise).
Each tensor goes out as vLLM's loader reads it (`layout`: the family's `hub_tensors`, which transposes
Qwen3-VL-MoE's fused experts and splits Qwen3.5-MoE's into one tensor per expert; the identity elsewhere).
Expert-parallel experts (`worker.actor.fsdp.expert_parallel_size` > 1: 2-D DTensors, experts by EP rank,
then rows by FSDP rank) are one block of rows per rank too, gathered in their layer's bucket like any shard.
Shards offloaded to host memory (`worker.actor.fsdp.offload_params`) are gathered on the accelerator.

LoRA, merged mode: the adapters never travel on their own; each adapted base weight is sent under its HF
name as `W + alpha / r * B @ A` (computed in fp32 after gathering the base in the rollout dtype and the
adapters whole in fp32), so vLLM needs no LoRA support and any model it serves works.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import cache

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from spmd_grpo.models.lora import is_adapter_name, merge_sources, merged_weight
from spmd_grpo.models.weights import hf_name


class CountingIterator:
    def __init__(self, it: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.it, self.num_bytes = it, 0

    def __iter__(self):
        for name, t in self.it:
            self.num_bytes += t.numel() * t.element_size()
            yield name, t


def _layer_key(name: str) -> str:
    """Parameters of one decoder layer / vision block share a key, so buckets never split a layer."""
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return name


def _buckets(params: list[tuple[str, torch.Tensor]], itemsize: int, bucket_bytes: int) -> list[list]:
    """Group parameters by layer, then pack consecutive layers into buckets of at most `bucket_bytes`."""
    layers: list[list[tuple[str, torch.Tensor]]] = []
    for name, p in params:
        if layers and _layer_key(layers[-1][0][0]) == _layer_key(name):
            layers[-1].append((name, p))
        else:
            layers.append([(name, p)])
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for layer in layers:
        layer_bytes = sum(p.numel() * itemsize for _, p in layer)
        if buckets and size + layer_bytes <= bucket_bytes:
            buckets[-1].extend(layer)
            size += layer_bytes
        else:
            buckets.append(list(layer))
            size = layer_bytes
    return buckets


def iter_weight_buckets(
    model: nn.Module,
    dtype: torch.dtype,
    bucket_bytes: int,
    *,
    tie_word_embeddings: bool,
    skip: Callable[[str], bool] = lambda name: False,
    merge: bool = True,
    layout: Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]] = lambda name, t: [(name, t)],
) -> Iterator[tuple[int, Iterator[tuple[str, torch.Tensor]]]]:
    """Yield `(gathered_bytes, tensors)` per bucket; `tensors` yields `(hf_name, full tensor in dtype)`.

    The bucket is all-gathered when it is yielded; consume `tensors` before asking for the next bucket.
    Every rank must call this with the same model and arguments (the all-gathers are collective). Buckets
    are whole layers, filled up to `bucket_bytes` of the gathered (rollout-dtype) size; a layer bigger than
    a bucket forms its own bucket. `skip(name)` drops parameters (e.g. a frozen vision tower after the first
    push); it must give the same answer on every rank. `layout(name, tensor)` gives the `(name, tensor)` pairs sent for it.
    Live memory: one gathered bucket (`_GatheredBucket`, no send buffer or backend temporary) plus the
    tensors the consumer still holds; a replicated parameter is materialised alone, outside the bucket.
    """
    merges = merge_sources(model) if merge else {}  # LoRA: base weight -> its adapters (none without LoRA)
    params = [
        (hf_name(n), p)
        for n, p in model.named_parameters()
        if not is_adapter_name(n) and not skip(hf_name(n))
    ]
    embed_name = next((n for n, _ in params if n.endswith("embed_tokens.weight")), None)
    itemsize = torch.empty((), dtype=dtype).element_size()
    for bucket in _buckets(params, itemsize, bucket_bytes):
        sharded = [(n, p) for n, p in bucket if is_row_sharded(p)]
        gathered = _GatheredBucket(sharded, dtype) if sharded else None
        lm_head_from = embed_name if tie_word_embeddings else None
        tensors = _bucket_tensors(bucket, gathered, dtype, lm_head_from, merges, layout)
        yield (gathered.num_bytes if gathered else 0), tensors
        del gathered


def _bucket_tensors(bucket, gathered, dtype: torch.dtype, lm_head_from: str | None, merges: dict, layout):
    for n, p in bucket:
        if gathered is not None and n in gathered.layout:
            t = gathered.take(n)
        else:  # replicated, or a plain tensor in an unsharded model
            t = (p.full_tensor() if isinstance(p, DTensor) else p).detach().to(dtype)
        if n in merges:
            t = merged_weight(t, merges[n])
        yield from layout(n, t)
        if n == lm_head_from:
            yield "lm_head.weight", t
        del t


def iter_sharded_weights(
    model: nn.Module,
    dtype: torch.dtype,
    bucket_bytes: int,
    *,
    tie_word_embeddings: bool,
    skip: Callable[[str], bool] = lambda name: False,
    merge: bool = True,
    layout: Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]] = lambda name, t: [(name, t)],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, full tensor in dtype)` for every parameter, gathering one bucket at a time
    (`iter_weight_buckets` flattened; `merge=False`: LoRA base weights without their adapters)."""
    buckets = iter_weight_buckets(
        model,
        dtype,
        bucket_bytes,
        tie_word_embeddings=tie_word_embeddings,
        skip=skip,
        merge=merge,
        layout=layout,
    )
    for _, tensors in buckets:
        yield from tensors


def fused_partners(frozen: set[str], sent: Iterable[str], packed: Mapping[str, list[str]]) -> set[str]:
    """The names in `frozen` that vLLM loads into one fused layer with a name in `sent`.

    `packed` is the vLLM model's `packed_modules_mapping` ({fused module: the HF modules it stacks}, e.g.
    `qkv_proj: [q_proj, k_proj, v_proj]`); names are HF parameter names (`<parent>.<module>.<param>`). vLLM's
    in-place reload rebuilds a fused layer from empty memory and loads what arrives: a push that sends
    `q_proj` and `v_proj` but leaves out a frozen `k_proj` (LoRA adapting a subset of a fused group) would
    leave k's rows uninitialised in the engine. Such partners must travel with the rest of their group."""
    group_of = {m: fused for fused, members in packed.items() if len(members) > 1 for m in members}

    def key(name: str) -> tuple[str, str] | None:
        parent, module, _ = ([""] * 2 + name.rsplit(".", 2))[-3:]
        return (parent, group_of[module]) if module in group_of else None

    live = {key(n) for n in sent} - {None}
    return {n for n in frozen if key(n) in live}


def is_row_sharded(p: torch.Tensor) -> bool:
    """A DTensor whose every mesh dimension splits dim 0 (FSDP's `Shard(0)`; with expert parallelism the
    experts' `_StridedShard(0)` x `Shard(0)`): each rank holds one contiguous block of rows."""
    return isinstance(p, DTensor) and all(
        isinstance(pl, Shard | _StridedShard) and pl.dim == 0 for pl in p.placements
    )


@cache
def _row_blocks(shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple) -> list[tuple[int, int]]:
    """(first row, number of rows) of a DTensor's block on each rank of its mesh, in the order of the
    mesh's flattened ranks (FSDP2 splits like torch.chunk: the last ranks may hold fewer rows, or none).
    Cached: a model has few distinct (shape, mesh, placements)."""
    blocks = []
    for rank in mesh.mesh.flatten().tolist():
        coordinate = [int(c) for c in (mesh.mesh == rank).nonzero()[0]]
        local, offset = _compute_local_shape_and_global_offset(shape, mesh.shape, coordinate, placements)
        blocks.append((offset[0], local[0]))
    return blocks


class _GatheredBucket:
    """The full tensors of a bucket of dim-0 shards, gathered in the rollout dtype into ONE buffer.

    Each rank holds a contiguous block of each tensor's rows: FSDP2 splits dim 0 like torch.chunk (rank r
    holds rows [r*c, min(N, (r+1)*c)) with c = ceil(N / world)); expert-parallel experts are split by EP
    rank, then by FSDP rank inside it, so their blocks come in another rank order (`_row_blocks`). Each
    rank pads its block to the largest block so every rank contributes the same flat size. The receive
    buffer `recv` is [world, per_rank_numel], rank-major. There is no send buffer: each rank casts its
    shards straight into its own row `recv[rank]` (`copy_` casts, no fp32->dtype temporary), then the other
    rows are filled in place:
      - nccl / hccl: `all_gather_into_tensor(recv, recv[rank])`, the in-place form (input = this rank's
        slice of the output), which PyTorch documents for NCCL;
      - otherwise (gloo): one `broadcast(recv[r], src=r)` per rank. Gloo has no in-place all-gather and its
        `all_gather_into_tensor` allocates a second receive-sized temporary (measured with 2 ranks: send +
        receive + temporary = 2.5 x the bucket live); a broadcast writes into `recv[r]` directly.
    So the gather holds one receive buffer (`num_bytes`) and nothing else. A parameter's rows are strided
    in it: `take` copies one parameter out at a time, its blocks in row order (peak = this bucket + the
    parameters the consumer still holds, never two buckets). Every tensor's mesh spans the whole world
    (the default group), in the default group's rank order.
    """

    def __init__(self, sharded: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        self.layout: dict[str, tuple[tuple[int, ...], list[tuple[int, int]], int, int]] = {}
        offset = 0  # name -> (shape, row blocks per rank, offset in a rank's row of recv, numel per rank)
        for name, p in sharded:
            assert p.device_mesh.mesh.flatten().tolist() == list(range(world)), name
            blocks = _row_blocks(tuple(p.shape), p.device_mesh, tuple(p.placements))
            numel = max(rows for _, rows in blocks) * math.prod(p.shape[1:])
            self.layout[name] = (tuple(p.shape), blocks, offset, numel)
            offset += numel
        first = sharded[0][1]
        device = first.to_local().device
        if device.type == "cpu":
            # FSDP2 offload (`fsdp.offload_params`) keeps the shards in host memory: gather them on the mesh's
            # accelerator over nccl/hccl, as verl moves offloaded shards to the device before gathering, not
            # over gloo in host memory (a cpu mesh, the CPU build, stays on the cpu).
            device = torch.device(first.device_mesh.device_type)
        self.recv = torch.empty(world, offset, dtype=dtype, device=device)
        own = self.recv[rank]
        for name, p in sharded:
            shape, blocks, off, numel = self.layout[name]
            local = p.to_local().detach()
            assert local.shape[0] == blocks[rank][1], (name, tuple(local.shape), blocks[rank])
            n = local.numel()
            own[off : off + n].view(local.shape).copy_(local)  # cast into place
            own[off + n : off + numel].zero_()  # padding rows (dropped by `take`)
        group = dist.group.WORLD
        if _inplace_all_gather(group, device):
            dist.all_gather_into_tensor(self.recv.view(-1), own, group=group)
        else:
            for r in range(world):
                dist.broadcast(self.recv[r], src=r, group=group)
        self.num_bytes = self.recv.numel() * self.recv.element_size()

    def take(self, name: str) -> torch.Tensor:
        shape, blocks, offset, _ = self.layout[name]
        row = math.prod(shape[1:])
        pieces = [
            self.recv[r, offset : offset + rows * row].view(rows, *shape[1:])
            for r, (_, rows) in sorted(enumerate(blocks), key=lambda item: item[1][0])
        ]
        return torch.cat(pieces)


def _inplace_all_gather(group, device: torch.device) -> bool:
    """Whether `group`'s backend for `device` gathers in place into the output (nccl, hccl), unlike gloo."""
    backend = str(dist.get_backend(group)).lower()
    if ":" in backend:  # a multi-device group, e.g. "cpu:gloo,cuda:nccl": the backend used for `device`
        backend = dict(kv.split(":", 1) for kv in backend.split(",")).get(device.type, "")
    return backend in ("nccl", "hccl")
