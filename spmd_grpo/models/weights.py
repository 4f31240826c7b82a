"""Fill a sharded model from a Hugging Face safetensors directory: every rank reads only its own rows.

Mechanism: `torch.distributed.checkpoint` (DCP) plans the load from the model's own state dict (FSDP2
DTensor shards, keys mapped to the on-disk names), and `HuggingFaceStorageReader` supplies the checkpoint's
metadata (tensor names, shapes, dtypes from the safetensors headers, `model.safetensors` or the shards of a
sharded checkpoint). DCP hands each rank read requests for exactly the slice its shard covers and copies into
the shard, casting to the shard's dtype (a bf16 file fills fp32 master weights; an fp32 file fills a bf16
model). Why this and not the alternatives:

  * `set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)` needs the full state dict
    on rank 0 (the whole model in host memory on one rank, then one broadcast per tensor to every rank), and
    on a model still on the meta device it assigns the file's tensors (the parameters take the file's dtype,
    the buffers stay on meta). Its cost grows with the model on rank 0; DCP's does not.
  * hand-written per-rank safetensors slicing would re-implement DCP's planning (which rows a rank owns,
    uneven last shards, several files).

`SliceReader` overrides only the reading. The stock reader opens each file with `safe_open`, i.e. maps it:
every page a rank touches stays in its resident set until the file is closed, so loading a model's file
added one more copy of the rank's share of it on top of the shards (measured with benchmarks/load_memory.py
on a 211M-parameter fp32 checkpoint, policy fp32 + reference bf16: peak RSS 2.52 x the fp32 model at world
1 and 1.28 x at world 2 with the stock reader, 1.54 x and 0.78 x with this one; the shards are 1.50 x and
0.75 x). `SliceReader` reads each request with positioned
reads (`os.preadv`) of the rows it covers into a buffer of at most that slice (or straight into the shard
when dtype and layout match), so the transient beyond a rank's shards is one slice of one tensor. Bytes are
read in the file's byte order, little-endian (the safetensors format), on a little-endian host.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.futures import Future

from spmd_grpo.models.expert_layout import checkpoint_views

INDEX = "model.safetensors.index.json"
# safetensors dtype names -> torch dtypes (the ones model checkpoints use).
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory: those its index names, else every `*.safetensors`."""
    index = model_dir / INDEX
    if index.is_file():
        files = sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names files that are not in {model_dir}: {missing}")
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {model_dir}: only safetensors checkpoints are read "
            "(convert .bin files first)"
        )
    return files


def _read_header(f) -> tuple[dict, int]:
    """(header {name: {dtype, shape, data_offsets}}, byte offset where the tensor data starts)."""
    size = int.from_bytes(os.pread(f.fileno(), 8, 0), "little")  # u64 header length
    header = json.loads(os.pread(f.fileno(), size, 8))
    header.pop("__metadata__", None)
    return header, 8 + size


def _pread_into(f, tensor: torch.Tensor, offset: int) -> None:
    """Fill the contiguous CPU `tensor` with its byte size from the file at `offset`."""
    view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        n = os.preadv(f.fileno(), [view[done:]], offset + done)
        if n <= 0:
            raise EOFError(f"file ends at byte {offset + done}, inside a tensor")
        done += n


def _read_rows(f, entry: dict, data_start: int, rows: tuple[int, int], out: torch.Tensor | None):
    """Rows [begin, begin + count) (dim 0; the whole tensor if 0-d) of a tensor, into `out` if given."""
    dtype, shape = SAFETENSORS_DTYPES[entry["dtype"]], entry["shape"]
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    if out is None:
        out = torch.empty((rows[1], *shape[1:]) if shape else (), dtype=dtype)
    if out.numel():
        _pread_into(f, out, data_start + entry["data_offsets"][0] + rows[0] * row_bytes)
    return out


def _direct(target: torch.Tensor, dtype: torch.dtype, rows_only: bool) -> bool:
    """Whether a request can be read straight into its target (no buffer)."""
    return rows_only and target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()


class SliceReader(HuggingFaceStorageReader):
    """`HuggingFaceStorageReader` whose reads are positioned reads of a request's rows (see module doc)."""

    def read_data(self, plan, planner) -> Future:
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for path, items in per_file.items():
            with open(path, "rb", buffering=0) as f:
                header, data_start = _read_header(f)
                for item in items:
                    try:
                        self._read_item(f, header[item.storage_index.fqn], data_start, item, planner)
                    except Exception as e:
                        raise ValueError(f"reading {item.storage_index.fqn} from {path}: {e}") from e
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @staticmethod
    def _read_item(f, entry: dict, data_start: int, item, planner) -> None:
        offsets, lengths = list(item.storage_offsets), list(item.lengths)
        shape = entry["shape"]
        rows = (offsets[0], lengths[0]) if shape else (0, 1)
        rows_only = all(
            o == 0 and n == s for o, n, s in zip(offsets[1:], lengths[1:], shape[1:], strict=True)
        )
        target = planner.resolve_tensor(item).detach()
        if _direct(target, SAFETENSORS_DTYPES[entry["dtype"]], rows_only):
            _read_rows(f, entry, data_start, rows, target)
        else:
            buf = _read_rows(f, entry, data_start, rows, None)
            piece = buf[
                (slice(None), *(slice(o, o + n) for o, n in zip(offsets[1:], lengths[1:], strict=True)))
            ]
            if piece.shape != target.shape:
                raise ValueError(f"slice {tuple(piece.shape)} does not fit its shard {tuple(target.shape)}")
            target.copy_(piece)
            del buf, piece
        planner.commit_tensor(item, target)


def _read_metadata(reader: SliceReader, model_dir: Path) -> dict:
    """The checkpoint's {on-disk name: tensor metadata}; a broken file is an error naming it."""
    try:
        return reader.read_metadata().state_dict_metadata
    except Exception as e:
        from safetensors import safe_open

        for path in weight_files(model_dir):
            try:
                with safe_open(path, framework="pt"):
                    pass
            except Exception as file_error:
                raise ValueError(f"cannot read the safetensors file {path}: {file_error}") from e
        raise ValueError(f"cannot read the safetensors headers in {model_dir}: {e}") from e


def _check_against_checkpoint(state: Mapping[str, torch.Tensor], metadata: dict, model_dir: Path) -> None:
    """Every tensor the model needs is in the checkpoint with the model's shape; else a one-line error."""
    missing = [k for k in state if k not in metadata]
    if missing:
        raise ValueError(
            f"{len(missing)} tensor(s) of the model are in no *.safetensors file of {model_dir}, "
            f"e.g. {missing[:3]} (on-disk names)"
        )
    for key, tensor in state.items():
        if tuple(metadata[key].size) != tuple(tensor.shape):
            raise ValueError(
                f"{key} in {model_dir} has shape {list(metadata[key].size)} but the model built from its "
                f"config.json has {list(tensor.shape)}"
            )


def load_safetensors_into(
    state: Mapping[str, torch.Tensor],
    model_dir: Path,
    *,
    name_map: Callable[[str], str] = lambda name: name,
    is_fused_expert: Callable[[str], bool] | None = None,
) -> None:
    """Fill `state` ({in-memory name: tensor or DTensor shard}, e.g. a sharded module's `state_dict()`) from
    the safetensors in `model_dir`, in place. Collective: every rank of the default group calls it together.

    Keys are mapped with `name_map` (the model family's `on_disk_name`: in-memory -> checkpoint name); leave out keys the checkpoint does not hold (a tied `lm_head`).
    Errors name the file and the tensor: a missing tensor or a wrong shape is found from the headers before
    any read. `is_fused_expert` (an MoE family's): those tensors are read from whichever expert layout the
    file holds (`expert_layout.checkpoint_views`). A failed read comes out of DCP as a `CheckpointException` (a BaseException, which `except
    Exception` would not catch) and is re-raised as a RuntimeError with the first rank's message.
    """
    weight_files(model_dir)  # a clear error for a directory without safetensors or with a broken index
    state = {name_map(k): v for k, v in state.items()}
    reader = SliceReader(str(model_dir))
    metadata = _read_metadata(reader, model_dir)
    finish = []
    if is_fused_expert is not None:
        on_disk = {k: tuple(md.size) for k, md in metadata.items()}
        state, finish = checkpoint_views(state, on_disk, is_fused_expert)
    _check_against_checkpoint(state, metadata, model_dir)
    try:
        dcp.load(state, storage_reader=reader)
    except CheckpointException as e:
        rank, (exc, _trace) = next(iter(sorted(e.failures.items(), key=lambda kv: kv[0])))
        raise RuntimeError(f"loading weights from {model_dir} failed on rank {rank}: {exc}") from e
    for copy_back in finish:
        copy_back()


def hf_name(fsdp_name: str) -> str:
    """Parameter name as in the HF checkpoint (drops activation-checkpoint / compile wrapper prefixes and
    PEFT's `base_layer.` of a LoRA-wrapped linear layer)."""
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.", "base_layer."):
        fsdp_name = fsdp_name.replace(wrapper, "")
    return fsdp_name.removeprefix("hf.")  # PolicyModule's attribute
