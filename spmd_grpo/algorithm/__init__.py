"""The RL math: pure functions of tensors and masks (no collectives, no models).

    advantage.py   GRPO / Dr.GRPO / batch-std advantages, DAPO's group-spread filter
    loss.py        PPO clip, dual clip, GSPO; KL penalties; loss aggregation on global counts
    correction.py  rollout correction: truncated importance weights and rejection (pi_old vs pi_rollout)
    reward.py      the batch reward interface, the geometry3k math reward, user reward files, DAPO overlong

The names below are imported on first use, so importing one module of the package stays light.
"""

from spmd_grpo import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "advantage": (
            "AllReduceSum",
            "compute_grpo_advantages",
            "compute_batch_std_advantages",
            "group_has_spread",
        ),
        "correction": (
            "IS_LEVELS",
            "RS_LEVELS",
            "SAFETY_BOUND",
            "MetricSums",
            "CorrectionSpec",
            "Correction",
            "rollout_correction",
        ),
        "loss": (
            "AGG_MODES",
            "KL_KINDS",
            "LOSS_MODES",
            "kl_penalty",
            "aggregate",
            "policy_loss",
        ),
        "reward": (
            "RewardFn",
            "RewardError",
            "math_reward",
            "color_reward",
            "load_reward_function",
            "score_samples",
            "overlong_penalty",
        ),
    },
)
