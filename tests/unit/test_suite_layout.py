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


def test_every_test_file_sits_in_a_tier_folder():
    """conftest gives a test its tier (marker) from its folder; a test file elsewhere would be refused at
    collection, and a tier folder without tests would be a `make` target that runs nothing."""
    from tests.conftest import TIERS

    folders = {p.relative_to(TESTS).parts[0] for p in TESTS.rglob("test_*.py")}
    assert folders == set(TIERS), (folders, set(TIERS))


def test_the_tier_comes_from_the_folder(request):
    assert (
        request.node.get_closest_marker("dist") is None and request.node.get_closest_marker("engine") is None
    )
    assert not any(m.name in {"dist", "engine", "gpu"} for m in request.node.iter_markers())
