"""What a run reports: step metrics reduced over all ranks, the loggers, and the PNG report.

    metrics.py   timers, global reductions, verl-named sample and perf metrics, `metrics.jsonl`
    loggers.py   console, jsonl, tensorboard, wandb, swanlab, mlflow (rank 0 only)
    report.py    `python -m spmd_grpo.report RUN_DIR`: a run's curves as one PNG and a text summary

Import each name from the module that defines it: this package re-exports nothing.
"""
