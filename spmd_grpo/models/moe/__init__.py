"""Mixture-of-experts compute and its controls, applied to Hugging Face MoE models from outside.

    experts.py  routed experts as grouped GEMMs over tokens sorted by expert (sort -> GEMM -> combine)
    routing.py  the router with routing replay, route recording, load and disagreement counts, aux loss
    install.py  swap both into every sparse MoE block of a model at build time; the aux-loss default
    metrics.py  the step's expert load and route-disagreement metrics, summed over ranks
    expert_parallel.py  `ExpertParallel`: experts sharded by index, all-to-all dispatch and combine, and
                `shard_experts`: EP plus the experts' own FSDP unit at the policy's build

Import each name from the module that defines it: this package re-exports nothing.
"""
