"""`python -m spmd_grpo.export CHECKPOINT_DIR OUT_DIR [...]`: a checkpoint as a Hugging Face model directory.

The work is in `spmd_grpo.run.export`; `--help` lists the options."""

from spmd_grpo.run.export import main

if __name__ == "__main__":
    main()
