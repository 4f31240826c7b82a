"""The fused expert tensors of an MoE checkpoint, read into transformers' layout whatever layout the file holds.

Shapes: E experts, H hidden size, I expert MLP width.

transformers 5.x holds an MoE layer's experts as two stacked parameters, `experts.gate_up_proj` [E, 2I, H]
(gate rows, then up rows) and `experts.down_proj` [E, H, I]. Checkpoints hold one of three layouts:

  * the same tensors (what transformers' `save_pretrained` writes for Qwen3-VL-MoE: its memory layout);
  * the same names transposed, [E, H, 2I] and [E, I, H] (the published Qwen3-VL-MoE checkpoints; vLLM reads
    only this for that family);
  * one tensor per expert, `experts.{e}.gate_proj.weight` [I, H], `.up_proj.weight` [I, H],
    `.down_proj.weight` [H, I] (the published Qwen3.5-MoE checkpoints; `save_pretrained` writes it too).

`checkpoint_views` rewrites a state dict (on-disk names -> sharded tensors) so that DCP reads each layout
straight into the rank's own experts: a transposed tensor through a buffer of the rank's experts in the
file's layout (copied back transposed after the load), per-expert tensors through views into the rank's
rows of the stacked parameter (FSDP2 shards dim 0, the expert index, so a rank reads only its experts).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

Finish = Callable[[], None]


def _local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the rank's local tensor, global index of its first dim-0 row)."""
    if not isinstance(tensor, DTensor):
        return tensor, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tensor.to_local(), offset[0]


def _transposed_buffer(key: str, tensor: torch.Tensor) -> tuple[torch.Tensor, Finish]:
    """A tensor of the file's (transposed) shape covering the same experts as `tensor`, and the copy back."""
    local, _ = _local_rows(tensor)
    buf = torch.empty(local.transpose(-1, -2).shape, dtype=local.dtype, device=local.device)
    if isinstance(tensor, DTensor):
        shape = torch.Size((*tensor.shape[:-2], tensor.shape[-1], tensor.shape[-2]))
        stride = torch.empty(shape, device="meta").stride()
        target = DTensor.from_local(
            buf, tensor.device_mesh, tensor.placements, run_check=False, shape=shape, stride=stride
        )
    else:
        target = buf

    def finish() -> None:
        local.copy_(buf.transpose(-1, -2))

    return target, finish


def _per_expert_views(key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """{per-expert on-disk name: view into the rank's rows of the stacked parameter `key`}."""
    local, first = _local_rows(tensor)
    prefix, weight = key.rsplit(".", 1)
    views = {}
    for j in range(local.shape[0]):
        e = first + j
        if weight == "gate_up_proj":
            inter = local.shape[1] // 2
            views[f"{prefix}.{e}.gate_proj.weight"] = local[j, :inter]
            views[f"{prefix}.{e}.up_proj.weight"] = local[j, inter:]
        else:
            views[f"{prefix}.{e}.down_proj.weight"] = local[j]
    return views


def checkpoint_views(
    state: dict[str, torch.Tensor],
    on_disk: dict[str, tuple[int, ...]],
    is_fused_expert: Callable[[str], bool],
) -> tuple[dict[str, torch.Tensor], list[Finish]]:
    """`state` ({on-disk name: tensor}) with each fused expert tensor replaced by what DCP should fill from a
    file whose tensors are `on_disk` ({name: shape}), and the copies to run after the load. A fused tensor
    found with its own shape is left alone; anything else not found is left for the caller's missing-tensor
    error."""
    out: dict[str, torch.Tensor] = {}
    finish: list[Finish] = []
    for key, tensor in state.items():
        shape = tuple(tensor.shape)
        if not is_fused_expert(key) or on_disk.get(key) == shape:
            out[key] = tensor
        elif on_disk.get(key) == (*shape[:-2], shape[-1], shape[-2]):
            out[key], copy_back = _transposed_buffer(key, tensor)
            finish.append(copy_back)
        elif key not in on_disk and f"{key.rsplit('.', 1)[0]}.0.down_proj.weight" in on_disk:
            out.update(_per_expert_views(key, tensor))
        else:
            out[key] = tensor
    return out, finish
