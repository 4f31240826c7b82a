"""Export a training checkpoint as a Hugging Face model directory (transformers / vLLM load it directly).

    python -m spmd_grpo.export CHECKPOINT_DIR OUT_DIR [--dtype bfloat16] [--model-path DIR] [--shard-size-mb 2048]
                               [--merged MERGED_DIR] [--tokenizer-path DIR]

A LoRA checkpoint (adapters only) is written as a PEFT adapter directory instead, and with `--merged` also
as the merged HF model (run/export_lora.py).

Single process, no process group: DCP's no-dist load path. The export streams: the tensors are grouped into
shards of at most `--shard-size-mb` (in the output dtype) from the DCP metadata alone, and each shard is read
(only its own byte ranges), cast, written as `model-0000k-of-0000n.safetensors` and freed before the next one,
so memory holds one shard, never the whole model. One shard is written as `model.safetensors`; more get a
`model.safetensors.index.json`.

What is written:
  * the policy's parameters under their HF names (`spmd_grpo.models.weights.hf_name`: no `hf.` prefix, no
    activation-checkpoint wrapper names). When the source checkpoint uses its family's on-disk names
    (Qwen2-VL / Qwen2.5-VL: `model.layers.*`, `visual.*`, what `save_pretrained` writes), the same names are
    used, so every tool that read the source reads the export; otherwise the in-memory names
    (`model.language_model.*`, what Qwen3-VL checkpoints hold).
  * the fused expert tensors of an MoE model in the layout the published checkpoints and vLLM use
    (`Family.hub_tensors`: Qwen3-VL-MoE's transposed, Qwen3.5-MoE's one tensor per expert).
  * no `lm_head.weight` when the config ties word embeddings (transformers and vLLM re-tie it).
  * no optimizer state (DCP keys under `optim.`).
  * `config.json` (its dtype set to the export dtype), `generation_config.json` and the tokenizer/processor
    files, copied from `model_path` as recorded in the checkpoint's trainer_state.json (or `--model-path`);
    with a `worker.actor.model.tokenizer_path` in the checkpoint's config.yaml (or `--tokenizer-path`), its
    tokenizer, processor and chat template files replace the base model's: they are what the run trained with.

OUT_DIR may hold a previous export: its weight files, model or adapter (transformers' `from_pretrained` of a
directory holding both applies the adapter on top of those weights), are removed, anything else is left.
The base model's own directory is refused as OUT_DIR or `--merged`, and so is one directory for both the
adapter and the merged model.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata

from spmd_grpo.models.families import family_of_model_path
from spmd_grpo.models.lora import ADAPTER_CONFIG, ADAPTER_FILE
from spmd_grpo.models.weights import INDEX, hf_name
from spmd_grpo.parallel.devices import DTYPES
from spmd_grpo.run.checkpoint_dirs import CONFIG, TRAINER_STATE, missing_parts
from spmd_grpo.run.export_lora import MODEL_PREFIX, adapter_keys, export_adapter

log = logging.getLogger(__name__)

# Everything a model directory needs besides its weights (configs, tokenizer, processor, chat template, code).
SIDE_FILE_SUFFIXES = {".json", ".txt", ".jinja", ".model", ".tiktoken", ".py"}
NOT_COPIED = {INDEX, "pytorch_model.bin.index.json", TRAINER_STATE}
MODEL_FILES = {"config.json", "generation_config.json"}  # the model's, never a tokenizer directory's


def _source_dir(
    model_path: str, key: str = "model_path", flag: str = "--model-path", *, weights: bool = False
) -> Path:
    """Local directory of the base model: `model_path` itself, or its hub snapshot (configs/tokenizer only;
    with `weights`, its safetensors too: a merge reads the base weights)."""
    if Path(model_path).is_dir():
        return Path(model_path)
    try:
        from huggingface_hub import snapshot_download

        patterns = [f"*{s}" for s in SIDE_FILE_SUFFIXES] + (["*.safetensors"] if weights else [])
        return Path(snapshot_download(model_path, allow_patterns=patterns))
    except Exception as e:
        raise ValueError(
            f"{key} {model_path!r} is not a directory and could not be fetched from the hub ({e}); "
            f"pass {flag} with its directory"
        ) from e


def _source_weight_names(src: Path) -> set[str] | None:
    """Tensor names of the base model's safetensors checkpoint (headers only), or None if it has none."""
    if (src / INDEX).is_file():
        return set(json.loads((src / INDEX).read_text())["weight_map"])
    files = sorted(src.glob("model*.safetensors"))
    if not files:
        return None
    names: set[str] = set()
    for f in files:
        with safe_open(f, "pt") as st:
            names.update(st.keys())
    return names


def _match_source_naming(names: dict[str, torch.Size], source: set[str] | None, src: Path) -> list[str]:
    """The in-memory names (`names`: name -> shape) if the base checkpoint uses them (Qwen3-VL), else the
    family's on-disk names; compared as written, after the family's expert layout (Qwen3.5-MoE's fused
    experts become one tensor per expert)."""
    family = family_of_model_path(str(src))

    def written(rename) -> set[str]:
        if family is None:
            return {rename(n) for n in names}
        meta = {n: torch.empty(size, device="meta") for n, size in names.items()}
        return {h for n, t in meta.items() for h, _ in family.hub_tensors(rename(n), t)}

    if source is None or written(lambda n: n) <= source:
        return list(names)
    if family is not None and written(family.on_disk_name) <= source:
        return [family.on_disk_name(n) for n in names]
    log.warning("parameter names match neither naming of the base checkpoint; writing in-memory names")
    return list(names)


def _plan_shards(
    entries: list[tuple[str, str, TensorStorageMetadata]], dtype: torch.dtype, shard_bytes: int
) -> list[list[tuple[str, str, TensorStorageMetadata]]]:
    """Consecutive groups of (dcp_key, name, metadata) of at most shard_bytes (a larger tensor: alone)."""
    shards: list[list] = [[]]
    size = 0
    for entry in entries:
        nbytes = _out_nbytes(entry[2], dtype)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return [s for s in shards if s]


def _out_dtype(saved: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    return dtype if saved.is_floating_point else saved


def _out_nbytes(md: TensorStorageMetadata, dtype: torch.dtype) -> int:
    return md.size.numel() * _out_dtype(md.properties.dtype, dtype).itemsize


def _write_config(src: Path, out: Path, dtype_name: str) -> None:
    """config.json with its dtype fields set to the export dtype (vLLM's `dtype="auto"` reads them)."""
    cfg = json.loads((src / "config.json").read_text())
    cfg["dtype"] = dtype_name  # transformers 5 reads `dtype`, older releases `torch_dtype`
    for section in [cfg] + [v for v in cfg.values() if isinstance(v, dict)]:  # text_config, vision_config
        for key in ("dtype", "torch_dtype"):
            if section.get(key) is not None:
                section[key] = dtype_name
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def export_hf(
    checkpoint_dir: Path | str,
    out_dir: Path | str,
    dtype: str = "bfloat16",
    *,
    model_path: str | None = None,
    shard_size_mb: int = 2048,
    merged: Path | str | None = None,
    tokenizer_path: str | None = None,
) -> Path:
    """Write the checkpoint's policy as an HF model directory at `out_dir` (see the module docstring); a LoRA
    checkpoint as a PEFT adapter directory (and the merged model at `merged`)."""
    from transformers import AutoConfig

    ckpt, out = Path(checkpoint_dir), Path(out_dir)
    model_path = _check_request(ckpt, dtype, shard_size_mb, model_path=model_path)
    src = _source_dir(model_path, weights=merged is not None)
    tokenizer_path = tokenizer_path or _saved_tokenizer_path(ckpt)
    tokenizer = _source_dir(tokenizer_path, "tokenizer_path", "--tokenizer-path") if tokenizer_path else None
    merged = Path(merged) if merged is not None else None
    _check_outputs(out, merged, src)
    if adapter_keys(ckpt):
        _remove_stale_weights(out)  # a full export's weights there would load with the adapter on top
        if merged is not None:
            _remove_stale_weights(merged)
        return export_adapter(
            ckpt,
            out,
            DTYPES[dtype],
            model_path=model_path,
            src=src,
            merged=merged,
            side_files=lambda d: (_copy_side_files(src, d, tokenizer), _write_config(src, d, dtype)),
        )
    if merged is not None:
        raise ValueError(f"--merged is for LoRA checkpoints; {ckpt} holds the whole policy already")
    tie = bool(getattr(AutoConfig.from_pretrained(src), "tie_word_embeddings", False))
    torch_dtype = DTYPES[dtype]
    shards = _plan_shards(_model_entries(ckpt, src, tie=tie), torch_dtype, shard_size_mb << 20)

    out.mkdir(parents=True, exist_ok=True)
    _remove_stale_weights(out)
    family = family_of_model_path(str(src))
    layout = family.hub_tensors if family is not None else (lambda name, t: [(name, t)])
    weight_map, total_size = _write_shards(ckpt, out, shards, torch_dtype, layout)
    _copy_side_files(src, out, tokenizer)
    _write_config(src, out, dtype)
    log.info(
        "exported %s -> %s: %d tensors, %.1f MB in %d file(s), %s%s",
        ckpt,
        out,
        len(weight_map),
        total_size / 2**20,
        len(shards),
        dtype,
        " (lm_head tied)" if tie else "",
    )
    return out


def _check_request(ckpt: Path, dtype: str, shard_size_mb: int, *, model_path: str | None) -> str:
    """Check the export's arguments and the checkpoint; return the base model's path (given or recorded)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if shard_size_mb <= 0:
        raise ValueError(f"shard_size_mb must be positive, got {shard_size_mb}")
    missing = missing_parts(ckpt)
    if missing:
        raise ValueError(f"{ckpt} is not a complete checkpoint: missing {', '.join(missing)}")
    trainer_state = json.loads((ckpt / TRAINER_STATE).read_text())
    model_path = model_path or trainer_state.get("model_path")
    if not model_path:
        raise ValueError(f"{ckpt / TRAINER_STATE} records no model_path: pass --model-path")
    return model_path


def _model_entries(ckpt: Path, src: Path, *, tie: bool) -> list[tuple[str, str, TensorStorageMetadata]]:
    """(DCP key, output name, metadata) of every policy tensor to write, from the DCP metadata alone."""
    metadata = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    keys = [
        k
        for k, md in metadata.items()
        if k.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata)
    ]
    named = {hf_name(k.removeprefix(MODEL_PREFIX)): k for k in keys}  # HF name -> DCP key
    assert len(named) == len(keys), "two checkpoint entries map to one HF name"
    if tie:
        named.pop("lm_head.weight", None)  # re-tied to the embeddings on load
    sizes = {n: metadata[k].size for n, k in named.items()}
    names = _match_source_naming(sizes, _source_weight_names(src), src)
    entries = [(k, n, metadata[k]) for k, n in zip(named.values(), names, strict=True)]
    if not entries:
        raise ValueError(f"{ckpt} holds no model tensors (DCP keys starting with {MODEL_PREFIX!r})")
    return entries


def _check_outputs(out: Path, merged: Path | None, src: Path) -> None:
    """Refuse output directories whose writing would destroy the base model or give a model that loads wrong."""
    for flag, d in (("OUT_DIR", out), ("--merged", merged)):
        if d is not None and d.resolve() == src.resolve():
            raise ValueError(
                f"{flag} {d} is the base model directory: the export would overwrite its weights"
            )
    if merged is not None and merged.resolve() == out.resolve():
        raise ValueError(
            f"--merged {merged} is OUT_DIR: transformers would apply the adapter written there to the merged "
            "weights a second time"
        )


def _remove_stale_weights(out: Path) -> None:
    """Delete weight files (and an index) a previous export left in `out`: they would mix with the new ones. A
    previous adapter export's files too: transformers' `from_pretrained` applies an adapter it finds in the
    model's directory on top of the weights."""
    stale = sorted(out.glob("model*.safetensors")) + sorted(out.glob(INDEX))
    stale += [out / name for name in (ADAPTER_FILE, ADAPTER_CONFIG) if (out / name).is_file()]
    if stale:
        log.warning("replacing the weights already in %s: %s", out, [p.name for p in stale])
        for p in stale:
            p.unlink()


def _write_shards(
    ckpt: Path,
    out: Path,
    shards: list[list[tuple[str, str, TensorStorageMetadata]]],
    dtype: torch.dtype,
    layout,
) -> tuple[dict[str, str], int]:
    """Read, cast, lay out (`layout(name, tensor)`: the pairs to write) and write one shard at a time (plus
    the index if more than one); (weight_map, total bytes)."""
    weight_map, total_size = {}, 0
    for i, shard in enumerate(shards):
        fname = (
            "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        buffers = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, _, md in shard}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(buffers, storage_reader=FileSystemReader(str(ckpt)), no_dist=True)
        tensors = {
            name: t.contiguous()
            for k, n, md in shard
            for name, t in layout(n, buffers.pop(k).to(_out_dtype(md.properties.dtype, dtype)))
        }
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for n, t in tensors.items():
            weight_map[n] = fname
            total_size += t.numel() * t.element_size()
        del buffers, tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return weight_map, total_size


def _copy_side_files(src: Path, out: Path, tokenizer: Path | None = None) -> None:
    """Copy the base model's configs, tokenizer and processor files (config.json is rewritten separately),
    then the tokenizer and processor files of the run's `tokenizer_path` over them (the ones it trained with)."""
    sources = [(src, SIDE_FILE_SUFFIXES, NOT_COPIED | {"config.json"})]
    if tokenizer is not None:  # neither code nor the model's configs from a tokenizer directory
        sources.append((tokenizer, SIDE_FILE_SUFFIXES - {".py"}, NOT_COPIED | MODEL_FILES))
    for directory, suffixes, skipped in sources:
        for f in sorted(directory.iterdir()):
            if f.is_file() and f.suffix in suffixes and f.name not in skipped:
                shutil.copy2(f, out / f.name)


def _saved_tokenizer_path(ckpt: Path) -> str | None:
    """The run's `worker.actor.model.tokenizer_path`, from the config saved with the checkpoint."""
    if not (ckpt / CONFIG).is_file():
        return None
    saved = yaml.safe_load((ckpt / CONFIG).read_text()) or {}
    return saved.get("worker", {}).get("actor", {}).get("model", {}).get("tokenizer_path")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m spmd_grpo.export", description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint_dir", type=Path, help="a complete checkpoints/global_step_N directory")
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--model-path", default=None, help="base model directory (default: the one recorded)")
    ap.add_argument(
        "--tokenizer-path",
        default=None,
        help="tokenizer/processor directory (default: the run's, if it set one)",
    )
    ap.add_argument("--shard-size-mb", type=int, default=2048, help="largest safetensors file (MB)")
    ap.add_argument(
        "--merged", type=Path, default=None, help="LoRA checkpoints: also write the merged model here"
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        out = export_hf(
            args.checkpoint_dir,
            args.out_dir,
            args.dtype,
            model_path=args.model_path,
            shard_size_mb=args.shard_size_mb,
            merged=args.merged,
            tokenizer_path=args.tokenizer_path,
        )
    except ValueError as e:
        print(f"export error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(out)


if __name__ == "__main__":
    main()
