"""When FSDP2 gathers the sharded parameters during a pass of several micro-batches: per micro-batch (FSDP's
default, what accelerators need), or once per pass on the CPU.

FSDP2's defaults suit accelerators, whose memory is what limits: every micro-batch's forward all-gathers
each unit's parameters (cast to `fsdp.param_dtype`) and frees them after, its backward gathers them again,
and each micro-batch's gradient is reduce-scattered (in `fsdp.reduce_dtype`) and added to the sharded one.

On the CPU (`worker.actor.fsdp.gather_once_per_pass: auto`; true or false anywhere) memory is plentiful and
those copies are what costs: a gloo all-gather or reduce-scatter moves
the bytes through host memory on the same cores that compute, and the fp32 -> bf16 cast of the gathered
parameters runs once per gather. On the workload of benchmarks/bare_limit.py at 2 ranks x 1 thread (29M
parameters, 64 samples of ~100 tokens a rank, micro-batches of 4) the update took 10.5 s in bf16 and 22.4 s in
fp32 with FSDP's per-micro-batch gathers, 6.9 s and 17.4 s with the ones below. So on the CPU, at any world
size:

- a forward-only pass (old logprobs, reference) keeps the gathered parameters from its first micro-batch to
  its last and reshards once after it (`gathered_for_pass`);
- the update keeps them through the mini-batch's forwards and backwards and accumulates the unsharded
  gradient in `fsdp.reduce_dtype` (fp32), reduce-scattering it once after the last micro-batch
  (`accumulate_unsharded`): the same sum of the same micro-batch gradients, reduced in one collective
  instead of one per micro-batch (rounding may differ in the last bits: the sum is taken before the
  reduction instead of after).

Cost: each rank holds the whole model gathered (param_dtype) and an unsharded reduce_dtype gradient beside its
shards through the pass: + (2 or 4) + 4 bytes per parameter at the peak (a 3B model in bf16: +18 GB).
Accelerators keep FSDP's per-micro-batch behaviour, where sharding is what makes the model fit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


def gathers_once_per_pass(model: nn.Module) -> bool:
    """Whether `model` (an FSDP2 root) keeps its parameters gathered across a pass's micro-batches: what
    its build resolved from `worker.actor.fsdp.gather_once_per_pass` (auto: on the CPU), the same on every
    rank."""
    return bool(getattr(model, "gather_once_per_pass", False)) and hasattr(model, "set_reshard_after_forward")


def _fsdp_units(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "reshard") and hasattr(m, "set_reshard_after_forward")]


def _trains(unit: nn.Module) -> bool:
    """Whether one of the parameters `unit` shards itself (not those of the units inside it) requires grad."""
    inner = {id(p) for m in _fsdp_units(unit) if m is not unit for p in m.parameters()}
    return any(p.requires_grad and id(p) not in inner for p in unit.parameters())


@contextmanager
def gathered_for_pass(model: nn.Module) -> Iterator[None]:
    """A forward-only pass over several micro-batches: on the CPU, gather each unit once (at its first
    forward) and reshard every unit after the pass; elsewhere FSDP's default, one gather per forward."""
    if not gathers_once_per_pass(model):
        yield
        return
    model.set_reshard_after_forward(False)
    try:
        yield
    finally:
        model.set_reshard_after_forward(True)
        for unit in _fsdp_units(model):
            unit.reshard()


def accumulate_unsharded(model: nn.Module, *, first: bool, last: bool) -> None:
    """Before micro-batch `first`..`last` of a mini-batch's backward passes, on the CPU: keep the gathered
    parameters through the mini-batch (resharded after the last backward) and reduce the accumulated
    unsharded gradient only after the last one. Call `end_accumulation` after the mini-batch."""
    if first:
        model.set_reshard_after_forward(False)
    for unit in _fsdp_units(model):
        # Only units that train hold a gradient back. FSDP2 (torch 2.13) fails a held-back backward
        # ("'FSDPParam' object has no attribute '_unsharded_param'") in every unit that has never been
        # gathered, such as a frozen vision tower whose features are reused on a step without images.
        unit.set_requires_gradient_sync(last or not _trains(unit), recurse=False)
    model.set_reshard_after_backward(last)


def end_accumulation(model: nn.Module) -> None:
    """FSDP's defaults again after `accumulate_unsharded`'s mini-batch (the last backward resharded)."""
    model.set_reshard_after_forward(True)
