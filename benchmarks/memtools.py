"""Memory-measurement tools for the CPU benchmarks (Linux, glibc >= 2.33): what a phase of a process adds.

Three views of the same phase, from coarse to fine:
  * OS level: `release_free_memory()` (gc + `malloc_trim`), read `proc_mem()["VmRSS"]`, `reset_peak_rss()`;
    after the phase, `VmHWM` minus that `VmRSS` is the peak extra resident memory.
  * live heap: `heap_in_use()` (glibc `mallinfo2()`: heap chunks plus mmapped chunks); `HeapSampler` samples
    it from a thread every ~1 ms (and wherever `sample()` is called) and keeps the peak and where it was hit.
    Freed pages that glibc keeps resident do not count here.
  * tensors: `LiveTensors` counts the bytes of tracked tensors (once per storage) that something still
    references, through weak references, so tracking keeps nothing alive.

Used by `sync_memory.py` and `load_memory.py`; a benchmark run by path imports it as `memtools` (this
folder on `sys.path`). `ensure_model` builds the generated model a benchmark measures, once, on rank 0.
"""

from __future__ import annotations

import ctypes
import gc
import os
import shutil
import sys
import threading
import time

MiB = 1 << 20

_LIBC = ctypes.CDLL("libc.so.6")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (f, ctypes.c_size_t)
        for f in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_LIBC.mallinfo2.restype = _Mallinfo2  # glibc >= 2.33


def heap_in_use() -> int:
    """Bytes glibc has handed out and not yet freed: heap chunks (uordblks) + mmapped chunks (hblkhd)."""
    mi = _LIBC.mallinfo2()
    return mi.uordblks + mi.hblkhd


def proc_mem() -> dict[str, int]:
    """VmRSS / VmHWM of this process in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(line.split()[1]) * 1024
    return out


def reset_peak_rss() -> None:
    """Reset VmHWM to the current VmRSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def release_free_memory() -> None:
    """Drop garbage and give free heap pages back to the OS, so VmRSS is the live memory."""
    gc.collect()
    _LIBC.malloc_trim(0)


class HeapSampler:
    """Peak of `heap_in_use()` over a window: a daemon thread samples every `interval_s`, `sample()` adds
    points. Set `where` to what runs now; `peak_at` is its value when the peak was sampled.
    """

    def __init__(self, interval_s: float = 1e-3, *, where: str = "") -> None:
        self.interval_s = interval_s
        self.base = self.peak = heap_in_use()
        self.num_samples = 0
        self.where = where
        self.peak_at = self.where
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        v = heap_in_use()
        self.num_samples += 1
        if v > self.peak:
            self.peak, self.peak_at = v, self.where

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.interval_s)

    def __enter__(self) -> HeapSampler:
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(self.interval_s)  # let the sampler in while the main thread holds the GIL
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._switch)
        self.sample()

    @property
    def peak_extra(self) -> int:
        return self.peak - self.base


class LiveTensors:
    """Bytes of tracked tensors (by storage) that are still referenced somewhere, and their peak."""

    def __init__(self) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref = StorageWeakRef
        self.alive: dict[int, tuple[object, int]] = {}  # storage ptr -> (weak ref, bytes)
        self.peak = 0
        self.peak_at = ""  # name of the tensor whose tracking hit the peak

    def track(self, name: str, t) -> int:
        """Start tracking `t` (a torch.Tensor); returns the bytes of tracked storages alive now."""
        self.alive = {k: v for k, v in self.alive.items() if not v[0].expired()}
        storage = t.untyped_storage()
        self.alive.setdefault(storage.data_ptr(), (self._ref(storage), storage.nbytes()))
        del storage
        live = sum(b for _, b in self.alive.values())
        if live > self.peak:
            self.peak, self.peak_at = live, name
        return live


def ensure_model(model_dir, spec: dict, rank: int) -> None:
    """Rank 0 builds the random model `TinyModelSpec(**spec)` into `model_dir` once (atomic rename); every
    rank waits for it (collective)."""
    import torch.distributed as dist

    if rank == 0 and not (model_dir / "model.safetensors").exists():
        from spmd_grpo.tools.make_tiny_model import TinyModelSpec, make_tiny_model

        tmp = model_dir.with_name(model_dir.name + f".tmp{os.getpid()}")
        t0 = time.perf_counter()
        make_tiny_model(tmp, TinyModelSpec(**spec))
        if model_dir.exists():
            shutil.rmtree(model_dir)
        tmp.replace(model_dir)
        print(f"[benchmark] built {model_dir} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    dist.barrier()
