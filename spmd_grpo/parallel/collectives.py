"""Device and process-group layer: the only module that knows about cuda / npu / cpu.

Device type: `auto` picks npu when `torch_npu` imports and reports a device, else cuda when available, else
cpu. Backend: `cpu:gloo,cuda:nccl` (cuda), `cpu:gloo,npu:hccl` (npu), gloo (cpu). The default group has a
backend for host tensors too, as verl's has: the small bookkeeping collectives (counts, metric sums, timers,
micro-batch counts, the DAPO group sizes) reduce CPU tensors, which an nccl- or hccl-only group refuses
("No backend type associated with device type cpu"), and they should not pay a host-device copy each. FSDP,
the weight push and everything else on device tensors go over nccl / hccl. Everything else calls the helpers here (memory stats,
cache emptying, seeding, collectives, per-device defaults) and never spells a device name.

Ascend NPUs (`torch_npu` + vllm-ascend; only tested here against a fake `torch_npu`, never on real NPUs):
  * `torch_npu` is imported only when the device is npu (or `auto` looks for one); importing it registers
    `torch.npu` and the "npu" device type, and the hccl backend.
  * The process group is created without `device_id` on npu (no eager communicator init), as verl does;
    on cuda `device_id` binds NCCL eagerly.
  * vLLM sleep level 1 (weights offloaded to host memory) is what verl uses on npu (launch/slurm/train_npu.sbatch
    sets `worker.rollout.sleep_level=1`), 2 on cuda (the config default). verl's reason ("sleep_mode=2 is
    not supported on vllm-ascend") predates vllm-ascend's level-2 support: its NPUWorker now copies the
    model's buffers to host memory at a level-2 sleep and restores them at the next wake, and every weight is
    pushed after a level-2 sleep here anyway, so level 2 is expected to work too (not run on an NPU); level
    1 stays the template's default, as verl's.
  * No NPU kernel patches, unlike verl (models/transformers/npu_patch.py: torch_npu's fused RMSNorm, SwiGLU,
    rotary and grouped-matmul MoE experts): the transformers modules run as written, the same math, slower.
    Attention is transformers' own `flash_attention_2`, which it maps to torch_npu's `npu_fusion_attention`
    (varlen through `cu_seqlens`); MoE experts use `F.grouped_mm` only where a probe finds it runs
    (models/moe/experts.py), otherwise one matmul per expert.
  * vllm-ascend's sleep mode refuses `expandable_segments:True` in PYTORCH_NPU_ALLOC_CONF (checked at
    start-up: `devices.sleep_mode_allocator_error`); on npu the allocator option is never switched at run
    time (`set_expandable_segments` is CUDA only, as verl's).
  * Models that are only ever run forward are built directly in their compute dtype (models/build.py), so no
    sharded DTensor is ever cast for them (torch_npu cannot cast sharded DTensors). The policy keeps fp32
    master weights on every device (the optimizer must not step in bf16) and is cast only inside FSDP2's
    all-gather.

Collectives live here and say what they reduce. Every collective has the process group's timeout
(`trainer.collective_timeout_s`), so a dead peer turns into an error rather than a hang; torchrun then
tears the remaining ranks down. On Ascend, HCCL's own bound on a device operation (HCCL_EXEC_TIMEOUT) is
derived from the same value unless the environment sets it (`devices.hccl_exec_timeout_s`).

Stopping and dying (what torchrun does, measured with torch 2.13):
  * SIGTERM/SIGINT to the torchrun agent: it forwards the signal to every worker, waits
    `--shutdown_timeout` (default 30 s, or TORCH_ELASTIC_SHUTDOWN_TIMEOUT) and then SIGKILLs them; the
    agent itself always exits 1 (its SignalException), whatever the workers returned. Under Slurm
    (proctrack cgroup) the workers also get the signal directly; a second one changes nothing here.
  * A worker that exits non-zero (or is killed): the agent notices within `--monitor_interval` (0.1 s),
    SIGTERMs the others and SIGKILLs them after 30 s (hard-coded for this path). With gloo a survivor's
    next collective fails at once ("Connection closed by peer"), so it does not wait for either.
  `StopOnSignal` turns the signal into a stop at the next step boundary bounded by a grace period (at
  once when a rank on the same node is already gone: that signal is the agent ending a failed job);
  `exit_promptly` makes an exception end the process with exit code 1 at once instead of hanging in
  interpreter shutdown (vLLM's and gloo's threads, `destroy_process_group` with a dead peer).
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from spmd_grpo.parallel.devices import BACKENDS, device_module, hccl_exec_timeout_s, resolve_device_type
from spmd_grpo.parallel.signals import exit_with_launcher

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device_type: str
    backend: str
    timeout_s: int = 1800
    """The default group's collective timeout (`trainer.collective_timeout_s`), which every subgroup is given
    too: torch gives a subgroup created without one its backend's default instead (30 min here, 10 for nccl)."""

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


def init_distributed(device: str = "auto", timeout_s: int = 1800) -> World:
    """Initialise the default process group from torchrun's environment (or a 1-process world without it).
    Under torchrun the rank dies with its launcher from here on (`signals.exit_with_launcher`). On npu,
    HCCL_EXEC_TIMEOUT is set from `timeout_s` first unless the environment has it (`hccl_exec_timeout_s`)."""
    exit_with_launcher()
    device_type = resolve_device_type(device)
    if "RANK" not in os.environ:  # plain `python -m spmd_grpo.train`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    mod = device_module(device_type)
    if mod is not None:
        mod.set_device(local_rank)
    backend = BACKENDS[device_type]
    if device_type == "npu":  # before the process group: torch_npu and HCCL read it when it is created
        os.environ.setdefault("HCCL_EXEC_TIMEOUT", str(hccl_exec_timeout_s(timeout_s)))
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            # Eager NCCL init on cuda; hccl is created lazily, as verl does on NPU.
            device_id=torch.device(device_type, local_rank) if device_type == "cuda" else None,
        )
    return World(rank, world_size, local_rank, device_type, backend, timeout_s)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a local rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    """Every rank's `obj` (picklable), in rank order within `group`.

    A group of one returns `[obj]` without a collective, like the reductions above, and not only because it
    has nothing to exchange: gloo copies the pickled payload into the output on its own worker thread, and a
    payload past torch's parallel grain (32768 bytes; the dataset's shard check at start-up is ~400 kB) makes
    that thread start an OpenMP team of its own, which lives as long as the process group. libgomp then
    manages more threads than the process has cores and stops spinning its idle workers between parallel
    regions, so every parallel op of the main thread waits for a worker's wake-up: at 1 rank x 2 threads
    (bf16) that made the update 1.4x and generation 1.2x slower for the whole run. Ranks of one thread have
    no team to slow; several ranks of several threads each can still meet it through gloo."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if `flag` is True on any rank: lets all ranks take the same branch."""
    return bool(all_reduce_max(torch.tensor([int(flag)], device=device)).item())


def new_groups(world: World, partition: list[list[int]]) -> dist.ProcessGroup:
    """Create a subgroup for each rank list of `partition` (every rank calls this with the same lists, in the
    same order) with the default group's timeout (`World.timeout_s`), and return this rank's one."""
    timeout = datetime.timedelta(seconds=world.timeout_s)
    groups = [dist.new_group(ranks, timeout=timeout) for ranks in partition]
    return next(group for ranks, group in zip(partition, groups, strict=True) if world.rank in ranks)


def new_tp_groups(world: World, tp: int) -> dist.ProcessGroup | None:
    """Every TP subgroup (`new_groups`) and this rank's one; None without tensor parallelism."""
    if tp == 1 or world.world_size == 1:
        return None
    return new_groups(world, world.tp_group_ranks(tp))


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exchange_bytes(send: torch.Tensor, send_sizes: list[int], device: torch.device) -> list[torch.Tensor]:
    """All-to-all of raw bytes: `send` (uint8, 1-D) holds one segment per rank, `send_sizes[r]` bytes for rank r,
    in rank order; returns the segment each rank sent here, in rank order (views into one receive buffer).

    Two collectives: an all_to_all of the sizes, then one `all_to_all_single` of the bytes with per-rank
    split sizes (gloo, nccl and hccl support both). They run on `device`, as nccl/hccl need (gloo: the cpu);
    the segments come back on the cpu.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [send]
    assert len(send_sizes) == dist.get_world_size(), (len(send_sizes), dist.get_world_size())
    sizes = torch.tensor(send_sizes, dtype=torch.long, device=device)
    recv_sizes_t = torch.empty_like(sizes)
    dist.all_to_all_single(recv_sizes_t, sizes)
    recv_sizes = recv_sizes_t.tolist()
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv, send.to(device), recv_sizes, send_sizes)
    return list(recv.cpu().split(recv_sizes))
