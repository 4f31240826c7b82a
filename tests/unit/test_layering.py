"""Which parts may import which: the package is a stack of subpackages, each importing only from the ones
below it; inside a subpackage the modules import each other without cycles; the RL math stays free of
collectives; nothing outside tests/ imports from tests/; every name is imported from the module that defines
it, and a subpackage's `__init__` is only its module map. The same stack is drawn in docs/architecture.md."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "spmd_grpo"

LAYERS = {
    # 0: plain Python and pure tensor math: no process group, no model
    "config": 0, "algorithm": 0, "versions": 0,
    # 1: devices, collectives, signals
    "parallel": 1,
    # 2: the model: families, sharded build, weights, attention, forward pass
    "models": 2,
    # 3: data sets, prompts, per-rank sampling, the sample record
    "data": 3,
    # 4: metrics, loggers, the report
    "telemetry": 4,
    # 5: the two halves of the hybrid engine (neither imports the other)
    "rollout": 5, "actor": 5,
    # 6: checkpoints, start/resume decisions, export
    "run": 6,
    # 7: the loop and the dry-run planner; the developer tools
    "trainer": 7, "dry_run": 7, "tools": 7,
    # 8: thin entry points
    "train": 8, "smoke": 8, "export": 8, "report": 8,
    # 9: the launcher, which checks train's command line once before torchrun starts the ranks
    "launch": 9,
}  # fmt: skip
PURE_MATH = "algorithm"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(module: str) -> str:
    return module.split(".")[0]


@functools.cache
def _import_statements(path: Path) -> tuple[ast.Import | ast.ImportFrom, ...]:
    """Every import statement in `path`, at the top level or inside functions. Cached: each file is parsed once
    for all the tests here, which read it up to seven times."""
    return tuple(
        n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Import | ast.ImportFrom)
    )


@functools.cache
def _imports(path: Path) -> frozenset[str]:
    """spmd_grpo modules (or packages) imported anywhere in `path` (top level or inside functions)."""
    package = _module_name(path).split(".")
    if path.stem != "__init__":
        package = package[:-1]
    out = set()
    for node in _import_statements(path):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, *filter(None, [node.module])])
            elif (node.module or "").split(".")[0] == "spmd_grpo":
                module = node.module.removeprefix("spmd_grpo").lstrip(".")
            else:
                continue
            if module:
                out.add(module)
            else:  # `from spmd_grpo import parallel` (but not `__version__`)
                out.update(
                    a.name
                    for a in node.names
                    if (PACKAGE / a.name).is_dir() or (PACKAGE / f"{a.name}.py").exists()
                )
        elif isinstance(node, ast.Import):
            out.update(
                a.name.removeprefix("spmd_grpo.") for a in node.names if a.name.startswith("spmd_grpo.")
            )
    return frozenset(out)


SOURCES = {_module_name(p): p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py"}


def test_every_part_has_a_layer():
    parts = {_part(m) for m in SOURCES}
    assert parts == set(LAYERS), (parts - set(LAYERS), set(LAYERS) - parts)


def test_imports_between_parts_point_down():
    upward = [
        f"{name} (layer {LAYERS[_part(name)]}) imports {target} (layer {LAYERS.get(_part(target))})"
        for name, path in SOURCES.items()
        for target in _imports(path)
        if _part(target) != _part(name) and LAYERS.get(_part(target), 99) >= LAYERS[_part(name)]
    ]
    assert not upward, upward


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_no_import_cycles_inside_a_part():
    """A package's `__init__` is left out: the modules must not need it."""
    graph = {
        name: {t for t in _imports(path) if _part(t) == _part(name) and t in SOURCES and t != _part(name)}
        for name, path in SOURCES.items()
        if name != _part(name) or SOURCES[name].stem != "__init__"
    }
    assert _cycle(graph) is None, _cycle(graph)


def test_modules_inside_a_part_do_not_import_its_init():
    """`from spmd_grpo.data import X` inside data/ would run data/__init__ half-way through its own import."""
    circular = [
        name
        for name, path in SOURCES.items()
        if path.stem != "__init__" and "." in name and _part(name) in _imports(path)
    ]
    assert not circular, circular


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_rl_math_has_no_collectives():
    for path in (PACKAGE / PURE_MATH).glob("*.py"):
        if path.stem == "__init__":
            continue
        tree = ast.parse(path.read_text())
        imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in imported if m.startswith(("torch.distributed", "spmd_grpo"))], path.name
        used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        used |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        collectives = {"distributed", "all_reduce", "all_gather", "broadcast", "reduce_scatter", "all_to_all"}
        assert not used & collectives, (path.name, used & collectives)


@pytest.mark.parametrize("folder", ["spmd_grpo", "benchmarks"])
def test_nothing_outside_tests_imports_tests(folder):
    hits = []
    for path in (REPO / folder).rglob("*.py"):
        for node in _import_statements(path):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            hits += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] == "tests"]
    assert not hits, hits


def test_every_subpackage_init_is_its_module_map():
    """Each subpackage's `__init__` is a docstring naming every module of the package, and no code: nothing
    is re-exported, so a reader (and `grep`) finds each name where it is defined."""
    for init in PACKAGE.glob("*/__init__.py"):
        tree = ast.parse(init.read_text())
        where = init.relative_to(REPO)
        doc = ast.get_docstring(tree)
        assert doc, f"{where} has no docstring"
        unmapped = [m.stem for m in init.parent.glob("*.py") if m.stem != "__init__" and m.stem not in doc]
        assert not unmapped, f"{where}: the docstring does not name {unmapped}"
        assert len(tree.body) == 1, f"{where}: code after the docstring (line {tree.body[1].lineno})"


def _packages() -> set[str]:
    return {"spmd_grpo", *(f"spmd_grpo.{p.parent.name}" for p in PACKAGE.glob("*/__init__.py"))}


@pytest.mark.parametrize("folder", ["spmd_grpo", "tests", "benchmarks"])
def test_names_are_imported_from_the_module_that_defines_them(folder):
    """`from spmd_grpo.models.build import build_policy`, never `from spmd_grpo.models import build_policy`
    (importing a module from its package, `from spmd_grpo.models import build`, is fine)."""
    packages, through_a_package = _packages(), []
    for path in (REPO / folder).rglob("*.py"):
        for node in _import_statements(path):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module in packages:
                folder_of = REPO / node.module.replace(".", "/")
                through_a_package += [
                    f"{path.relative_to(REPO)}:{node.lineno}: {node.module}.{a.name}"
                    for a in node.names
                    if a.name != "__version__"
                    and not (folder_of / a.name).is_dir()
                    and not (folder_of / f"{a.name}.py").exists()
                ]
    assert not through_a_package, through_a_package


@functools.cache
def _top_level_names(module: Path) -> frozenset[str]:
    """The names a module defines or imports at its top level (what `from module import name` can find)."""
    names, body = set(), list(ast.parse(module.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, ast.If | ast.Try | ast.With):  # `if TYPE_CHECKING:`, `try: import ...`
            body += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            body += [s for h in getattr(node, "handlers", []) for s in h.body]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return frozenset(names)


@pytest.mark.parametrize("folder", ["spmd_grpo", "tests", "benchmarks"])
def test_every_imported_name_exists(folder):
    """`from spmd_grpo.x import name` names something `x` defines, also inside a function: a renamed helper
    fails here, not when a benchmark or a test job that imports it lazily is next run."""
    missing = []
    for path in (REPO / folder).rglob("*.py"):
        for node in _import_statements(path):
            if not (isinstance(node, ast.ImportFrom) and not node.level and node.module):
                continue
            target = REPO / node.module.replace(".", "/")
            if (
                node.module.split(".")[0] not in ("spmd_grpo", "benchmarks", "tests")
                or not target.with_suffix(".py").exists()
            ):
                continue
            defined = _top_level_names(target.with_suffix(".py"))
            missing += [
                f"{path.relative_to(REPO)}:{node.lineno}: {node.module}.{a.name}"
                for a in node.names
                if a.name not in defined
            ]
    assert not missing, missing
