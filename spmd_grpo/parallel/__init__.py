"""The device and process-group layer: the only package that knows about cuda / npu / cpu.

    devices.py      device type (cuda / npu / cpu), its backend, memory statistics, cache emptying, seeding
    collectives.py  `World`, `init_distributed`, and every collective the trainer uses, each saying what it reduces
    signals.py      stop on SIGTERM/SIGINT at a step boundary, and exit promptly when the launcher or a rank dies

Import each name from the module that defines it: this package re-exports nothing.
"""
