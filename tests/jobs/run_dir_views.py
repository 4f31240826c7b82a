"""torchrun job: `run.lineage.agree_on_start` when rank 1 sees rank 0's lock file late, then not at all.

    torchrun --nproc_per_node 2 tests/jobs/run_dir_views.py OUT_DIR

Rank 0's run directory holds the lock file it wrote. Rank 1's is another directory where the same file
appears 2 s after the ranks compare their views: what a node whose NFS client still caches the directory's
lookups sees. The ranks agree after rank 1 read it again (each writes OUT_DIR/rank<r>.agreed). Then rank 1's
directory never gets the file (a node-local path), their World saying a 4 s collective timeout (2 s of
reading again): the job ends with exit code 2 and one line naming rank 1's host.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

from spmd_grpo.parallel.collectives import barrier, init_distributed
from spmd_grpo.run.lineage import agree_on_start
from spmd_grpo.run.lock import LOCK


def main(out: Path) -> None:
    world = init_distributed("cpu", timeout_s=60)
    shared, late, never = out / "shared", out / "late", out / "never"
    if world.rank == 0:
        shared.mkdir()
        (shared / LOCK).write_text("host node0, pid 1, started 2026-11-27 00:00:00 UTC\n")
    barrier()
    text = (shared / LOCK).read_text()
    mine = shared
    if world.rank == 1:
        mine = late
        late.mkdir()
        threading.Timer(2.0, lambda: (late / LOCK).write_text(text)).start()
    agree_on_start(SimpleNamespace(run_dir=mine, checkpoint=None, abandoned=()), world)
    (out / f"rank{world.rank}.agreed").write_text("")
    if world.rank == 1:
        mine = never
        never.mkdir()
    short = dataclasses.replace(world, timeout_s=4)  # 2 s of reading again, not 30
    agree_on_start(SimpleNamespace(run_dir=mine, checkpoint=None, abandoned=()), short)
    raise SystemExit("agree_on_start accepted a run directory rank 1 never saw the lock file of")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
