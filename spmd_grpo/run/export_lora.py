"""Export a LoRA checkpoint (adapters only, `worker.actor.model.lora`) as a PEFT adapter directory, and
optionally as a merged Hugging Face model.

    python -m spmd_grpo.export CHECKPOINT_DIR OUT_DIR [--dtype bfloat16] [--merged MERGED_DIR]

The adapter directory is what `peft.PeftModel.from_pretrained(base, OUT_DIR)` and vLLM's
`LoRARequest(name, id, OUT_DIR)` (with `enable_lora`) load:
  * `adapter_model.safetensors`: `base_model.model.<module>.lora_A.weight` / `.lora_B.weight` per adapted
    module, with the module names the model has in memory in transformers 5 (`model.language_model.layers.*`;
    PEFT's own key layout, which both loaders map);
  * `adapter_config.json`: written by PEFT's `LoraConfig.save_pretrained` from the run's saved config
    (rank, alpha, dropout) with the adapted modules listed by name, and `base_model_name_or_path` = the
    checkpoint's `model_path`.
The adapters are written in `--dtype` (the export's default, bfloat16, as the merged model; they are
trained and saved in float32, so `--dtype float32` keeps them exact; PEFT and vLLM cast on load).

`--merged DIR` also writes the base model with every adapter merged (`W + alpha / r * B @ A`, in fp32 from the
saved fp32 adapters, then cast to `--dtype` once: the merged weight push's computation, not one from adapters
already rounded to `--dtype`) under the base checkpoint's own file layout and names, one safetensors file at a
time (one file of the base in memory, never the whole model), plus its config and tokenizer/processor files.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata

from spmd_grpo.models.families import family_of_model_path
from spmd_grpo.models.lora import ADAPTER, is_adapter_name, write_peft_adapter
from spmd_grpo.models.weights import INDEX, hf_name, weight_files
from spmd_grpo.run.checkpoint_dirs import CONFIG

log = logging.getLogger(__name__)

MODEL_PREFIX = "model."  # the policy's DCP keys (checkpoint.py saves {"model": ..., "optim": ...})


def adapter_keys(ckpt: Path) -> dict[str, str]:
    """{DCP key: PEFT key} of every adapter tensor; empty for a full (non-LoRA) checkpoint. Other `model.*`
    entries beside adapters (the frozen tied output head that LoRA checkpoints of tied models held before
    checkpoint.py dropped it) are base weights: `model_path` has them."""
    metadata = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    keys = [
        k
        for k, md in metadata.items()
        if k.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata) and is_adapter_name(k)
    ]
    # hf.<module>.lora_A.default.weight -> base_model.model.<module>.lora_A.weight
    return {
        k: "base_model.model." + hf_name(k.removeprefix(MODEL_PREFIX)).replace(f".{ADAPTER}.", ".")
        for k in keys
    }


def _read(ckpt: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    metadata = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    buffers = {k: torch.empty(metadata[k].size, dtype=metadata[k].properties.dtype) for k in keys}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(buffers, storage_reader=FileSystemReader(str(ckpt)), no_dist=True)
    return buffers


def _lora_settings(ckpt: Path) -> dict:
    """The run's `worker.actor.model.lora` section, from the config saved with the checkpoint."""
    path = ckpt / CONFIG
    if not path.is_file():
        raise ValueError(f"{path} is missing: the adapter's rank and alpha are read from it")
    return yaml.safe_load(path.read_text())["worker"]["actor"]["model"]["lora"]


def export_adapter(
    ckpt: Path,
    out: Path,
    dtype: torch.dtype,
    *,
    model_path: str,
    src: Path,
    merged: Path | None = None,
    side_files: Callable[[Path], None] = lambda out: None,
) -> Path:
    """Write the PEFT adapter directory `out` (and the merged model at `merged`, whose config, tokenizer and
    processor files `side_files(merged)` writes); see the module docstring."""
    keys = adapter_keys(ckpt)
    trained = {keys[k]: t for k, t in _read(ckpt, list(keys)).items()}  # float32, as trained
    lora = _lora_settings(ckpt)
    modules = write_peft_adapter(
        {k: t.to(dtype).contiguous() for k, t in trained.items()},
        out,
        rank=lora["rank"],
        alpha=lora["alpha"],
        dropout=lora["dropout"],
        base_model=model_path,
    )
    log.info(
        "exported %d adapter tensors (%d modules, rank %d) -> %s",
        len(trained),
        len(modules),
        lora["rank"],
        out,
    )
    if merged is not None:
        scale = lora["alpha"] / lora["rank"]
        _write_merged(trained, scale, src, merged, dtype)
        side_files(merged)
    return out


def _write_merged(
    adapters: dict[str, torch.Tensor], scale: float, src: Path, out: Path, dtype: torch.dtype
) -> None:
    """The base checkpoint with `W + scale * B @ A` for each adapted weight, file by file, its own names."""
    family = family_of_model_path(str(src))
    on_disk = family.on_disk_name if family else (lambda n: n)
    deltas = {}  # on-disk weight name -> (A, B)
    for key, a in adapters.items():
        if ".lora_A." in key:
            module = key.removeprefix("base_model.model.").rsplit(".lora_A.", 1)[0]
            deltas[on_disk(module + ".weight")] = (a, adapters[key.replace(".lora_A.", ".lora_B.")])
    out.mkdir(parents=True, exist_ok=True)
    done = set()
    for file in weight_files(src):
        with safe_open(file, "pt") as st:
            tensors = {}
            for name in st.keys():  # noqa: SIM118 (safe_open is not iterable)
                t = st.get_tensor(name)
                if name in deltas:
                    a, b = deltas[name]
                    t = t.float() + scale * (b.float() @ a.float())
                    done.add(name)
                tensors[name] = t.to(dtype) if t.is_floating_point() else t
        save_file(tensors, str(out / file.name), metadata={"format": "pt"})
        del tensors
    missing = sorted(set(deltas) - done)
    if missing:
        raise ValueError(f"adapted weights not found in the base checkpoint {src}: {missing[:3]}")
    if (src / INDEX).is_file():
        shutil.copy2(src / INDEX, out / INDEX)
    log.info("merged %d adapted weights into %s", len(done), out)
