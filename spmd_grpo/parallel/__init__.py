"""The device and process-group layer: the only package that knows about cuda / npu / cpu.

    devices.py      device type (cuda / npu / cpu), its backend, memory statistics, cache emptying, seeding
    collectives.py  `World`, `init_distributed`, and every collective the trainer uses, each saying what it reduces
    signals.py      stop on SIGTERM/SIGINT at a step boundary, and exit promptly when the launcher or a rank dies

The names below are imported on first use, so importing one module of the package stays light.
"""

from spmd_grpo import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "collectives": (
            "World",
            "init_distributed",
            "all_reduce_sum",
            "all_reduce_max",
            "all_reduce_min",
            "all_gather_objects",
            "barrier",
            "any_rank",
            "new_tp_groups",
            "destroy",
            "exchange_bytes",
        ),
        "devices": (
            "BACKENDS",
            "resolve_device_type",
            "device_module",
            "seed_everything",
            "empty_cache",
            "set_expandable_segments",
            "memory_line",
            "synchronize",
            "max_memory_allocated_gb",
            "cpu_memory_used_gb",
        ),
        "signals": (
            "STOP_SIGNALS",
            "StopOnSignal",
            "exit_promptly",
            "warn_if_grace_outlasts_shutdown",
            "PR_SET_PDEATHSIG",
            "exit_with_launcher",
            "note_phase",
            "last_phases",
        ),
    },
)
