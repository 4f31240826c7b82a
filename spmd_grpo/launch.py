"""`python -m spmd_grpo.launch [torchrun options] -m spmd_grpo.train CONFIG [...]`: torchrun whose exit code
says why the job ended.

torchrun itself exits 1 however a job fails, including when it is sent SIGTERM (its agent raises a
`SignalException`) while every rank stopped cleanly with 128 + 15. This runs torchrun's own `main` in this
process (same options, same agent, same forwarding of signals to the ranks) and changes only the exit code:

  * the agent was signalled (SIGTERM/SIGINT/...): 128 + that signal, once the ranks are done;
  * every failed rank exited with the same 128 + SIGTERM/SIGINT (the ranks were signalled directly, as Slurm
    does to every process of a job step): that code;
  * anything else as torchrun (0, or 1 with its failure report).
"""

from __future__ import annotations

import signal
import sys

STOP_CODES = (128 + signal.SIGTERM, 128 + signal.SIGINT)


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(sys.argv[1:] if argv is None else argv)
    except SignalException as e:
        print(
            f"spmd_grpo.launch: torchrun got signal {int(e.sigval)}; exit code {128 + e.sigval}",
            file=sys.stderr,
        )
        raise SystemExit(128 + e.sigval) from None
    except ChildFailedError as e:
        codes = {failure.exitcode for failure in e.failures.values()}
        if len(codes) == 1 and codes <= set(STOP_CODES):
            raise SystemExit(codes.pop()) from None
        raise


if __name__ == "__main__":
    main()
