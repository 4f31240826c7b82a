"""Mixture-of-experts compute and its controls, applied to Hugging Face MoE models from outside.

    experts.py  routed experts as grouped GEMMs over tokens sorted by expert (sort -> GEMM -> combine)
    routing.py  the router with routing replay, route recording, load and disagreement counts, aux loss
    install.py  swap both into every sparse MoE block of a model at build time; the aux-loss default
    metrics.py  the step's expert load and route-disagreement metrics, summed over ranks
    expert_parallel.py  `ExpertParallel`: experts sharded by index, all-to-all dispatch and combine
                (a ParallelStyle, not yet wired into the trainer)

The names below are imported on first use, so importing one module of the package stays light.
"""

from spmd_grpo import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "experts": (
            "SortedTokens",
            "sort_by_expert",
            "combine",
            "grouped_mm",
            "expert_mlp",
            "grouped_experts_forward",
            "is_stacked_experts",
            "use_grouped_experts",
        ),
        "routing": ("NO_ROUTE", "Routes", "MoEState", "routed_forward", "routes_used", "use_routing"),
        "install": ("moe_blocks", "router_aux_loss_coef", "install_moe"),
        "metrics": ("PASSES", "moe_metrics"),
        "expert_parallel": ("ExpertParallel", "expert_parallel_forward"),
    },
)
