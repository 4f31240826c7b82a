"""torchrun job: the real entry point, with one rank SIGKILLed in the middle of saving one step.

    torchrun --nproc_per_node 2 tests/jobs/train_killed_in_save.py RANK STEP CONFIG [section.key=value ...]

Rank RANK dies right after its DCP shards of step STEP are on disk, before the checkpoint is complete, as on
a node failure. The kill is injected here, around `torch.distributed.checkpoint.save`, not by a switch in
the trainer.
"""

from __future__ import annotations

import os
import signal
import sys

import torch.distributed.checkpoint as dcp

from spmd_grpo.train import main


def kill_during_save(rank: int, step: int) -> None:
    real_save = dcp.save

    def save(state_dict, *, checkpoint_id, **kwargs):
        result = real_save(state_dict, checkpoint_id=checkpoint_id, **kwargs)
        if int(os.environ["RANK"]) == rank and str(checkpoint_id).endswith(f"global_step_{step}.tmp"):
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    dcp.save = save


if __name__ == "__main__":
    kill_during_save(int(sys.argv[1]), int(sys.argv[2]))
    main(sys.argv[3:])
