"""Which checkpoint directory a resume takes: the names under `<run_dir>/checkpoints/`, which directories are
complete (`trainer_state.json` present, no `.tmp` suffix), which complete ones are damaged (a file unreadable,
missing, or different from the manifest), and `find_checkpoint`, which names any damage and falls back to the
previous complete checkpoint. The layout and the order in which a save writes these files: checkpoint.py.

A checkpoint without `manifest.json` (saved before manifests existed) cannot be verified byte by byte: its
small files (scheduler, RNG states) are loaded to check them instead, its shards are checked against the
sizes DCP's metadata records, and resuming it says, in a warning, that it was not verified.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from spmd_grpo.run.manifest import MANIFEST, verify_manifest

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"
SCHEDULER = "scheduler.pt"
CONFIG = "config.yaml"
LATEST = "latest"
_STEP_DIR = re.compile(r"global_step_(\d+)")


# ------------------------------------------------------------------------------------------ completeness
def missing_parts(path: Path) -> list[str]:
    """What keeps `path` from being a complete checkpoint directory (empty list: it is complete)."""
    path = Path(path)
    if not path.is_dir():
        return ["the directory itself"]
    missing = []
    if path.name.endswith(".tmp"):
        missing.append("a final name (it ends in .tmp: the save did not finish)")
    if not (path / ".metadata").is_file():
        missing.append("DCP .metadata")
    if not (path / TRAINER_STATE).is_file():
        missing.append(TRAINER_STATE)
    return missing


def step_of(path: Path) -> int | None:
    """N of a `global_step_N` directory; None for any other name (`.tmp` included)."""
    m = _STEP_DIR.fullmatch(path.name)
    return int(m.group(1)) if m else None


def complete_checkpoints(ckpt_root: Path) -> dict[int, Path]:
    """step -> directory for every complete `global_step_N` (no warnings)."""
    if not ckpt_root.is_dir():
        return {}
    out = {}
    for p in ckpt_root.iterdir():
        step = step_of(p)
        if step is not None and p.is_dir() and (p / TRAINER_STATE).is_file():
            out[step] = p
    return out


def damaged_parts(path: Path, *, checksums: bool = True) -> list[str]:
    """What makes a complete-looking checkpoint unusable, each naming its file: an unreadable
    trainer_state.json or DCP .metadata, a file of the manifest missing, of another size or (`checksums`)
    another CRC-32 (manifest.py), a shard file shorter than the metadata says, a missing scheduler or RNG
    file of a rank. Without `checksums` it reads headers and file sizes only, never the tensors."""
    problems = []
    try:
        saved_world = json.loads((path / TRAINER_STATE).read_text()).get("world_size", 0)
    except (OSError, ValueError, AttributeError) as e:
        problems.append(f"{path / TRAINER_STATE}: not readable JSON ({e})")
        saved_world = 0
    manifest = verify_manifest(path, checksums=checksums)
    problems += manifest or []
    expected = [SCHEDULER] if manifest is None else []  # the manifest lists these (checked above)
    expected += [f"rng/rank{r}.pt" for r in range(saved_world if manifest is None else 0)]
    problems += [_unloadable(path / name) for name in expected]
    problems = [p for p in problems if p]
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a torn pickle raises anything from EOFError to UnpicklingError
        return [*problems, f"{path / '.metadata'}: unreadable ({type(e).__name__})"]
    needed: dict[str, int] = {}
    for item in (metadata.storage_data or {}).values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        file = path / name
        have = file.stat().st_size if file.is_file() else -1
        if have < size:
            problems.append(f"{file}: " + ("missing" if have < 0 else f"truncated ({have} of {size} bytes)"))
    return problems


def _unloadable(file: Path) -> str:
    """'' when `file` loads as tensors and plain data (a small file of a checkpoint without a manifest, where
    no checksum can vouch for it), else what is wrong with it, naming it."""
    if not file.is_file():
        return f"{file}: missing"
    try:
        torch.load(file, weights_only=True)
    except Exception as e:  # a torn zip archive, a pickled object: anything a load would fail on later
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return f"{file}: unreadable ({type(e).__name__}: {first})"
    return ""


def has_manifest(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def saved_lora_rank(checkpoint: Path) -> int | None:
    """The rank of the LoRA adapters a checkpoint holds (`model.*` entries that are adapters), 0 for a full
    checkpoint (whole weights, no adapter), None when its DCP metadata holds no policy (nothing to tell). A
    LoRA checkpoint of a model with tied embeddings saved before checkpoint.py dropped the frozen output head
    also holds `model.hf.lm_head.weight`: still adapters."""
    from spmd_grpo.models.lora import ADAPTER_KEYS, is_adapter_name

    entries = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    policy = {k: md for k, md in entries.items() if k.startswith("model.") and hasattr(md, "size")}
    if not policy:
        return None
    if not any(is_adapter_name(k) for k in policy):
        return 0
    return next(int(md.size[0]) for k, md in policy.items() if ADAPTER_KEYS[0] in k)  # lora_A: [rank, in]


# ------------------------------------------------------------------------------------------------ find
def _not_a_checkpoint(resume: str, path: Path, missing: list[str]) -> str:
    """Why `trainer.resume` is not a checkpoint; where it names a run directory or its `checkpoints/`
    instead of one checkpoint, the checkpoints found there."""
    said = f"trainer.resume={resume!r} is not a complete checkpoint: missing {', '.join(missing)}"
    found = sorted(p.name for d in (path, path / CHECKPOINTS) if d.is_dir() for p in d.glob("global_step_*"))
    if not found:
        return said
    return (
        f"{said}; it holds {', '.join(found[-3:])}: name one of them (trainer.resume takes a global_step_N "
        "directory), or use trainer.resume=auto in that run directory"
    )


def find_checkpoint(
    run_dir: Path,
    resume: str,
    *,
    checksums: bool = True,
    rank: int | None = 0,
    damaged: tuple[Path, ...] = (),
) -> Path | None:
    """The checkpoint to resume from: `none` -> None; `auto` -> the newest complete, undamaged one under
    `<run_dir>/checkpoints` (None if there is none; damaged ones are reported by file and skipped, so the
    previous checkpoint is used; older ones than the first undamaged are not read); anything else -> that
    directory, which must be complete and undamaged. `checksums`: verify the manifest's CRC-32s too (reads
    every byte), not only its sizes. `rank`: the rank whose warnings these are (each prefixed `rank N: `),
    None: none (another rank says what it found: each warning once). `damaged` (with `auto`): checkpoints
    already found damaged and named (by the checksums after the start: run/verify.py), passed over without
    reading them again; the incomplete ones were named on that first search too, and are not again."""
    say = log.warning if rank is not None else log.debug
    prefix = f"rank {rank}: " if rank is not None else ""
    if resume == "none":
        return None
    if resume != "auto":
        return _named_checkpoint(resume, checksums, say, prefix)
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return None
    complete = complete_checkpoints(root)
    for p in sorted(root.iterdir()) if not damaged else ():
        if p.name.startswith("global_step_") and p not in complete.values():
            say(
                "%signoring incomplete checkpoint %s (missing %s)",
                prefix,
                p,
                ", ".join(missing_parts(p)) or "?",
            )
    newest = None  # verified newest first, until one is undamaged: one full read when the newest is
    for step in sorted(complete, reverse=True):
        if complete[step] in damaged:
            continue
        damage = damaged_parts(complete[step], checksums=checksums)
        if not damage:
            newest = complete[step]
            break
        say("%sskipping damaged checkpoint %s: %s", prefix, complete[step], "; ".join(damage))
    if newest is None:
        return None
    latest_file = root / LATEST
    if latest_file.is_file():
        named = latest_file.read_text().strip()
        if named != newest.name:
            say(
                "%s%s names %r but the newest complete checkpoint is %s: resuming from %s",
                prefix,
                latest_file,
                named,
                newest.name,
                newest,
            )
    _say_if_unverified(newest, say, prefix)
    return newest


def _named_checkpoint(resume: str, checksums: bool, say, prefix: str) -> Path:
    """`trainer.resume=PATH`: that directory, complete and undamaged (ValueError naming what is not)."""
    path = Path(resume)
    missing = missing_parts(path)
    if missing:
        raise ValueError(_not_a_checkpoint(resume, path, missing))
    damage = damaged_parts(path, checksums=checksums)
    if damage:
        raise ValueError(f"trainer.resume={resume!r} is damaged: {'; '.join(damage)}")
    _say_if_unverified(path, say, prefix)
    return path


def _say_if_unverified(path: Path, say, prefix: str) -> None:
    if not has_manifest(path):
        say(
            "%sresuming %s unverified: it has no %s (saved before manifests existed), so its files' sizes "
            "and checksums could not be checked; a file that fails to load is named",
            prefix,
            path,
            MANIFEST,
        )


def fallback_checkpoint(failed: Path, error: Exception, *, rank: int) -> Path | None:
    """After `failed` (resumed by trainer.resume=auto) did not load: the previous complete, undamaged
    checkpoint of its run (sizes checked; the same answer on every rank), as for a damaged one found before
    the start. Only for a checkpoint without a manifest, whose damage could not be seen beforehand (None for
    any other: its failure is not damage). Rank 0 says it, once."""
    if has_manifest(failed):
        return None
    complete = complete_checkpoints(failed.parent)
    for path in [complete[step] for step in sorted(complete, reverse=True) if step < (step_of(failed) or 0)]:
        if not damaged_parts(path, checksums=False):
            if rank == 0:
                log.warning("rank 0: %s failed to load (%s): it had no manifest to verify it before; resuming "
                            "the previous complete checkpoint %s", failed, error, path)  # fmt: skip
            return path
    return None
