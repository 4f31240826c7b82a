"""torchrun job: the real entry point for several runs in turn, one process per rank for all of them.

    torchrun --nproc_per_node 2 tests/jobs/train_in_turn.py --train CONFIG [key=value ...] [--train CONFIG ...]

Each `--train` is what `torchrun [...] -m spmd_grpo.train CONFIG [key=value ...]` does (`spmd_grpo.train.main`
with those arguments), without a new start-up of torch, transformers and vLLM per run (the separator is not
`--run`: torchrun would take it for its own `--run-path`). Between runs each rank puts back what a run leaves
in the process, so the next one starts as in a new process: the default process group (the trainer's end,
vLLM's teardown, destroyed it; `new_process_group` makes it again), the logging handlers (the run's console
and rank log; `setup_logging` configures only a process that has none) and the environment variables (the
engine sets vLLM's, e.g. its CPU KV-cache size, only where they are unset). Each rank prints `RUN_MARK i`
on both streams before run i, so a test can read each run's own console.

Before each run the collector's heap is frozen (`gc.freeze`, after a collection that frees the previous
run): vLLM collects it in full three times while it builds an engine (and freezes it itself once the engine
is up, unfreezing it at shutdown), and with torch, transformers and vLLM imported each full pass took about
0.3 s here. Frozen, those passes skip what every run shares (1.4 s less per run). Nothing a run makes is
frozen before it starts, and vLLM's shutdown unfreezes the heap, so the next collection still frees it.
"""

from __future__ import annotations

import gc
import logging
import os
import sys

from spmd_grpo.train import main as train
from tests.jobs.common import new_process_group, split_at

RUN_MARK = "train_in_turn: run"


def runs(argv: list[str]) -> list[list[str]]:
    """The arguments of each `--train`."""
    assert argv and argv[0] == "--train", (
        "usage: train_in_turn.py --train CONFIG [key=value ...] [--train ...]"
    )
    return split_at(argv, "--train")


def main() -> None:
    environ = dict(os.environ)
    for i, argv in enumerate(runs(sys.argv[1:])):
        if i > 0:
            os.environ.clear()
            os.environ.update(environ)
            for handler in logging.root.handlers[:]:
                logging.root.removeHandler(handler)
                handler.close()
            new_process_group(f"train_in_turn_run{i}")
        gc.collect()  # the previous run's policy, reference and engine
        gc.freeze()
        for stream in (sys.stdout, sys.stderr):  # a test reads each run's own console
            print(f"{RUN_MARK} {i}", file=stream, flush=True)
        train(argv)


if __name__ == "__main__":
    main()  # as `python -m spmd_grpo.train` ends: the trainer has torn its process group down
