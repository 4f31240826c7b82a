"""torchrun job: the real entry point, with every rank sent SIGTERM in the middle of saving one step, and that
save then taking far longer than the grace period.

    torchrun --nproc_per_node 2 tests/jobs/train_signalled_in_save.py STEP STAMP CONFIG [section.key=value ...]

Right after its DCP shards of step STEP are on disk, before the checkpoint is complete, each rank signals
itself (as Slurm signals every process of a preempted job), writes the time to STAMP.rank<r>, and then
blocks: only `trainer.preempt_grace_s` can end it. The signal and the stall are injected here, around
`torch.distributed.checkpoint.save`, not by a switch in the trainer. The collector's heap is frozen before
the run, as tests/jobs/train_in_turn.py does (vLLM's full collections while it builds its engine then skip
the imports): start-up time, not what the run does.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time

import torch.distributed.checkpoint as dcp

from spmd_grpo.train import main


def signal_during_save(step: int, stamp: str) -> None:
    real_save = dcp.save

    def save(state_dict, *, checkpoint_id, **kwargs):
        result = real_save(state_dict, checkpoint_id=checkpoint_id, **kwargs)
        if str(checkpoint_id).endswith(f"global_step_{step}.tmp"):
            with open(f"{stamp}.rank{os.environ['RANK']}", "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(3600)  # a save that cannot finish in the grace period
        return result

    dcp.save = save


if __name__ == "__main__":
    signal_during_save(int(sys.argv[1]), sys.argv[2])
    gc.collect()
    gc.freeze()
    main(sys.argv[3:])
