"""The RL math: pure functions of tensors and masks (no collectives, no models).

    advantage.py   GRPO / Dr.GRPO / batch-std advantages, DAPO's group-spread filter
    loss.py        PPO clip, dual clip, GSPO; KL penalties; loss aggregation on global counts
    correction.py  rollout correction: truncated importance weights and rejection (pi_old vs pi_rollout)
    reward.py      the batch reward interface, the geometry3k math reward, user reward files, DAPO overlong

Import each name from the module that defines it: this package re-exports nothing.
"""
