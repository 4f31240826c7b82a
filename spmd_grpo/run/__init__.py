"""A run's life on disk: checkpoints, what a start does with its run directory, and export.

    checkpoint.py  sharded DCP checkpoints with LR schedule, RNG and trainer state: save and load
    checkpoint_dirs.py  the checkpoint directories: complete, damaged, and the one a resume takes
    start.py       `plan_start`: new run or resume, and which checkpoint
    saved_config.py  the run's `config.yaml`: written, read back, and which changes a resume accepts
    manifest.py    size and CRC-32 of every checkpoint file, written at save and verified before a resume
    verify.py      `verify_start`: the resumed checkpoint's checksums, a share per rank after the group forms
    lineage.py     a resume from an earlier checkpoint sets the later ones (an abandoned branch) aside
    lock.py        one job per run directory: an exclusive lock rank 0 holds for the job's life
    preflight.py   what the config points to exists here (model, reward file, family, LoRA targets)
    preflight_data.py  the same for the data section: sources, parquet columns, sizes, the prompt template
    export.py      `python -m spmd_grpo.export CKPT OUT`: a checkpoint as a Hugging Face model directory
    export_lora.py the same for a LoRA checkpoint: a PEFT adapter directory, optionally the merged model

Import each name from the module that defines it: this package re-exports nothing.
"""
