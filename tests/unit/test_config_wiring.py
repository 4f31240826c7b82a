"""Every config field is read somewhere as `section.field`: an attribute read whose object the code shows to
be that section (`cfg.worker.rollout.n`; `rollout.n` where `rollout = cfg.worker.rollout` or a parameter
annotated `RolloutConfig`), found with `ast`. A field nothing reads but its own validation is a setting that
silently does nothing; a bare `.n` on any object does not count. `worker.actor.model.trust_remote_code` is
checked where the model is built (tests/distributed/test_model_load.py); what reaches vLLM is read back from
real engines built by `RolloutEngine.from_config` in tests/engine/test_engine_parity.py."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

from spmd_grpo.config.schema import Config

REPO = Path(__file__).resolve().parents[2]
VALIDATION = ("check", "_check", "require")  # config/ functions whose reads are the rules, not the use
ONE_VALUE = {"AlgorithmConfig.adv_estimator"}
"""Keys with a single allowed value, accepted so that verl's scripts (`algorithm.adv_estimator=grpo`) run."""


def _config_tree() -> tuple[dict[str, str], dict[str, set[str]]]:
    """({section field name: its class name}, {class name: its plain (non-section) fields})."""
    section_of: dict[str, str] = {}
    fields: dict[str, set[str]] = {}

    def walk(cls) -> None:
        hints = typing.get_type_hints(cls)
        fields[cls.__name__] = set()
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                name = hints[f.name].__name__
                assert section_of.setdefault(f.name, name) == name, f"two sections named {f.name}"
                walk(hints[f.name])
            else:
                fields[cls.__name__].add(f.name)

    walk(Config)
    return section_of, fields


SECTION_OF, FIELDS = _config_tree()


def _annotated(annotation: ast.expr | None) -> str | None:
    """The config class an annotation names (`RolloutConfig`, `"RolloutConfig"`, `RolloutConfig | None`)."""
    for node in ast.walk(annotation) if annotation is not None else ():
        name = node.id if isinstance(node, ast.Name) else getattr(node, "value", None)
        if isinstance(name, str) and name in FIELDS:
            return name
    return None


def _kind(expr: ast.expr, env: dict[str, str]) -> str | None:
    """The config class `expr` evaluates to, where the code shows it."""
    if isinstance(expr, ast.Attribute):
        if expr.attr in SECTION_OF:  # `cfg.worker.rollout`, `self.cfg.data`
            return SECTION_OF[expr.attr]
        if isinstance(expr.value, ast.Name) and expr.value.id == "self":
            return env.get(f"self.{expr.attr}")
    if isinstance(expr, ast.Name):
        return env.get(expr.id)
    if isinstance(expr, ast.Call):
        func = expr.func.id if isinstance(expr.func, ast.Name) else getattr(expr.func, "attr", None)
        if func == "replace" and expr.args:  # dataclasses.replace keeps the class
            return _kind(expr.args[0], env)
        return func if func in FIELDS else None
    if isinstance(expr, ast.IfExp):
        return _kind(expr.body, env) or _kind(expr.orelse, env)
    if isinstance(expr, ast.BoolOp):
        return next((k for v in expr.values if (k := _kind(v, env))), None)
    return None


def _bind(target: ast.expr, value: ast.expr, env: dict[str, str]) -> None:
    """`target = value`: remember what a name (or `self.x`) holds; tuples element by element."""
    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
        for t, v in zip(target.elts, value.elts, strict=True):
            _bind(t, v, env)
    elif (kind := _kind(value, env)) is not None:
        if isinstance(target, ast.Name):
            env[target.id] = kind
        elif isinstance(target, ast.Attribute) and getattr(target.value, "id", None) == "self":
            env[f"self.{target.attr}"] = kind


def _function_env(fn: ast.FunctionDef, outer: dict[str, str], owner: str | None) -> dict[str, str]:
    env = dict(outer)
    positional = [*fn.args.posonlyargs, *fn.args.args]
    for a in [*positional, *fn.args.kwonlyargs]:
        if (kind := _annotated(a.annotation)) is not None:
            env[a.arg] = kind
    if owner in FIELDS and positional:
        env[positional[0].arg] = owner  # `self` in a config class's own method
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                _bind(target, node.value, env)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if (kind := _annotated(node.annotation)) is not None:
                env[node.target.id] = kind
            elif node.value is not None:
                _bind(node.target, node.value, env)
    return env


def _record(node: ast.AST, env: dict[str, str], out: set[tuple[str, str]]) -> None:
    """The `section.field` reads in `node`, outside nested functions and classes (they have their own scope).
    `getattr(section, "field")` reads the field; `dataclasses.asdict(section)` hands over every field."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, ast.Attribute) and (kind := _kind(n.value, env)) and n.attr in FIELDS[kind]:
            out.add((kind, n.attr))
        if isinstance(n, ast.Call) and n.args and (kind := _kind(n.args[0], env)):
            func = n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", None)
            name = getattr(n.args[1], "value", None) if len(n.args) > 1 else None
            if func == "getattr" and name in FIELDS[kind]:
                out.add((kind, name))
            elif func == "asdict":
                out.update((kind, f) for f in FIELDS[kind])
        stack.extend(
            c
            for c in ast.iter_child_nodes(n)
            if not isinstance(c, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        )


def _reads(body: list[ast.stmt], env: dict[str, str], out: set, skip: tuple[str, ...], owner=None) -> None:
    for node in body:
        if isinstance(node, ast.ClassDef):
            class_env = dict(env)  # what `self.x` holds, from every method's assignments
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef):
                    class_env |= {
                        k: v for k, v in _function_env(fn, env, node.name).items() if k[:5] == "self."
                    }
            _reads(node.body, class_env, out, skip, owner=node.name)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if not (skip and node.name.startswith(skip)):
                _reads(node.body, _function_env(node, env, owner), out, skip)
        else:
            _record(node, env, out)


def section_field_reads(source: str, skip: tuple[str, ...] = ()) -> set[tuple[str, str]]:
    """{(config class name, field)} read as `section.field` in `source`, outside functions named `skip*`."""
    out: set[tuple[str, str]] = set()
    _reads(ast.parse(source).body, {}, out, skip)
    return out


def test_every_field_is_read_as_section_field():
    read = set()
    for path in (REPO / "spmd_grpo").rglob("*.py"):
        read |= section_field_reads(path.read_text(), VALIDATION if path.parent.name == "config" else ())
    unread = sorted(f"{cls}.{f}" for cls, names in FIELDS.items() for f in names if (cls, f) not in read)
    unread = [name for name in unread if name not in ONE_VALUE]
    assert not unread, unread


def test_only_reads_of_a_known_section_count():
    """The control: the same names on objects the code does not show to be a section are not reads."""
    source = """
def step(cfg: Config, other, rollout: RolloutConfig | None):
    r, d = cfg.worker.rollout, cfg.data
    ref = replace(cfg.worker.ref, dtype="bf16")
    return r.n, other.temperature, d.max_prompt_length, rollout.top_p, ref.offload_params, n.max_pixels

def check_data(cfg: DataConfig):
    return cfg.min_pixels

class Engine:
    def __init__(self, cfg: RolloutConfig, data):
        self.cfg, self.data_ = cfg, data

    def go(self):
        return self.cfg.top_k, self.data_.min_pixels, self.other.seed
"""
    assert section_field_reads(source, skip=VALIDATION) == {
        ("RolloutConfig", "n"),
        ("DataConfig", "max_prompt_length"),
        ("RolloutConfig", "top_p"),
        ("RefConfig", "offload_params"),
        ("RolloutConfig", "top_k"),
    }
