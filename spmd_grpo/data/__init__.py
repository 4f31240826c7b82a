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

Import each name from the module that defines it: this package re-exports nothing.
"""
