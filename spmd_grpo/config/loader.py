"""`load_config`: YAML file + dotted command-line overrides -> the frozen `Config`, validated by pydantic.
Here is what pydantic does not do: a key repeated in one YAML mapping or on the command line is refused, a
mapping override merges into its section (as OmegaConf's), and pydantic's errors become one line naming the
dotted key, with the closest valid key for an unknown one."""

from __future__ import annotations

import dataclasses
import difflib
import io
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from spmd_grpo.config.checks import ConfigError
from spmd_grpo.config.schema import Config


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """YAML file (may be None: defaults) plus `a.b.c=value` overrides -> Config. Raises ConfigError."""
    raw = _read_yaml(Path(path)) if path is not None else {}
    given: dict[str, str] = {}  # dotted key -> the override that set it
    for item in overrides:
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        _override(raw, key, _parse(value, f"command-line override {item!r}") if value else None, item, given)
    try:
        return TypeAdapter(Config).validate_python(raw)
    except ValidationError as e:
        raise ConfigError(_message(e.errors())) from None


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        raw = _parse(path.read_text(encoding="utf-8"), str(path)) or {}
    except (OSError, UnicodeError) as e:  # not found, a directory, not UTF-8 text
        raise ConfigError(f"config file {path}: {getattr(e, 'strerror', None) or e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    return raw


def _parse(text: str, where: str) -> Any:
    stream = io.StringIO(text)
    stream.name = where  # YAML's errors and the duplicate-key refusal name it
    try:
        return yaml.load(stream, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {' '.join(str(e).split())}") from None


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
                raise ConfigError(
                    f"{key_node.start_mark.name}: duplicate key {key!r} at line {line} "
                    f"(first at line {seen[key]}); a key may appear once per section"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


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


def all_keys(cls: type = Config, prefix: str = "", sections: bool = False) -> list[str]:
    """Every dotted leaf key of the schema (and section, with `sections`), in declaration order."""
    keys = []
    for name, info in cls.__pydantic_fields__.items():
        if not dataclasses.is_dataclass(info.annotation):
            keys.append(f"{prefix}{name}")
        else:
            keys += [f"{prefix}{name}"] * sections + all_keys(info.annotation, f"{prefix}{name}.", sections)
    return keys


def _message(errors: list[dict]) -> str:
    """The first key's error as one line naming the dotted key, in pydantic's words (a union's joined)."""
    key, leaf = _walk(errors[0]["loc"])
    same = [e for e in errors if _walk(e["loc"])[0] == key]
    same = [e for e in same if not e["type"].endswith(("_type", "_parsing", "literal_error"))] or same
    kind, value = same[0]["type"], same[0].get("input")
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        return f"unknown config key {key}{_suggest(key)}"
    if kind == "value_error" and dataclasses.is_dataclass(leaf):  # a section's own rule names its field
        return f"{key + '.' if key else ''}{same[0]['ctx']['error']}"
    index = "".join(f"[{p}]" for p in same[0]["loc"][key.count(".") + 1 :] if isinstance(p, int))
    wants = dict.fromkeys(_words(e) for e in same)
    return f"{key}{index}: {' or '.join(wants).replace(' or must be ', ' or ')}, got {value!r}"


def _words(error: dict) -> str:
    """One error as a user reads it: our rule's message, or pydantic's with YAML's names."""
    if error["type"] == "value_error":
        return str(error["ctx"]["error"])
    words = error["msg"].replace("Input should be ", "must be ").replace("Tuple should", "must")
    return (words[0].lower() + words[1:]).replace("valid tuple", "list")


def _suggest(dotted: str) -> str:
    """The closest dotted key or section of the schema (a misspelt key, or one in the wrong section)."""
    match = difflib.get_close_matches(dotted, all_keys(sections=True), n=1, cutoff=0.6)
    return f"; did you mean {match[0]}?" if match else ""


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain YAML/JSON values (tuples as lists), as `config.yaml` reads back."""
    return TypeAdapter(Config).dump_python(cfg, mode="json")
