"""The training half of the hybrid engine: forward passes and the policy update.

    spec.py            `UpdateSpec`: everything the update needs, derived once from the config
    micro_batches.py   micro-batches by count or token budget, padded or packed; the same count on every rank
    gathering.py       when FSDP gathers parameters in a pass: per micro-batch, or once per pass on the CPU
    image_features.py  encode each prompt's images once and reuse the features for all its samples
    routes.py          MoE routing replay between the passes: the routes each pass compares with or replays
    logprob_pass.py    forward-only logprobs (old policy, reference)
    update.py          PPO mini-batch steps: loss per micro-batch on global counts, clipping, optimizer step
    optimizer.py       AdamW, the LR schedule, gradient clipping

Import each name from the module that defines it: this package re-exports nothing.
"""
