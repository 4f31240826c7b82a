"""`python -m spmd_grpo.report RUN_DIR [--out PNG]`: a run's curves as one PNG, and a short text summary.

The work is in `spmd_grpo.telemetry.report`."""

import sys

from spmd_grpo.telemetry.report import main

if __name__ == "__main__":
    sys.exit(main())
