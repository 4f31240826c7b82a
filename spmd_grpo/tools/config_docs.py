"""`python -m spmd_grpo.tools.config_docs > docs/configuration.md` (`make docs`): the configuration reference,
generated from the config's fields: each key's type, default, range and description (its docstring). A unit
test fails when the committed page differs from what this prints."""

from __future__ import annotations

import dataclasses
import typing

import annotated_types as at

from spmd_grpo.config.checks import C_INT_MAX, FLOAT32_MAX
from spmd_grpo.config.schema import Config

INTRO = """# Configuration reference

Generated from the fields of `spmd_grpo/config/` by `make docs`: do not edit by hand.

A configuration is one YAML file plus dotted command-line overrides:

```bash
python -m spmd_grpo.train CONFIG.yaml [section.key=value ...] [--dry-run [--nnodes N] [--nproc-per-node M] [--device-memory-gb G]]
```

- An override's value is parsed as YAML (`[a,b]` is a list, `null` is None). A mapping given to a section
  (`'worker.actor.optim={weight_decay: 0.0}'`) merges into it; `null` for a section, in an override or the
  file (a section whose keys are all commented out), is an error rather than its defaults.
- An unknown key, a key given twice (in one YAML mapping or on the command line), a value of the wrong type
  or out of its range is an error naming the dotted key, before any process group or model exists
  (`spmd_grpo.train` prints one line and exits with code 2). A bool is never a number; a float key takes a
  numeric string (YAML reads `1e-6` as one); every integer fits a C int and every float is finite and
  within float32. YAML merge keys (`<<: *base`) work as in `yaml.safe_load`.
- Rules across keys (batch sizes against the world size and group size, tensor parallelism dividing the
  world, DAPO's settings) are checked by `validate`; what the config points to (model, data, reward file,
  resume directory) by the preflight on the machine that trains (a `--dry-run` skips it).
- `auto` settings are speed and memory choices that leave the numbers unchanged: `auto` turns each on
  wherever it applies; `true` where it cannot apply is an error saying why.
- The resolved config is written to `<run dir>/config.yaml` and into every checkpoint.
"""


OUTRO = """
## Environment variables read by the trainer

| variable | effect |
| --- | --- |
| `WORLD_SIZE` | set by torchrun; the world size the config is validated for |
| `HF_HUB_OFFLINE=1` | hub model ids must be in the local Hugging Face cache (`HF_HOME`, `HF_HUB_CACHE`) |
| `SPMD_GRPO_ALLOW_UNTESTED_VERSIONS=1` | a package outside the tested versions is a warning instead of an error |
| `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` | compared with `trainer.preempt_grace_s` at start-up (warning) |
| `HCCL_EXEC_TIMEOUT` | Ascend: HCCL's bound on one device operation; unset, each rank sets `trainer.collective_timeout_s` - 60 s (at least 68) before its process group forms |
| `MLFLOW_TRACKING_URI`, `WANDB_MODE`, `SWANLAB_MODE` | the trackers' own settings |"""


def main() -> None:
    print(render(), end="")


def render() -> str:
    out = [INTRO]
    _section(Config, "", out)
    out.append(OUTRO)
    return "\n".join(out) + "\n"


def _section(cls: type, prefix: str, out: list[str]) -> None:
    leaves, sections = [], []
    for name, info in cls.__pydantic_fields__.items():
        (sections if dataclasses.is_dataclass(info.annotation) else leaves).append((name, info))
    if leaves:
        doc = " ".join((cls.__doc__ or "").split())
        doc = "" if doc.startswith(f"{cls.__name__}(") else doc  # dataclasses' generated signature
        out += [f"\n## `{prefix.rstrip('.')}`\n", *([doc, ""] if doc else [])]
        out += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
        for name, info in leaves:
            default = info.default_factory() if info.default_factory else info.default
            kind = describe_type(info.annotation) + _range(info.metadata, info.annotation)
            text = " ".join((info.description or "").split()).replace("|", "\\|")
            out.append(f"| `{name}` | {kind} | `{_yaml(default)}` | {text} |")
    for name, info in sections:
        _section(info.annotation, f"{prefix}{name}.", out)


def describe_type(tp: object) -> str:
    """A type as a user reads it: `true or false`, `an integer`, `'a' or 'b'`, `a list`, `null`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return describe_type(args[0])
    if origin is typing.Literal:
        return " or ".join(map(repr, args))
    if origin is tuple:
        return "a list" if args[-1:] == (Ellipsis,) else f"a list of {len(args)} values"
    if args:  # a union
        return " or ".join(describe_type(a) for a in args)
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def _range(metadata: list, annotation: object) -> str:
    """`Ge(0)`, `Lt(1)`, ... of the field and of the types it is built from, as `, >= 0, < 1`."""
    found = list(metadata)
    for arg in typing.get_args(annotation):
        if typing.get_origin(arg) is typing.Annotated:
            found += [m for meta in typing.get_args(arg)[1:] for m in getattr(meta, "metadata", [meta])]
    signs = {at.Gt: ">", at.Ge: ">=", at.Lt: "<", at.Le: "<=", at.MinLen: "length >="}
    limits = {-C_INT_MAX - 1, C_INT_MAX, -FLOAT32_MAX, FLOAT32_MAX}  # every number's (the page's intro)
    bounds = [(signs[type(m)], getattr(m, dataclasses.fields(m)[0].name)) for m in found if type(m) in signs]
    return "".join(f", {sign} {value}" for sign, value in bounds if value not in limits)


def _yaml(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


if __name__ == "__main__":
    main()
