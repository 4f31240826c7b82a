"""Configuration: YAML and dotted command-line overrides -> frozen pydantic dataclasses, validated before any
work. Everything here is plain Python: no process group, model or engine is needed to load and check a config.

    schema.py     the top-level sections (`data`, `algorithm`, `trainer`) and the root `Config`
    workers.py    the `worker.*` sections (actor, rollout, ref, reward)
    checks.py     `ConfigError`, the field types the sections declare their ranges with, and the checks of
                  files, hub ids and reward files
    loader.py     `load_config`: YAML (strict: repeated keys refused), overrides, pydantic's errors in one line
    validate.py   `validate(cfg, world_size)`: the rules across sections and the world size
"""
