"""torchrun job: a loop of collectives under the trainer's own signal and exit handling, no model.

    torchrun --nproc_per_node 2 tests/jobs/stop_and_die.py OUT_DIR MODE GRACE_S

Like `trainer.run`, every rank listens for SIGTERM/SIGINT from its first line (`StopOnSignal`, grace
GRACE_S), runs under `exit_promptly`, and agrees on a stop at each iteration boundary (`any_rank`). Each
rank writes `OUT_DIR/rank<r>.pid` and, after a few iterations, `OUT_DIR/rank<r>.ready`. MODE:
  loop    iterate until a signal stops the job (rank r logs "rank r exits with code C")
  busy    like loop, but once ready rank 0 spends 60 s in each iteration without a collective (as a rank
          generating alone), so a dead peer cannot reach it through a collective; and LOCAL_WORLD_SIZE is
          set to 1 after start-up, as vLLM's CPU platform does when it builds the engine
          (`vllm/platforms/cpu.py`: `os.environ["LOCAL_WORLD_SIZE"] = str(tensor_parallel_size)`)
  raise   rank 1 raises after a few iterations, after writing the time to `OUT_DIR/raised_at`
  stuck   with a 3 s collective timeout: rank 1 stops in iteration 10 ("stuck", noted as its phase) for
          10 minutes; rank 0's next collective times out and its error names rank 1's phase
  slow    like loop, but the iteration that sees the signal sleeps 10 x GRACE_S (a step that cannot
          finish within the grace period)
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import torch

from spmd_grpo.parallel.collectives import all_reduce_max, any_rank, destroy, init_distributed
from spmd_grpo.parallel.signals import StopOnSignal, exit_promptly, note_phase

log = logging.getLogger("stop_and_die")


def main(out: Path, mode: str, stop: StopOnSignal) -> None:
    world = init_distributed("cpu", timeout_s=3 if mode == "stuck" else 600)
    (out / f"rank{world.rank}.pid").write_text(str(os.getpid()))
    if mode == "busy":
        os.environ["LOCAL_WORLD_SIZE"] = "1"  # what building a vLLM CPU engine with TP 1 does to it
    for i in range(1_000_000):
        note_phase(f"step {i}: work")
        time.sleep(0.05)  # the step's work
        if mode == "stuck" and world.rank == 1 and i == 10:
            note_phase(f"step {i}: stuck")
            (out / "stuck_at").write_text(repr(time.time()))
            time.sleep(600)
        if mode == "busy" and world.rank == 0 and i > 5:
            time.sleep(60)
        if mode == "slow" and stop.signum is not None:
            time.sleep(10 * stop.grace_s)
        if mode == "raise" and world.rank == 1 and i == 10:
            (out / "raised_at").write_text(repr(time.time()))
            raise RuntimeError("rank 1 fails on purpose")
        if any_rank(stop.signum is not None, world.device):  # the step boundary
            code = 128 + int(all_reduce_max(torch.tensor([stop.signum or 0])).item())
            log.warning("rank %d exits with code %d after iteration %d", world.rank, code, i)
            destroy()
            raise SystemExit(code)
        if i == 5:
            (out / f"rank{world.rank}.ready").write_text("")


if __name__ == "__main__":
    rank = os.environ["RANK"]  # "[rank0] <time.time()> LEVEL name: message": when each rank said its last
    logging.basicConfig(
        level=logging.INFO, format=f"[rank{rank}] %(created).3f %(levelname)s %(name)s: %(message)s"
    )
    out_dir, job_mode, grace = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    listener = StopOnSignal(grace).install()
    exit_promptly(lambda: main(out_dir, job_mode, listener))
