"""The training half of the hybrid engine: forward passes and the policy update.

    spec.py            `UpdateSpec`: everything the update needs, derived once from the config
    micro_batches.py   micro-batches by count or token budget, padded or packed; the same count on every rank
    gathering.py       when FSDP gathers parameters in a pass: per micro-batch, or once per pass on the CPU
    image_features.py  encode each prompt's images once and reuse the features for all its samples
    routes.py          MoE routing replay between the passes: the routes each pass compares with or replays
    logprob_pass.py    forward-only logprobs (old policy, reference)
    update.py          PPO mini-batch steps: loss per micro-batch on global counts, clipping, optimizer step
    optimizer.py       AdamW, the LR schedule, gradient clipping

The names below are imported on first use, so importing one module of the package stays light.
"""

from spmd_grpo import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "gathering": (
            "gathers_once_per_pass",
            "gathered_for_pass",
            "accumulate_unsharded",
            "end_accumulation",
        ),
        "image_features": (
            "encode_images",
            "attach_image_features",
        ),
        "logprob_pass": ("compute_logprobs", "compute_ref_logprobs"),
        "routes": ("batch_routes", "attach_routes", "keep_recorded"),
        "micro_batches": (
            "collate_samples",
            "uses_packing",
            "collate_for",
            "pad_rows",
            "balanced_partitions",
            "length_sorted_partitions",
            "padded_part_count",
            "micro_batches",
        ),
        "optimizer": (
            "OptimizerBundle",
            "build_optimizer",
            "clip_grad_norm",
        ),
        "spec": ("UpdateSpec",),
        "update": (
            "padded_correction",
            "mini_batch_backward",
            "update_policy",
            "correction_metrics",
        ),
    },
)
