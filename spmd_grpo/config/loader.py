"""`load_config`: YAML file + dotted command-line overrides -> the frozen `Config`, validated by pydantic.

Here is what pydantic does not do: a key repeated in one YAML mapping or on the command line is refused; a
mapping override merges into its section (as OmegaConf's), `null` for a section is refused in an override (it
would reset the section) and means its defaults in the file; pydantic's errors become one line naming the
dotted key, with the closest valid key for an unknown one and the replacement of a removed one.
"""

from __future__ import annotations

import dataclasses
import difflib
import io
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from spmd_grpo.config.checks import ConfigError
from spmd_grpo.config.schema import Config

MOVED = {
    "algorithm.adv_std_scope": "its `batch` is now algorithm.norm_adv_by_std_in_grpo=batch",
    "algorithm.adv_estimator=drgrpo": "Dr.GRPO is GRPO without the std division: set "
    "algorithm.norm_adv_by_std_in_grpo=false (verl's key), with "
    "worker.actor.loss_agg_mode=seq-mean-token-sum-norm for its loss",
}
"""Keys and values that were removed, with what replaces them."""


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """YAML file (may be None: defaults) plus `a.b.c=value` overrides -> Config. Raises ConfigError."""
    raw = _read_yaml(Path(path)) if path is not None else {}
    _drop_empty_sections(raw, "")
    given: dict[str, str] = {}  # dotted key -> the override that set it
    for item in overrides:
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        try:
            parsed = yaml.load(value, Loader=_StrictLoader) if value else None
        except yaml.YAMLError as e:
            raise ConfigError(f"override {key}: value {value!r} is not valid YAML: {_one_line(e)}") from None
        _override(raw, key, parsed, item, given)
    try:
        return TypeAdapter(Config).validate_python(raw)
    except ValidationError as e:
        raise ConfigError(_message(e.errors())) from None


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        what = "is a directory (give the path of a YAML file)" if path.is_dir() else "not found"
        raise ConfigError(f"config file {path} {what}")
    try:
        data = path.read_bytes()
        stream = io.StringIO(data.decode("utf-8"))
        stream.name = str(path)  # YAML's errors name the file
        raw = yaml.load(stream, Loader=_StrictLoader) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {_one_line(e)}") from None
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}: not UTF-8 text (byte {data[e.start]:#04x} on line {line})") from None
    except OSError as e:
        raise ConfigError(f"config file {path} is not readable: {e.strerror}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    return raw


def last_wins(overrides: list[str]) -> list[str]:
    """For programs that compose overrides (defaults, then what their user gave): each key once, with its
    last value, where it first appeared. `load_config` refuses a key given twice, as YAML does."""
    return list({item.partition("=")[0].strip(): item for item in overrides}.values())


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (SafeLoader keeps the last silently);
    keys brought in by a merge key (`<<: *base`) may be overridden, as YAML defines."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            if key in seen:
                where = key_node.start_mark.name.replace("<unicode string>", "command-line override")
                raise ConfigError(
                    f"{where}: duplicate key {key!r} at line {line} "
                    f"(first at line {seen[key]}); a key may appear once per section"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _one_line(error: yaml.YAMLError) -> str:
    return " ".join(str(error).split())


def _drop_empty_sections(raw: dict, prefix: str) -> None:
    """A section left empty in the file (`trainer:` with its keys commented out) means its defaults."""
    for key, value in list(raw.items()):
        if value is None and dataclasses.is_dataclass(section_type(f"{prefix}{key}")):
            del raw[key]
        elif isinstance(value, dict):
            _drop_empty_sections(value, f"{prefix}{key}.")


def _override(raw: dict, dotted: str, value: Any, item: str, given: dict[str, str]) -> None:
    """Set `dotted` in `raw` to `value` of the override `item`; a mapping merges into the section key by key
    (the keys it does not name keep their YAML or earlier values). `given`: the keys set so far."""
    *parents, key = dotted.split(".")
    node = raw
    for i, part in enumerate(parents):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {'.'.join(parents[: i + 1])} is not a section")
    if isinstance(value, dict) and isinstance(node.setdefault(key, {}), dict):
        for k, v in value.items():
            _override(raw, f"{dotted}.{k}", v, item, given)
        return
    if value is None and dataclasses.is_dataclass(section_type(dotted)):
        raise ConfigError(
            f"override {item!r}: {dotted} is a section: give it a mapping ({dotted}={{key: value}}) or set "
            f"its keys one by one ({dotted}.key=value), not null (that would reset its keys to the defaults)"
        )
    if dotted in given:
        raise ConfigError(
            f"command line: {dotted} is set twice ({given[dotted]!r}, then {item!r}); a key may be "
            "given once, as in a YAML section"
        )
    given[dotted] = item
    node[key] = value


def _walk(loc: tuple | list) -> tuple[str, Any]:
    """The longest prefix of `loc` (pydantic's error location, a dotted key's parts) naming schema keys, as a
    dotted key, and the type there (None: an unknown key); a list index or a union's tag ends it."""
    names, tp = [], Config
    for part in loc:
        if not dataclasses.is_dataclass(tp) or not isinstance(part, str):
            break
        names.append(part)
        tp = tp.__pydantic_fields__[part].annotation if part in tp.__pydantic_fields__ else None
    return ".".join(names), tp


def section_type(dotted: str) -> Any:
    """The schema type at `dotted` (a section's dataclass, a leaf's annotation); None for an unknown key."""
    key, tp = _walk(dotted.split("."))
    return tp if key == dotted else None


def all_keys(cls: type = Config, prefix: str = "", sections: bool = False) -> list[str]:
    """Every dotted leaf key of the schema (and section, with `sections`), in declaration order."""
    keys = []
    for name, info in cls.__pydantic_fields__.items():
        if not dataclasses.is_dataclass(info.annotation):
            keys.append(f"{prefix}{name}")
        else:
            keys += [f"{prefix}{name}"] * sections + all_keys(info.annotation, f"{prefix}{name}.", sections)
    return keys


_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
_TELLING = ("finite_number", *_BOUNDS, "value_error", "too_short")
"""Of a value's errors (a union gives one per alternative), the most telling first."""


def _message(errors: list[dict]) -> str:
    """The first key's error as one line naming the dotted key."""
    key, leaf = _walk(errors[0]["loc"])
    same = [e for e in errors if _walk(e["loc"])[0] == key]
    err = min(same, key=lambda e: _TELLING.index(e["type"]) if e["type"] in _TELLING else len(_TELLING))
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx", {})
    index = err["loc"][key.count(".") + 1 :]
    got = "" if isinstance(value, list | tuple) and kind == "value_error" else f", got {value!r}"
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        return (
            f"config key {key} was removed: {MOVED[key]}"
            if key in MOVED
            else f"unknown config key {key}{_suggest(key)}"
        )
    if f"{key}={value}" in MOVED:
        return f"{key}={value} was removed: {MOVED[f'{key}={value}']}"
    if dataclasses.is_dataclass(leaf):  # a section's own rule names its field; anything else is not a mapping
        if kind == "value_error":
            return f"{key + '.' if key else ''}{ctx['error']}"
        return f"{key}: expected a section (mapping), got {type(value).__name__} {value!r}"
    if kind in _BOUNDS:
        return f"{key} must be {_BOUNDS[kind]} {next(iter(ctx.values()))}{got}"
    if kind == "too_short":
        return f"{key} must not be empty{got}"
    if kind in ("value_error", "finite_number"):
        return f"{key}: {ctx['error'] if ctx else 'must be a finite number'}{got}"
    if index and isinstance(index[0], int) and kind != "missing":  # a list's element: pydantic's words
        return f"{key}[{index[0]}]: {err['msg'][0].lower()}{err['msg'][1:]}{got}"
    return f"{key}: expected {describe_type(leaf)}, got {type(value).__name__} {value!r}"


def describe_type(tp: Any) -> str:
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


def _suggest(dotted: str) -> str:
    """The closest dotted key or section of the schema (a misspelt key, or one in the wrong section)."""
    match = difflib.get_close_matches(dotted, all_keys(sections=True), n=1, cutoff=0.6)
    return f"; did you mean {match[0]}?" if match else ""


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain YAML/JSON values (tuples as lists), as `config.yaml` reads back."""
    return TypeAdapter(Config).dump_python(cfg, mode="json")


def dump_yaml(cfg: Config, path: Path) -> None:
    """The resolved config as YAML (next to the run's logs and in every checkpoint)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    tmp.replace(path)
