"""Data: prompt data sets -> tokenized examples, each rank's prompts per step, and the sample record.

    sources.py    where rows come from: parquet files or directories, the hub, generated builtin tasks
    images.py     decoding and resizing images (and `BadRow`, the reason a row is skipped)
    videos.py     decoding videos (PyAV), sampling and resizing frames by qwen-vl-utils' rules
    prompts.py    the chat template, `<image>`/`<video>` markers, processor sizes and the tokenized prompt
    row_checks.py each row's checks at load (text, answer, images, special tokens)
    dataset.py    `load_dataset`: each rank checks its share of the rows, skipped rows are named
    sampler.py    `PromptSampler`: which data positions each rank rolls out at each step
    samples.py    `Prompt` and `Sample`: what flows from rollout to reward, advantages and the update
    synthetic.py  the generated `builtin:` tasks (colour, video colour, geometry3k diagrams), `write_parquet`

The names below are imported on first use, so importing one module of the package stays light.
"""

from spmd_grpo import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "dataset": (
            "AllGather",
            "Example",
            "load_dataset",
        ),
        "images": (
            "DEFAULT_IMAGE_FACTOR",
            "BadRow",
            "reason_kind",
            "image_list",
            "decode_image",
            "resized_size",
            "resize_image",
        ),
        "prompts": (
            "IMAGE_MARKER",
            "chat_messages",
            "Prompting",
            "check_text",
            "processor_kwargs",
            "processor_kwargs_for",
            "with_video_metadata",
        ),
        "row_checks": (
            "KeptRow",
            "SkippedRow",
            "SkippedFile",
            "check_share",
        ),
        "sampler": ("PromptSampler",),
        "videos": (
            "VIDEO_MARKER",
            "Video",
            "VideoRules",
            "decode_video",
            "encode_video",
            "video_list",
        ),
        "samples": (
            "Prompt",
            "Sample",
        ),
        "sources": (
            "ROW_BATCH",
            "MAX_NAMED_PER_REASON",
            "LARGE_ROW_GROUP_BYTES",
            "Rows",
            "Unreadable",
            "open_sources",
            "warn_large_row_groups",
        ),
        "synthetic": (
            "COLOR_PROBLEM",
            "COLORS",
            "color_task_examples",
            "VIDEO_COLOR_PROBLEM",
            "video_color_task_examples",
            "synthetic_geo3k_rows",
            "ROW_GROUP_SIZE",
            "write_parquet",
        ),
    },
)
