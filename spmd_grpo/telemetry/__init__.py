"""What a run reports: step metrics reduced over all ranks, the loggers, and the PNG report.

    metrics.py   timers, global reductions, verl-named sample and perf metrics, `metrics.jsonl`
    loggers.py   console, jsonl, tensorboard, wandb, swanlab, mlflow (rank 0 only)
    report.py    `python -m spmd_grpo.report RUN_DIR`: a run's curves as one PNG and a text summary

The names below are imported on first use, so importing one module of the package stays light.
"""

from spmd_grpo import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "loggers": (
            "Logger",
            "Loggers",
            "build_loggers",
            "ConsoleLogger",
            "first_logged_step",
            "roll_back_jsonl",
            "JsonlLogger",
            "markdown_table",
            "TensorboardLogger",
            "WandbLogger",
            "SwanlabLogger",
            "mlflow_name",
            "flat_params",
            "MlflowLogger",
            "setup_logging",
        ),
        "metrics": (
            "Timer",
            "global_stats",
            "global_means",
            "MetricsWriter",
            "console_line",
            "sample_metrics",
            "length_quantiles",
            "perf_metrics",
        ),
        "report": (
            "PANELS",
            "read_metrics",
            "series",
            "plot",
            "summary",
            "write_report",
        ),
    },
)
