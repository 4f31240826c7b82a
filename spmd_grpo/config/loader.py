"""Loading a config: YAML file + dotted command-line overrides -> the frozen `Config` dataclasses.

Strict where a typo would otherwise be silent: a key repeated in one YAML mapping is refused (file and both
lines named), and so is a key set twice on the command line; a mapping given to a section on the command line
(`worker.actor.optim={weight_decay: 0.0}`) merges into it, as Hydra/OmegaConf merge (a non-mapping, `null`
included, is refused for a section); an unknown key is refused with its full dotted name and the closest valid key, a value of the
wrong type names the key and the expected type, floats must be finite and within float32, integers within
a C int (checks.py says why). `to_dict` / `dump_yaml` write the
resolved config back (next to the run's logs and into every checkpoint).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from spmd_grpo.config.checks import C_INT_MAX, C_INT_MIN, FLOAT32_MAX, ConfigError, OutOfRange
from spmd_grpo.config.schema import Config


# ------------------------------------------------------------------------------------------- loading
def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """YAML file (may be None: defaults) plus `a.b.c=value` overrides -> Config. Raises ConfigError."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"config file {path} is a directory (give the path of a YAML file)")
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            with path.open(encoding="utf-8") as stream:  # a stream, so that errors name the file
                raw = yaml.load(stream, Loader=_StrictLoader) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {_one_line(e)}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: not UTF-8 text ({_first_bad_byte(path)})") from None
        except OSError as e:
            raise ConfigError(f"config file {path} is not readable: {e.strerror}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    given: dict[str, str] = {}  # dotted key -> the override that set it
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        try:
            parsed = yaml.load(value, Loader=_StrictLoader) if value.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"override {key}: value {value!r} is not valid YAML: {_one_line(e)}") from None
        if parsed is None and dataclasses.is_dataclass(_schema_type(key)):  # would reset it to defaults
            raise ConfigError(
                f"override {key}: {key} is a section: give it a mapping ({key}={{key: value}}) or set its keys "
                f"one by one ({key}.key=value), not null"
            )
        for leaf in _leaves(key, parsed):
            if leaf in given:
                raise ConfigError(
                    f"command line: {leaf} is set twice ({given[leaf]!r}, then {item!r}); a key may be "
                    "given once, as in a YAML section"
                )
            given[leaf] = item
        _set_dotted(raw, key, parsed)
    return _build(Config, raw, prefix="")


def last_wins(overrides: list[str]) -> list[str]:
    """For programs that compose overrides (defaults, then what their user gave): each key once, with its
    last value, where it first appeared. `load_config` refuses a key given twice, as YAML does."""
    by_key: dict[str, str] = {}
    for item in overrides:
        by_key[item.partition("=")[0].strip()] = item
    return list(by_key.values())


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (SafeLoader keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                where = key_node.start_mark.name.replace("<unicode string>", "command-line override")
                raise ConfigError(
                    f"{where}: duplicate key {key!r} at line {line} "
                    f"(first at line {seen[key]}); a key may appear once per section"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _first_bad_byte(path: Path) -> str:
    """Where a file stops being UTF-8 (the decoder's error is relative to the chunk the reader held)."""
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        return f"byte {data[e.start]:#04x} on line {line}"
    return "it changed while read"


def _one_line(error: yaml.YAMLError) -> str:
    return " ".join(str(error).split())


def _schema_type(dotted: str) -> Any:
    """The schema type at `dotted` (a section's dataclass, a leaf's annotation); None for an unknown key."""
    tp: Any = Config
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(tp):
            return None
        tp = _type_hints(tp).get(part)
    return tp


def _leaves(dotted: str, value: Any) -> list[str]:
    """The dotted keys an override sets: its own, or those of the mapping it gives a section."""
    if not isinstance(value, dict):
        return [dotted]
    return [leaf for k, v in value.items() for leaf in _leaves(f"{dotted}.{k}", v)]


def _set_dotted(raw: dict, dotted: str, value: Any) -> None:
    """Set `dotted` in `raw`; a mapping merges into the section already there (the keys it does not name
    keep their YAML or earlier values: replacing the section silently reset them to the defaults)."""
    node = raw
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {part} is not a section")
        node = child
    _merge(node, parts[-1], value)


def _merge(node: dict, key: Any, value: Any) -> None:
    if isinstance(value, dict) and isinstance(node.get(key), dict):
        for k, v in value.items():
            _merge(node[key], k, v)
    else:
        node[key] = value


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """The section's field types, evaluated once (the annotations are strings under `from __future__`)."""
    return typing.get_type_hints(cls)


def _build(cls: type, raw: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "<top level>"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a section (mapping), got {type(raw).__name__} {raw!r}")
    hints = _type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            raise ConfigError(f"unknown config key {prefix}{key}{_suggest(prefix, str(key), cls)}")
    kwargs = {}
    for name, value in raw.items():
        kwargs[name] = _coerce(hints[name], value, f"{prefix}{name}")
    return cls(**kwargs)


def _suggest(prefix: str, key: str, cls: type) -> str:
    """Closest valid key: among this section's keys first, then among every dotted key of the schema."""
    local = difflib.get_close_matches(key, [f.name for f in dataclasses.fields(cls)], n=1, cutoff=0.6)
    if local:
        return f"; did you mean {prefix}{local[0]}?"
    everywhere = difflib.get_close_matches(f"{prefix}{key}", _all_keys(Config), n=1, cutoff=0.6)
    return f"; did you mean {everywhere[0]}?" if everywhere else ""


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    hints = _type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += _all_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def _coerce(tp: Any, value: Any, key: str) -> Any:
    """Check (and minimally convert: int -> float, list -> tuple) one value against its annotation."""
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, f"{key}.")
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key)
            except OutOfRange:  # the right type, a wrong value: say so, not "expected float or null"
                raise
            except ConfigError:
                pass
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: a list of any length
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return tuple(_coerce(args[0], v, key) for v in value)
    if origin is tuple:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(a, v, key) for a, v in zip(args, value, strict=True))
    if tp is float:
        number = _as_float(value)
        if number is not None:
            if not math.isfinite(number):
                raise OutOfRange(f"{key}: must be a finite number, got {value!r}")
            if abs(number) > FLOAT32_MAX:
                raise OutOfRange(f"{key}: {value!r} is beyond float32 (|x| <= {FLOAT32_MAX:.4g})")
            return number
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not C_INT_MIN <= value <= C_INT_MAX:
                raise OutOfRange(f"{key}: {value} does not fit a C int ({C_INT_MIN}..{C_INT_MAX})")
            return value
    elif tp is bool or tp is str:
        if isinstance(value, tp):
            return value
    else:
        raise AssertionError(f"config schema type {tp} of {key} is not handled")
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


def _as_float(value: Any) -> float | None:
    """A number, or a numeric string (YAML reads 1e-6, without a dot, as a string); None otherwise."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    if args and typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(_plain(to_dict(cfg)), sort_keys=False))
    tmp.replace(path)


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    return obj
