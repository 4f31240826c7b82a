"""Configuration: YAML and dotted command-line overrides -> frozen pydantic dataclasses, validated before any
work (no process group, model or engine is needed). A field's type carries its range, its description (the
`Field`'s where it fits the line, else the docstring below it) its documentation: `make docs` writes them to
docs/configuration.md. A rule between fields of one section is in its `__post_init__`, across them `validate`.

    schema.py     the top-level sections (`data`, `algorithm`, `trainer`) and the root `Config`
    workers.py    the `worker.*` sections (actor, rollout, ref, reward)
    checks.py     `ConfigError`, the field types the sections declare their ranges with, the built-in names
    loader.py     `load_config`: YAML (strict: repeated keys refused), overrides, pydantic's errors in one line
    validate.py   `validate(cfg, world_size)`: the rules across sections and the world size
"""
