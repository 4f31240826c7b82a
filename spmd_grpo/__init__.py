"""GRPO/DAPO post-training of Qwen-VL models as plain SPMD under torchrun: see the README's module map."""

from __future__ import annotations

import importlib
from collections.abc import Callable

__version__ = "0.1.0"


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]]) -> tuple[Callable, Callable, list[str]]:
    """`__getattr__`, `__dir__` and `__all__` for a subpackage that re-exports `{module: (name, ...)}`.

    A name is imported from its module on first access, so `import spmd_grpo.models.families` (a table of
    dataclasses) does not import torch through `models/__init__`: the config check before any process
    group must stay light.
    """
    where = {name: module for module, names in exports.items() for name in names}
    duplicated = len(where) != sum(len(names) for names in exports.values())
    assert not duplicated, f"{package}: a name is exported by two modules"

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{where[name]}"), name)

    def __dir__() -> list[str]:
        return sorted(where)

    return __getattr__, __dir__, sorted(where)
