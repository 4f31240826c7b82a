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
    sets `worker.rollout.sleep_level=1`), 2 on cuda (the config default).
  * Models that are only ever run forward are built directly in their compute dtype (model.py), so no
    sharded DTensor is ever cast for them (torch_npu cannot cast sharded DTensors). The policy keeps fp32
    master weights on every device (the optimizer must not step in bf16) and is cast only inside FSDP2's
    all-gather.

Collectives live here and say what they reduce. Every collective has the process group's timeout
(`trainer.collective_timeout_s`), so a dead peer turns into an error rather than a hang; torchrun then
tears the remaining ranks down.

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
import importlib
import importlib.util
import logging
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

BACKENDS = {"cuda": "cpu:gloo,cuda:nccl", "npu": "cpu:gloo,npu:hccl", "cpu": "gloo"}


def _import_torch_npu() -> ModuleType | None:
    try:
        return importlib.import_module("torch_npu")
    except ImportError:
        return None


def _npu_available() -> bool:
    """True when torch_npu imports (which registers `torch.npu`) and sees at least one NPU."""
    return _import_torch_npu() is not None and hasattr(torch, "npu") and torch.npu.is_available()


def resolve_device_type(requested: str = "auto") -> str:
    """`auto` | `cuda` | `npu` | `cpu` -> a concrete device type, checking that it exists."""
    if requested == "auto":
        if _npu_available():
            return "npu"
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "npu":
        if _import_torch_npu() is None:
            raise RuntimeError(
                "trainer.device=npu but torch_npu cannot be imported (install torch_npu for your CANN "
                "release and source CANN's set_env.sh)"
            )
        if not _npu_available():
            raise RuntimeError("trainer.device=npu but torch.npu.is_available() is False (no NPU visible)")
        return "npu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but torch.cuda.is_available() is False")
    if requested not in BACKENDS:
        raise RuntimeError(f"unknown device {requested!r}; expected auto, cuda, npu or cpu")
    return requested


def device_module(device_type: str) -> ModuleType | None:
    """torch.cuda / torch.npu (registered by torch_npu), or None for cpu."""
    if device_type == "npu":
        if not hasattr(torch, "npu"):
            raise RuntimeError("device npu but torch.npu does not exist: import torch_npu first")
        return torch.npu
    return {"cuda": torch.cuda}.get(device_type)


def varlen_attention(device_type: str) -> str | None:
    """The transformers `attn_implementation` with a variable-length kernel for packed sequences, or None.

    npu: `flash_attention_2`, which transformers maps to torch_npu's `npu_fusion_attention` (varlen through
    `cu_seqlens`); cuda: `flash_attention_2` when the `flash_attn` package imports (else None: sdpa would
    build a dense block-diagonal mask); cpu: `attention.VARLEN_SDPA`, causal sdpa per packed-sequence length.
    Verified here only on CPU (packed vs padded); neither GPU kernel has run in this project.
    """
    if device_type == "npu":
        return "flash_attention_2"
    if device_type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    if device_type == "cpu":
        from .attention import VARLEN_SDPA  # registers it with transformers

        return VARLEN_SDPA
    return None


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
            # Eager NCCL init on cuda; hccl is created lazily, as verl does on NPU.
            device_id=torch.device(device_type, local_rank) if device_type == "cuda" else None,
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


def set_expandable_segments(device_type: str, enabled: bool) -> None:
    """CUDA allocator: expandable segments help training (less fragmentation) but must be off while vLLM's
    sleep-mode allocator owns memory (older vLLM asserted on it). No-op elsewhere."""
    if device_type == "cuda":
        torch.cuda.memory._set_allocator_settings(f"expandable_segments:{enabled}")


def memory_line(device_type: str, phase: str) -> str:
    """One log line of memory at a phase boundary: device allocated/reserved (accelerators) and process RSS."""
    mod = device_module(device_type)
    device = ""
    if mod is not None:
        device = f"device allocated {mod.memory_allocated() / 2**30:.2f} GiB reserved {mod.memory_reserved() / 2**30:.2f} GiB, "
    return f"memory after {phase}: {device}process RSS {cpu_memory_used_gb():.2f} GiB"


def synchronize(device_type: str) -> None:
    mod = device_module(device_type)
    if mod is not None:
        mod.synchronize()


def max_memory_allocated_gb(device_type: str) -> float:
    """Peak memory of the compute device. On CPU the device memory IS the process memory: its peak
    resident set (VmHWM), which also counts vLLM's CPU KV cache and the Python heap."""
    mod = device_module(device_type)
    if mod is not None:
        return mod.max_memory_allocated() / 2**30
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return 0.0


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


# ------------------------------------------------------------------------------------- stop and exit
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopOnSignal:
    """SIGTERM / SIGINT (Slurm preemption or `scancel`, Ctrl-C, torchrun forwarding either) ask the run to
    stop; the loop reads `signum` at each step boundary and the ranks agree with `any_rank`, so they save
    the last finished step together and exit with `exit_code` (128 + signal, as a shell reports a process
    killed by that signal).

    The signal is seen by a watcher thread through `signal.set_wakeup_fd`, not by the main thread: Python
    runs handlers only between bytecodes, and a main thread stuck in a C call (a collective with a dead
    peer) would never start the grace period. `grace_s` seconds after the first signal, if the process is
    still alive (the step, the save or the teardown took too long), the watcher ends it at once with the
    same exit code: the previous checkpoint stays the newest complete one, and a save cut short leaves only
    a `global_step_N.tmp` directory that resume ignores. Further signals change nothing.
    """

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.signum: int | None = None
        self.received_at: float | None = None
        self._write_fd: int | None = None

    def install(self) -> StopOnSignal:
        """Listen from now on (main thread only). Call it before anything slow, so no signal is missed, and
        again after building libraries that may set their own handlers (it re-arms the same watcher)."""
        if self._write_fd is None:
            read_fd, self._write_fd = os.pipe()
            os.set_blocking(self._write_fd, False)  # the C-level handler must never block
            threading.Thread(target=self._watch, args=(read_fd,), name="stop-on-signal", daemon=True).start()
        for sig in STOP_SIGNALS:
            signal.signal(sig, _ignore_in_main_thread)  # the byte on the pipe does the work
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        return self

    @property
    def exit_code(self) -> int:
        assert self.signum is not None
        return 128 + self.signum

    def _watch(self, read_fd: int) -> None:
        while self.signum is None:
            for signum in os.read(read_fd, 16):
                if signum in STOP_SIGNALS and self.signum is None:
                    self.received_at, self.signum = time.monotonic(), signum
        if _local_rank_gone():
            log.error(
                "signal %d after a rank on this node exited: exiting %d now", self.signum, self.exit_code
            )
            _hard_exit(self.exit_code)
        log.warning(
            "signal %d received: stopping at the next step boundary (grace %.0f s)", self.signum, self.grace_s
        )
        time.sleep(self.grace_s)
        log.error(
            "signal %d: not done %.0f s later (trainer.preempt_grace_s); exiting %d now, without a new "
            "checkpoint",
            self.signum,
            self.grace_s,
            self.exit_code,
        )
        _hard_exit(self.exit_code)


def _local_rank_gone() -> bool:
    """Under torchrun: fewer live workers under this rank's agent than LOCAL_WORLD_SIZE. The agent reaps a
    worker that died before it signals the others, so a signal with a sibling missing is the agent taking
    the job down, not a preemption: waiting for a step boundary (a rank busy generating may not reach one
    for minutes, a rank in an NCCL collective never) would only delay the end. Linux `/proc`."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    agent, alive = os.getppid(), 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, IndexError, ValueError):
            continue  # a process that ended while we looked
        alive += int(ppid) == agent and state != "Z"
    return alive < int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _ignore_in_main_thread(signum: int, frame: object) -> None:
    """A Python-level handler must exist for the wakeup fd to be written; the watcher thread acts."""


def exit_promptly(main: Callable[[], None]) -> None:
    """Run `main`; if it raises, log the traceback and end the process with exit code 1 at once.

    A plain exception would go through interpreter shutdown, which can hang on non-daemon threads (vLLM's)
    or block in a collective with a peer that is gone; torchrun would then wait 30 s before SIGKILLing this
    rank. `SystemExit` (an intended exit code) passes through unchanged.
    """
    try:
        main()
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 (also KeyboardInterrupt and DCP's CheckpointException)
        log.error("rank %s failed:\n%s", os.environ.get("RANK", "0"), traceback.format_exc())
        _hard_exit(1)


def _hard_exit(code: int) -> None:
    """`os._exit` after flushing what was logged and printed (it skips every other shutdown step)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
