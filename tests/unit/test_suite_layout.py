"""Every test file is collected: pytest silently skips directories named like its default `norecursedirs`
(`dist`, `build`, `venv`, ...). A `tests/dist/` tier once went unrun by `make test` this way."""

import fnmatch
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
PYTEST_DEFAULT_NORECURSEDIRS = [
    "*.egg",
    ".*",
    "_darcs",
    "build",
    "CVS",
    "dist",
    "node_modules",
    "venv",
    "{arch}",
]


def test_no_test_directory_is_skipped_by_pytest_recursion():
    skipped = [
        d.relative_to(TESTS).as_posix()
        for d in TESTS.rglob("*")
        if d.is_dir() and d.name != "__pycache__"
        and any(fnmatch.fnmatch(d.name, pattern) for pattern in PYTEST_DEFAULT_NORECURSEDIRS)
    ]  # fmt: skip
    assert not skipped, f"pytest will not collect tests under {skipped}: rename them"
