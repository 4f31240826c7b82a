"""Resumable checkpoints: sharded policy + optimizer (torch.distributed.checkpoint), LR schedule, RNG, trainer state.

Layout of `<run_dir>/checkpoints/`:

    global_step_{N}/
        .metadata, __{rank}_0.distcp  DCP: {"model": policy, "optim": AdamW state} as sharded (DTensor) state
                                      dicts from `get_state_dict`, keyed by clean FQNs (`hf.model.language_model...`)
        scheduler.pt                  LR scheduler state (rank 0)
        rng/rank{r}.pt                python `random`, numpy, torch CPU and accelerator RNG of rank r
        config.yaml                   the resolved config the run had when it saved (rank 0; what a resume
                                      compares its config with: saved_config.py)
        manifest.json                 size and CRC-32 of every file above (manifest.py), written before:
        trainer_state.json            the caller's trainer state + `step`, `world_size`, `model_path`
    latest                            name of the newest checkpoint directory (written atomically)

Completeness rule: a checkpoint directory is COMPLETE iff its name is `global_step_{N}` (no `.tmp` suffix) and
it contains `trainer_state.json`. That file is written last, after DCP's `.metadata` (itself written only once
every rank's shards are on disk), the scheduler, the config, every rank's RNG file and the manifest. A
complete checkpoint is DAMAGED (`damaged_parts`) when a file is unreadable, missing, or differs from the
manifest; `checkpoint_dirs.find_checkpoint` names the file and takes the previous checkpoint.

Crash safety: everything is written into `global_step_{N}.tmp/` and renamed by rank 0 once complete, then
`latest` is replaced atomically (write `latest.tmp`, fsync, `os.replace`). A kill during a save leaves only a
`.tmp` directory (ignored, with a warning, by `find_checkpoint`) and the previous `latest` / checkpoints. Pruning
first deletes a checkpoint's `trainer_state.json` (making it incomplete in one step), then the rest, so a kill
while pruning cannot leave a half-deleted directory that looks complete. `run_dir` must be on a filesystem that
every rank sees (one shared directory on multi-node runs).

LoRA (`worker.actor.model.lora`): "model" and "optim" hold only the adapters and their Adam state
(`_state_dicts`); the frozen base is `model_path`, read again at start-up. Qwen2.5-VL-72B with rank 16 on
every language-model linear layer: 0.21B adapter parameters, 0.84 GB of fp32 adapters + 1.68 GB of Adam
moments = 2.5 GB per checkpoint instead of ~1.2 TB for full fine-tuning.

Resharding: DCP stores each tensor's global shape and the chunks each rank wrote; `load_checkpoint` asks for the
shards of the CURRENT world's DTensors, so a checkpoint saved at world size W loads at any world size (model and
Adam state). The RNG streams are per rank and are only restored when the world size is unchanged; otherwise they
restart from the run's seed (logged once).

What a resume restores: the weights, Adam's moments and step counts, the schedule's POSITION, the RNG. The
optimizer's settings (lr, betas, weight decay, the schedule's base lr and shape) come from the config of the
run that resumes, so a changed `lr` or `max_steps` takes effect (both the optimizer's and the scheduler's
state dicts carry the old values, which torch would otherwise restore silently).

The optimizer state must exist when saving: `get_state_dict` initialises an empty AdamW state with a zero-lr step
(which sets its step counter to 1), so save after the first optimizer step, not before.
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from spmd_grpo.models.lora import has_adapters, is_adapter_name
from spmd_grpo.parallel.collectives import World, all_gather_objects, barrier
from spmd_grpo.parallel.devices import device_module
from spmd_grpo.run.checkpoint_dirs import (
    CHECKPOINTS,
    CONFIG,
    LATEST,
    SCHEDULER,
    TRAINER_STATE,
    complete_checkpoints,
    fallback_checkpoint,
    missing_parts,
)
from spmd_grpo.run.manifest import file_entries, write_manifest

if TYPE_CHECKING:
    from spmd_grpo.actor.optimizer import OptimizerBundle

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ save
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write `path` so that readers see either the old or the new content, never a torn file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _delete_checkpoint(path: Path) -> None:
    """Make it incomplete first (one unlink), then remove the rest."""
    (path / TRAINER_STATE).unlink(missing_ok=True)
    shutil.rmtree(path)


def _rng_state(world: World) -> dict:
    """Every RNG stream of this rank, in types `torch.load(weights_only=True)` accepts (numpy's key array
    as a tensor: a pickled ndarray would need the unsafe loader)."""
    mod = device_module(world.device_type)
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },  # fmt: skip
        "torch": torch.get_rng_state(),
        "device_type": world.device_type,
        "device": mod.get_rng_state() if mod is not None else None,
    }


def _set_rng_state(state: dict, world: World) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    mod = device_module(world.device_type)
    if mod is not None and state["device"] is not None and state["device_type"] == world.device_type:
        mod.set_rng_state(state["device"])


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    policy: nn.Module,
    optim: OptimizerBundle,
    trainer_state: dict,
    world: World,
    save_limit: int,
    model_path: str,
    config: dict | None = None,
) -> Path:
    """Save a complete checkpoint of step `step`; collective (every rank calls it). Returns the final directory.

    `trainer_state` must be JSON-serialisable and should be the same on every rank (rank 0's copy is written).
    Keeps the newest `save_limit` complete checkpoints (`<= 0`: all); never deletes the one just written.
    `config`: the run's resolved config as plain data, saved as `config.yaml` with the checkpoint.
    """
    if "step" in trainer_state and trainer_state["step"] != step:
        raise ValueError(f"trainer_state['step']={trainer_state['step']} but saving step {step}")
    state = {**trainer_state, "step": step, "world_size": world.world_size, "model_path": model_path}
    state_json = json.dumps(state, indent=2, sort_keys=True)  # fails on every rank before any collective

    root = Path(run_dir) / CHECKPOINTS
    final = root / f"global_step_{step}"
    tmp = root / f"global_step_{step}.tmp"
    if world.is_main:
        if tmp.exists():  # left by a save of this step that was killed
            shutil.rmtree(tmp)
        (tmp / "rng").mkdir(parents=True)
    barrier()

    written = _write_files(tmp, policy, optim, world, config)
    entries = all_gather_objects(file_entries(tmp, written))  # also: every rank's files are on disk

    if world.is_main:
        write_manifest(tmp, {name: e for rank_entries in entries for name, e in rank_entries.items()})
        write_atomic(tmp / TRAINER_STATE, state_json)
        if final.exists():  # a complete checkpoint of the same step (e.g. a rerun): move it aside first
            stale = root / f"global_step_{step}.old.tmp"
            if stale.exists():
                shutil.rmtree(stale)
            os.replace(final, stale)
            os.replace(tmp, final)
            shutil.rmtree(stale)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
        write_atomic(root / LATEST, final.name)
        _prune(root, keep=final, save_limit=save_limit)
        log.info("saved checkpoint %s", final)
    barrier()
    return final


def _write_files(
    tmp: Path, policy: nn.Module, optim: OptimizerBundle, world: World, config: dict | None
) -> list[str]:
    """This rank's share of the checkpoint (DCP shards, RNG; rank 0: the scheduler and config too); returns
    the names it wrote, which it checksums for the manifest."""
    model_sd, optim_sd = _state_dicts(policy, optim)
    dcp.save(  # .metadata written last
        {"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp), no_dist=_alone(world)
    )
    written = [f"rng/rank{world.rank}.pt", *(p.name for p in tmp.glob(f"__{world.rank}_*.distcp"))]
    torch.save(_rng_state(world), tmp / written[0])
    if world.is_main:
        torch.save(optim.scheduler.state_dict(), tmp / SCHEDULER)
        written += [".metadata", SCHEDULER]
        if config is not None:
            (tmp / CONFIG).write_text(yaml.safe_dump(config, sort_keys=False))
            written.append(CONFIG)
    return written


def _alone(world: World) -> bool:
    """DCP's `no_dist` for a world of one: its plans and metadata are then not gathered through gloo. Gloo
    copies such a payload (here ~100 kB) on its own thread, which then keeps an OpenMP team of its own for the
    rest of the run; a 1-rank run of several threads slows down after its first save
    (`collectives.all_gather_objects` says how)."""
    return world.world_size == 1


def _prune(root: Path, keep: Path, save_limit: int) -> None:
    if save_limit <= 0:
        return
    complete = sorted(complete_checkpoints(root).items())
    excess = len(complete) - save_limit
    for _, path in complete:
        if excess <= 0:
            break
        if path != keep:
            _delete_checkpoint(path)
            log.info("deleted old checkpoint %s (save_limit=%d)", path, save_limit)
            excess -= 1


# ------------------------------------------------------------------------------------------------ load
def load_checkpoint(path: Path, *, policy: nn.Module, optim: OptimizerBundle, world: World) -> dict:
    """Load policy, optimizer, scheduler and (same world size only) RNG state in place; collective.

    Returns the saved trainer state (the caller's dict plus `step`, `world_size`, `model_path`).
    """
    path = Path(path)
    missing = missing_parts(path)
    if missing:
        raise ValueError(f"{path} is not a complete checkpoint: missing {', '.join(missing)}")
    state = json.loads((path / TRAINER_STATE).read_text())

    settings = [
        {k: v for k, v in g.items() if k not in ("params", "lr")} for g in optim.optimizer.param_groups
    ]
    base_lrs = list(optim.scheduler.base_lrs)
    options = _options(policy)
    model_sd, optim_sd = _state_dicts(policy, optim)
    to_load = {"model": model_sd, "optim": optim_sd}
    _check_keys(path, to_load)
    try:
        dcp.load(to_load, checkpoint_id=str(path), no_dist=_alone(world))
    except BaseException as e:  # DCP's CheckpointException is a BaseException; it names no file
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        file = _first_unreadable_file(path)
        where = f"{path / file} is unreadable" if file else "its DCP shards failed to load"
        raise UnreadableCheckpoint(f"{path}: {where} ({_dcp_failure(e)})") from None
    set_state_dict(
        policy,
        optim.optimizer,
        model_state_dict=to_load["model"],
        optim_state_dict=to_load["optim"],
        options=options,
    )
    optim.scheduler.load_state_dict(_load_data(path / SCHEDULER))
    _keep_settings(optim, settings, base_lrs)

    rng_file = path / "rng" / f"rank{world.rank}.pt"
    saved_world = state.get("world_size")
    if saved_world == world.world_size and rng_file.is_file():
        _set_rng_state(_load_data(rng_file), world)
    elif saved_world != world.world_size and world.is_main:
        why = f"it was saved at world size {saved_world}, this run has {world.world_size}"
        log.warning("RNG streams restart from the seed (not restored from %s): %s", path, why)
    elif saved_world == world.world_size:  # damaged_parts refuses this; said by the rank it concerns
        log.warning("rank %d: RNG streams restart from the seed: %s is missing", world.rank, rng_file)
    log.info("resumed from %s (step %s)", path, state.get("step"))
    return state


class UnreadableCheckpoint(ValueError):
    """A file of a complete checkpoint failed to load (named in the message): damage that no manifest
    showed (a checkpoint saved before manifests, whose bytes could not be verified)."""


def _dcp_failure(e: BaseException) -> str:
    """The first rank's error inside DCP's CheckpointException (whose own text only lists the ranks), with
    the shard files."""
    failures = getattr(e, "failures", None) or {}
    rank, inner = next(iter(failures.items()), (None, e))
    inner = inner[0] if isinstance(inner, tuple) else inner
    first = (str(inner).strip().splitlines() or [""])[0][:300]
    where = f"rank {rank}: " if rank is not None else ""
    return f"{where}{type(inner).__name__}: {first}"


def _first_unreadable_file(path: Path) -> str | None:
    """The DCP file of `path` that does not read back (the metadata; a shard missing, short, or holding an
    item that does not deserialise), which DCP's own error does not name. Reads every item once, so only
    after a load failed; None if every file reads (the failure was elsewhere)."""
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception:
        return ".metadata"
    items: dict[str, list] = {}
    for info in metadata.storage_data.values():
        items.setdefault(info.relative_path, []).append(info)
    for name, infos in sorted(items.items()):
        try:
            with (path / name).open("rb") as f:
                for info in infos:
                    f.seek(info.offset)
                    data = f.read(info.length)
                    if len(data) != info.length:
                        return name
                    if not getattr(info, "transform_descriptors", None):  # each item is a torch.save archive
                        torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        except Exception:
            return name
    return None


def load_or_fall_back(
    path: Path, *, policy: nn.Module, optim: OptimizerBundle, world: World, auto: bool
) -> dict:
    """`load_checkpoint(path)`; with `auto` (trainer.resume=auto), a checkpoint without a manifest whose file
    fails to load anyway (the failure names it) gives way to the previous complete checkpoint, as a damaged
    one found before the start does (`checkpoint_dirs.fallback_checkpoint`). Every rank fails alike (DCP's
    load and the scheduler file are shared; the RNG files were all loaded before the start), so every rank
    takes the same one."""
    while True:
        try:
            return load_checkpoint(path, policy=policy, optim=optim, world=world)
        except UnreadableCheckpoint as e:
            previous = fallback_checkpoint(path, e, rank=world.rank) if auto else None
            if previous is None:
                raise
            path = previous


def _state_dicts(policy: nn.Module, optim: OptimizerBundle) -> tuple[dict, dict]:
    """The policy's and the optimizer's sharded state dicts as a checkpoint holds them: with LoRA the
    adapters alone (the only trainable parameters). `ignore_frozen_params` keeps a tied output head, the
    frozen input embedding under a second name, which then read as full fine-tuning at resume and export."""
    model_sd, optim_sd = get_state_dict(policy, optim.optimizer, options=_options(policy))
    if has_adapters(policy):
        model_sd = {k: v for k, v in model_sd.items() if is_adapter_name(k)}
    return model_sd, optim_sd


def _options(policy: nn.Module) -> StateDictOptions:
    """With LoRA adapters only the trainable parameters are saved and loaded (the base is `model_path`, so
    the load is not strict about the frozen keys it leaves alone)."""
    lora = has_adapters(policy)
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def _keep_settings(optim: OptimizerBundle, settings: list[dict], base_lrs: list[float]) -> None:
    """Put back this run's optimizer settings and base lrs over the loaded ones, then set each group's lr to
    base lr x schedule(saved position), as the scheduler itself computes it."""
    for group, own in zip(optim.optimizer.param_groups, settings, strict=True):
        group.update(own)
    scheduler = optim.scheduler
    scheduler.base_lrs = base_lrs
    lrs = [base * f(scheduler.last_epoch) for base, f in zip(base_lrs, scheduler.lr_lambdas, strict=True)]
    for group, lr in zip(optim.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports (torch's load_state_dict sets it the same way)


def _load_data(file: Path):
    """`torch.load` that runs no code: only tensors and plain containers/numbers/strings are accepted, so a
    checkpoint file carrying a pickled object (which could run anything on load) is refused, naming it."""
    import pickle

    try:
        return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"{file}: refused to load (it holds more than tensors and plain data): {first}"
        ) from None
    except Exception as e:  # a torn archive: the file is named, not only the archive reader's complaint
        first = (str(e).strip().splitlines() or [""])[0]
        raise UnreadableCheckpoint(f"{file}: unreadable ({type(e).__name__}: {first})") from None


def _check_keys(path: Path, to_load: dict) -> None:
    """Fail with the names instead of DCP's error when the policy/optimizer does not match the checkpoint
    (e.g. a different model or `freeze_vision_tower` changed: the optimizer then holds other parameters;
    another size of the same family: DCP's size mismatch read as a damaged checkpoint)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(to_load)
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    missing = sorted(k for k in flat if k not in saved)
    if missing:
        raise ValueError(
            f"checkpoint {path} lacks {len(missing)} entries this policy/optimizer needs (was it saved with a "
            f"different model or freeze_vision_tower setting?), e.g. {missing[:5]}"
        )
    for key, value in flat.items():  # DTensor.shape is the global shape, as saved
        size = getattr(saved[key], "size", None)
        if isinstance(value, torch.Tensor) and size is not None and tuple(size) != tuple(value.shape):
            raise ValueError(
                f"checkpoint {path} holds {key} of shape {list(size)}, this policy's is {list(value.shape)}: "
                "it was saved from another model than worker.actor.model.model_path builds"
            )
