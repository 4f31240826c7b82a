"""The package stays readable: short functions, few positional parameters, no test hooks, no outside references.

Limits (measured on the source with `ast`, so they cannot drift from the code):
  * no module in spmd_grpo/ is longer than 420 lines (past ~400 a file usually holds two jobs: split it);
  * no function or method in spmd_grpo/ is longer than 60 lines (docstring included);
  * no function takes more than 6 parameters that are not keyword-only (`self` counted);
  * the training loop's body (`for step in ...` in trainer.py) is at most 80 lines;
  * no docstring or comment points at a document that is not in the repository (`shared/...`);
  * no environment variable switches test behaviour on in production code (`SPMD_GRPO_TEST*`).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import NamedTuple

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "spmd_grpo"
SOURCES = sorted(PACKAGE.rglob("*.py"))
MAX_MODULE_LINES = 420
MAX_FUNCTION_LINES = 60
MAX_POSITIONAL = 6
MAX_LOOP_BODY_LINES = 80


class _Function(NamedTuple):
    name: str
    lineno: int
    lines: int  # docstring included
    positional: int  # parameters that are not keyword-only, `self` counted


@functools.cache
def _functions(path: Path) -> tuple[_Function, ...]:
    """Every function and method in `path` (each file parsed once for the tests here)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return tuple(
        _Function(n.name, n.lineno, n.end_lineno - n.lineno + 1, len(n.args.posonlyargs) + len(n.args.args))
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
    )


def _where(path: Path, f: _Function) -> str:
    return f"{path.relative_to(PACKAGE.parent)}:{f.lineno} {f.name}"


def test_sources_found():
    assert len(SOURCES) > 10


def test_no_long_modules():
    long = [
        f"{p.relative_to(PACKAGE.parent)} ({n} lines)"
        for p in SOURCES
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, long


def test_no_long_functions():
    long = [
        f"{_where(p, f)} ({f.lines} lines)"
        for p in SOURCES
        for f in _functions(p)
        if f.lines > MAX_FUNCTION_LINES
    ]
    assert not long, long


def test_few_positional_parameters():
    wide = [
        f"{_where(p, f)} ({f.positional} positional)"
        for p in SOURCES
        for f in _functions(p)
        if f.positional > MAX_POSITIONAL
    ]
    assert not wide, wide


def test_training_loop_body_fits_a_screen():
    tree = ast.parse((PACKAGE / "trainer.py").read_text())
    loops = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.For) and isinstance(n.target, ast.Name) and n.target.id == "step"
    ]
    assert len(loops) == 1, "expected one `for step in ...` loop in trainer.py"
    body = loops[0].body
    assert body[-1].end_lineno - body[0].lineno + 1 <= MAX_LOOP_BODY_LINES


@pytest.mark.parametrize("needle", ["shared/", "SPMD_GRPO_TEST", "DESIGN-NOTES", "VERIFIED-FACTS"])
def test_no_references_outside_the_repository_or_test_switches(needle):
    hits = [str(p.relative_to(PACKAGE.parent)) for p in SOURCES if needle in p.read_text()]
    assert not hits, hits
