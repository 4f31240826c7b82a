"""A run's life on disk: checkpoints, what a start does with its run directory, and export.

    checkpoint.py  sharded DCP checkpoints with LR schedule, RNG and trainer state: save and load
    checkpoint_dirs.py  the checkpoint directories: complete, damaged, and the one a resume takes
    start.py       `plan_start`: new run or resume, and which config changes a resume accepts
    manifest.py    size and CRC-32 of every checkpoint file, written at save and verified before a resume
    lineage.py     a resume from an earlier checkpoint sets the later ones (an abandoned branch) aside
    lock.py        one job per run directory: an exclusive lock rank 0 holds for the job's life
    preflight.py   what the config points to exists here (model, data, reward file, family, LoRA targets)
    export.py      `python -m spmd_grpo.export CKPT OUT`: a checkpoint as a Hugging Face model directory
    export_lora.py the same for a LoRA checkpoint: a PEFT adapter directory, optionally the merged model

The names below are imported on first use, so importing one module of the package stays light.
"""

from spmd_grpo import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "preflight": ("preflight",),
        "checkpoint": (
            "save_checkpoint",
            "load_checkpoint",
            "load_or_fall_back",
            "UnreadableCheckpoint",
            "write_atomic",
        ),
        "checkpoint_dirs": (
            "CHECKPOINTS",
            "TRAINER_STATE",
            "SCHEDULER",
            "CONFIG",
            "LATEST",
            "missing_parts",
            "step_of",
            "complete_checkpoints",
            "damaged_parts",
            "has_manifest",
            "saved_lora_rank",
            "fallback_checkpoint",
            "find_checkpoint",
        ),
        "manifest": (
            "MANIFEST",
            "file_crc32",
            "file_entries",
            "write_manifest",
            "verify_manifest",
        ),
        "lineage": (
            "ABANDONED",
            "later_checkpoints",
            "agree_on_start",
            "abandon_branch",
        ),
        "export": (
            "DTYPES",
            "SIDE_FILE_SUFFIXES",
            "NOT_COPIED",
            "export_hf",
        ),
        "export_lora": (
            "MODEL_PREFIX",
            "adapter_keys",
            "export_adapter",
        ),
        "lock": (
            "LOCK",
            "lock_run_dir",
            "name_holder",
            "check_not_locked",
            "check_writable",
        ),
        "start": (
            "MEANING_CHANGING",
            "DATA_POSITION_KEYS",
            "NOT_COMPARED",
            "RUN_RECORDS",
            "ConfigChange",
            "StartPlan",
            "flatten",
            "plain_config",
            "diff_configs",
            "meaning_changes",
            "run_records",
            "plan_start",
            "write_run_config",
        ),
    },
)
