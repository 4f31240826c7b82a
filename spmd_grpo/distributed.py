"""Device and process-group layer: the only module that knows about cuda / npu / cpu.

Device type: `auto` picks npu when `torch_npu` imports and reports a device, else cuda when available, else
cpu. Backend: nccl (cuda), hccl (npu), gloo (cpu). Everything else calls the helpers here (memory stats,
cache emptying, seeding, collectives) and never spells a device name.

Collectives live here and say what they reduce. Every collective has the process group's timeout
(`trainer.collective_timeout_s`), so a dead peer turns into an error rather than a hang; torchrun then
tears the remaining ranks down.
"""

from __future__ import annotations

import datetime
import importlib
import logging
import os
import random
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


def _import_torch_npu() -> ModuleType | None:
    try:
        return importlib.import_module("torch_npu")
    except ImportError:
        return None


def resolve_device_type(requested: str = "auto") -> str:
    """`auto` | `cuda` | `npu` | `cpu` -> a concrete device type, checking that it exists."""
    if requested == "auto":
        if _import_torch_npu() is not None and hasattr(torch, "npu") and torch.npu.is_available():
            return "npu"
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "npu":
        if _import_torch_npu() is None:
            raise RuntimeError(
                "trainer.device=npu but torch_npu cannot be imported (install torch_npu, source CANN)"
            )
        return "npu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but torch.cuda.is_available() is False")
    return requested


def device_module(device_type: str) -> ModuleType | None:
    """torch.cuda / torch.npu, or None for cpu."""
    return {"cuda": torch.cuda, "npu": getattr(torch, "npu", None)}.get(device_type)


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device_type: str
    backend: str

    @property
    def device(self) -> torch.device:
        return (
            torch.device(self.device_type, self.local_rank)
            if self.device_type != "cpu"
            else torch.device("cpu")
        )

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def tp_group_ranks(self, tp: int) -> list[list[int]]:
        """Consecutive ranks form a tensor-parallel group: [[0..tp-1], [tp..2tp-1], ...]."""
        return [list(range(g * tp, (g + 1) * tp)) for g in range(self.world_size // tp)]


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device: str = "auto", timeout_s: int = 1800) -> World:
    """Initialise the default process group from torchrun's environment (or a 1-process world without it)."""
    device_type = resolve_device_type(device)
    if "RANK" not in os.environ:  # plain `python -m spmd_grpo.train`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    mod = device_module(device_type)
    if mod is not None:
        mod.set_device(local_rank)
    backend = BACKENDS[device_type]
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=torch.device(device_type, local_rank) if mod is not None else None,
        )
    return World(rank, world_size, local_rank, device_type, backend)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seed_everything(seed: int) -> None:
    """Same seed on every call site; callers add the rank where streams must differ per rank."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def empty_cache(device_type: str) -> None:
    mod = device_module(device_type)
    if mod is not None:
        mod.empty_cache()


def synchronize(device_type: str) -> None:
    mod = device_module(device_type)
    if mod is not None:
        mod.synchronize()


def max_memory_allocated_gb(device_type: str) -> float:
    mod = device_module(device_type)
    return mod.max_memory_allocated() / 2**30 if mod is not None else 0.0


def cpu_memory_used_gb() -> float:
    """Resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


# ------------------------------------------------------------------------------------------ collectives
def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of `t` over all ranks (returns a new tensor; float64 stays float64 on gloo)."""
    out = t.clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out


def all_reduce_min(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MIN)
    return out


def all_gather_objects(obj: object, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's `obj` (picklable), in rank order within `group`."""
    if not dist.is_initialized():
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: object, src: int = 0) -> object:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if `flag` is True on any rank: lets all ranks take the same branch."""
    return bool(all_reduce_max(torch.tensor([int(flag)], device=device)).item())


def new_tp_groups(world: World, tp: int) -> dist.ProcessGroup | None:
    """Create every TP subgroup (all ranks must call in the same order) and return this rank's one."""
    if tp == 1 or world.world_size == 1:
        return None
    mine = None
    for ranks in world.tp_group_ranks(tp):
        group = dist.new_group(ranks)
        if world.rank in ranks:
            mine = group
    return mine


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
