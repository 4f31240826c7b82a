"""Which modules may import which: every import inside spmd_grpo/ points to a LOWER layer (no cycles), and
the RL math stays free of collectives. The same table is in the README's ARCHITECTURE section."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "spmd_grpo"

LAYERS = {
    # 0: pure pieces, no spmd_grpo imports
    "config": 0, "versions": 0, "advantage": 0, "loss": 0, "reward": 0, "correction": 0, "families": 0,
    "attention": 0,
    "tools.synthetic_data": 0,
    # 1: the device/collective layer, trainer-side logprobs, data reading and sampling; the tiny-model builder
    "tools.make_tiny_model": 1, "distributed": 1, "logprobs": 1, "data": 1, "sampler": 1, "hf_weights": 1,
    # 2: the sample record, model building
    "rollout": 2, "model": 2,
    # 3: metrics, checkpoints, the vLLM engine and its weight stream
    "metrics": 3, "checkpoint": 3, "engine": 3,
    # 4: phases of a step; the loggers (console, jsonl, trackers); what a start does with the run directory
    "update": 4, "dynamic_sampling": 4, "validation": 4, "loggers": 4, "resume": 4,
    # 5: the loop, the planner, the exporter, the run report
    "trainer": 5, "plan": 5, "export": 5, "report": 5,
    # 6: entry points
    "train": 6, "smoke": 6, "launch": 6,
}  # fmt: skip
PURE_MATH = ("advantage", "loss", "reward", "correction")


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def _imports(path: Path) -> set[str]:
    """spmd_grpo modules imported anywhere in `path` (top level or inside functions)."""
    parts = _module_name(path).split(".")[:-1]  # the importing module's package, below spmd_grpo
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level + 1]
            elif (node.module or "").split(".")[0] == "spmd_grpo":
                base = []
                node = ast.ImportFrom(
                    module=node.module.removeprefix("spmd_grpo").lstrip("."), names=node.names
                )
            else:
                continue
            prefix = ".".join([*base, *filter(None, [node.module])])
            if prefix:
                out.add(prefix)
            else:  # `from . import distributed`
                out.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(
                a.name.removeprefix("spmd_grpo.") for a in node.names if a.name.startswith("spmd_grpo.")
            )
    return out


def test_every_module_has_a_layer():
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py") if p.stem != "__init__"}
    assert modules == set(LAYERS), (modules - set(LAYERS), set(LAYERS) - modules)


def test_imports_point_down():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        if name not in LAYERS:
            continue
        for target in _imports(path):
            if target not in LAYERS or LAYERS[target] >= LAYERS[name]:
                upward.append(f"{name} (layer {LAYERS[name]}) imports {target} (layer {LAYERS.get(target)})")
    assert not upward, upward


def test_rl_math_has_no_collectives():
    for name in PURE_MATH:
        tree = ast.parse((PACKAGE / f"{name}.py").read_text())
        imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in imported if m.startswith("torch.distributed")], name
        used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        used |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        collectives = {"distributed", "all_reduce", "all_gather", "broadcast", "reduce_scatter", "all_to_all"}
        assert not used & collectives, (name, used & collectives)
