"""A workaround for vLLM CPU's weight reload of unquantized fused-MoE layers (vLLM 0.32).

A weight push calls `reload_weights(is_checkpoint_format=True)`, vLLM's layerwise reload: each layer is put
back into its checkpoint shapes, loaded, and re-processed by its quant method's
`process_weights_after_loading`, and the result is copied into the layer's existing (kernel) tensors. For
unquantized fused MoE that is `UnquantizedFusedMoEMethod.process_weights_after_loading` -> `_setup_kernel`,
which on a weight update (`moe_kernel` already built) copies the weights in but does NOT call
`moe_kernel.fused_experts.process_weights_after_loading(layer)` again; only the first load does. On the CPU
that call (`CPUUnquantizedExperts.process_weights_after_loading`, also its AMX / NEON / VSX subclasses)
zero-pads the expert MLP width to a multiple of 32 and prepacks both weights into the CPU grouped-GEMM
layout. So after a push the CPU kernel reads plain weights as if they were packed: for a width that is a
multiple of 32 the logprobs are silently wrong (fp32 Qwen3-VL-MoE: 4.8e-7 against transformers loaded from
file, 6.0e-2 after pushing the checkpoint's own tensors); for another width the copy-back fails on shape.

`repack_cpu_experts_on_reload(model)` wraps, per layer, the quant method's `process_weights_after_loading`
so that a weight update runs the experts' step too, inside the layerwise reload, before the copy-back. That
places the fix where the first load does the same thing, so
  - only layers actually reloaded in this push are packed (a partial push, e.g. LoRA skipping the frozen
    experts, leaves the others' packed weights as they are: repacking after the push would pack them twice);
  - the padded shape is produced before the copy into the (padded) kernel tensors.
It touches only layers whose experts are `CPUUnquantizedExperts` (zentorch's variant returns before packing,
as on the first load), skips weights vLLM marks as already processed (`is_checkpoint_format=False`), and
wraps a layer once however often it is called. Nothing else in vLLM changes.
"""

from __future__ import annotations

from torch import nn

_WRAPPED = "_spmd_grpo_repacks_cpu_experts"  # marks a quant method already wrapped


def repack_cpu_experts_on_reload(model: nn.Module) -> int:
    """Make every CPU unquantized fused-MoE layer of vLLM `model` re-pack its experts on a weight reload.

    Returns the number of such layers (0 for a dense model or a non-CPU kernel: nothing is changed)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    count = 0
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        if not isinstance(method, UnquantizedFusedMoEMethod) or method.moe_kernel is None:
            continue
        if not isinstance(method.moe_kernel.fused_experts, CPUUnquantizedExperts):
            continue
        count += 1
        if not getattr(method, _WRAPPED, False):
            method.process_weights_after_loading = _repacking(method)
            setattr(method, _WRAPPED, True)
    return count


def _repacking(method):
    """`method.process_weights_after_loading`, followed on a weight update by the experts' pad + prepack."""
    from vllm.model_executor.utils import is_weights_pre_processed

    original = method.process_weights_after_loading  # the bound method of the class

    def process_weights_after_loading(layer: nn.Module) -> None:
        update = method.moe_kernel is not None and not is_weights_pre_processed()
        original(layer)
        if update:  # what `_setup_kernel` does on the first load only
            method.moe_kernel.fused_experts.process_weights_after_loading(layer)

    return process_weights_after_loading


def repack_on_worker(worker) -> int:
    """`repack_cpu_experts_on_reload` on a vLLM worker's model (for `LLM.collective_rpc`)."""
    return repack_cpu_experts_on_reload(worker.get_model())
