"""Which checkpoint directory a resume takes: the names under `<run_dir>/checkpoints/`, which directories are
complete (`trainer_state.json` present, no `.tmp` suffix), which complete ones are damaged (a file unreadable,
missing, or different from the manifest), and `find_checkpoint`, which names any damage and falls back to the
previous complete checkpoint. The layout and the order in which a save writes these files: checkpoint.py.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch.distributed.checkpoint as dcp

from spmd_grpo.run.manifest import verify_manifest

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
    problems += [f"{path / name}: missing" for name in expected if not (path / name).is_file()]
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


# ------------------------------------------------------------------------------------------------ find
def find_checkpoint(run_dir: Path, resume: str, *, checksums: bool = True) -> Path | None:
    """The checkpoint to resume from: `none` -> None; `auto` -> the newest complete, undamaged one under
    `<run_dir>/checkpoints` (None if there is none; damaged ones are reported by file and skipped, so the
    previous checkpoint is used; older ones than the first undamaged are not read); anything else -> that directory, which must be complete and undamaged.
    `checksums`: verify the manifest's CRC-32s too (reads every byte), not only its sizes."""
    if resume == "none":
        return None
    if resume != "auto":
        path = Path(resume)
        missing = missing_parts(path)
        if missing:
            raise ValueError(f"resume={resume!r} is not a complete checkpoint: missing {', '.join(missing)}")
        damage = damaged_parts(path, checksums=checksums)
        if damage:
            raise ValueError(f"resume={resume!r} is damaged: {'; '.join(damage)}")
        return path

    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return None
    complete = complete_checkpoints(root)
    for p in sorted(root.iterdir()):
        if p.name.startswith("global_step_") and p not in complete.values():
            log.warning(
                "ignoring incomplete checkpoint %s (missing %s)", p, ", ".join(missing_parts(p)) or "?"
            )
    newest = None  # verified newest first, until one is undamaged: one full read when the newest is
    for step in sorted(complete, reverse=True):
        damage = damaged_parts(complete[step], checksums=checksums)
        if not damage:
            newest = complete[step]
            break
        log.warning("skipping damaged checkpoint %s: %s", complete[step], "; ".join(damage))
    if newest is None:
        return None
    latest_file = root / LATEST
    if latest_file.is_file():
        named = latest_file.read_text().strip()
        if named != newest.name:
            log.warning(
                "%s names %r but the newest complete checkpoint is %s: resuming from %s",
                latest_file,
                named,
                newest.name,
                newest,
            )
    return newest
