"""`python -m spmd_grpo.launch [torchrun options] -m spmd_grpo.train CONFIG [...]`: torchrun whose exit code
says why the job ended.

torchrun itself exits 1 however a job fails, including when it is sent SIGTERM (its agent raises a
`SignalException`) while every rank stopped cleanly with 128 + 15. This runs torchrun's own `main` in this
process (same options, same agent, same forwarding of signals to the ranks) and changes only the exit code:

  * the agent was signalled (SIGTERM/SIGINT/...): 128 + that signal, once the ranks are done;
  * every failed rank exited with the same 128 + SIGTERM/SIGINT (the ranks were signalled directly, as Slurm
    does to every process of a job step): that code;
  * a rank that stopped at a config error (exit code 2, after printing its one line): 2, without torchrun's
    failure report;
  * anything else as torchrun (0, or 1 with its failure report).

Before torchrun starts any rank, a `-m spmd_grpo.train` job's config is checked here, once (the same checks
every rank runs: `spmd_grpo.train.prepare`, without locking the run directory; checkpoints by size, as
there, their checksums being verified by the ranks once the process group exists): a mistake prints its one
line once and exits 2 within seconds, instead of once per rank after every rank has imported torch, with
torchrun's `ChildFailedError` report after it.
The world size is `--nnodes` x `--nproc_per_node`; with an elastic node range (`--nnodes MIN:MAX`) it is not
known yet and the check is left to the ranks. A rank can still stop at a config error the launcher did not
see (a file only that node lacks, a job that took the run directory in between): exit code 2 as well.

torchrun SIGKILLs its ranks `--shutdown_timeout` seconds after it forwards a signal (TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
else 30 s, when the flag is not given). The config checked above knows how long a signalled rank may take
to stop (`trainer.preempt_grace_s`), so without either setting the timeout is that grace plus
`SHUTDOWN_MARGIN_S` (never below torchrun's 30 s): a longer grace is no longer cut short by torchrun. The
value torchrun uses is exported as TORCH_ELASTIC_SHUTDOWN_TIMEOUT, which the ranks compare with the grace at
start-up (`parallel.signals.warn_if_grace_outlasts_shutdown`; a flag alone is invisible to them).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
from collections.abc import MutableMapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

    from spmd_grpo.config.schema import Config

STOP_CODES = (128 + signal.SIGTERM, 128 + signal.SIGINT)
CONFIG_ERROR = 2  # spmd_grpo.train's exit code for a config, version or run-directory error
TRAIN_MODULE = "spmd_grpo.train"
SHUTDOWN_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
TORCHRUN_SHUTDOWN_S = 30  # torchrun's default --shutdown_timeout
SHUTDOWN_MARGIN_S = 5
"""How much longer than `trainer.preempt_grace_s` torchrun waits: a rank still running at the grace's end
exits at once by itself."""


def check_before_start(args: argparse.Namespace) -> Config | None:
    """Check a `-m spmd_grpo.train` job's config (what every rank would check first) before any rank
    exists; a mistake prints its one line and exits 2. `args`: the command line as torchrun's own parser
    reads it. Returns the config (None where it is left unchecked: another entry point, an elastic node
    range, `--dry-run`, which torchrun and the ranks handle)."""
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

    if not (args.module and args.training_script == TRAIN_MODULE):
        return None
    min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    if min_nodes != max_nodes:
        return None
    world_size = max_nodes * determine_local_world_size(args.nproc_per_node)
    from spmd_grpo.config.checks import ConfigError
    from spmd_grpo.train import one_line_error, prepare
    from spmd_grpo.versions import VersionError

    try:
        prepared = prepare(list(args.training_script_args), world_size, rank=None)
    except (ConfigError, ValueError, VersionError) as e:
        print(one_line_error(e), file=sys.stderr)
        raise SystemExit(CONFIG_ERROR) from None
    return None if prepared is None else prepared[0]


def set_shutdown_timeout(
    flag_s: int | None, grace_s: float | None, environ: MutableMapping[str, str]
) -> None:
    """Put the shutdown timeout torchrun will use in `environ` (TORCH_ELASTIC_SHUTDOWN_TIMEOUT): the
    `--shutdown_timeout` flag's value (`flag_s`), else the variable as it is, else, for a checked config,
    its grace period plus `SHUTDOWN_MARGIN_S`, at least torchrun's 30 s (`grace_s` None: left unset)."""
    if flag_s is not None:
        environ[SHUTDOWN_ENV] = str(flag_s)
    elif SHUTDOWN_ENV not in environ and grace_s is not None:
        environ[SHUTDOWN_ENV] = str(max(TORCHRUN_SHUTDOWN_S, math.ceil(grace_s) + SHUTDOWN_MARGIN_S))


class _QuietConfigErrors(logging.Filter):
    """Drops torchrun's lines about a rank that stopped at a config error (exit code 2) and printed the
    reason itself, in one line: its "failed (exitcode: 2)" line, and "Sending process N closing signal
    SIGTERM" for the other ranks it then stops. The latter is known to follow a config error only from the
    failures torchrun has recorded when it logs it (its process context's `_failures`, found on the stack);
    where they cannot be found the line shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith("failed (exitcode: %s)") and record.args:
            return record.args[0] != CONFIG_ERROR
        if message.startswith("Sending process %s closing signal"):
            return not _after_config_error()
        return True


def _after_config_error() -> bool:
    frame = sys._getframe()
    while frame is not None:
        failures = getattr(frame.f_locals.get("self"), "_failures", None)
        if isinstance(failures, dict):
            return any(getattr(f, "exitcode", None) == CONFIG_ERROR for f in failures.values())
        frame = frame.f_back
    return False


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun
    from torch.distributed.run import parse_args

    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)  # torchrun's own parser: a bad torchrun option fails here as it would there
    cfg = check_before_start(args)
    grace_s = None if cfg is None else cfg.trainer.preempt_grace_s
    set_shutdown_timeout(args.shutdown_timeout, grace_s, os.environ)  # before torchrun reads it
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_QuietConfigErrors())
    try:
        torchrun(argv)
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
        if e.get_first_failure()[1].exitcode == CONFIG_ERROR:  # its rank printed the one-line reason
            raise SystemExit(CONFIG_ERROR) from None
        raise


if __name__ == "__main__":
    main()
