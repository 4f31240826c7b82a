"""`--dry-run`: the plan of a job for another machine, on one CPU process, without weights or network.

counts.py        the model's HF config (local, cached, or a published architecture) and its parameter
                 counts on the meta device, experts apart; the batch arithmetic of one step
memory.py        per-rank memory by phase and item (arithmetic; its docstring states the assumptions),
                 expert parallelism's shards and all-to-all buffers included
plan.py          `dry_run`: the printed plan (`python -m spmd_grpo.train cfg.yaml --dry-run ...`)
fewest_nodes.py  the fewest nodes that hold a job, searching expert-parallel and rollout TP sizes
                 (`python -m spmd_grpo.dry_run.fewest_nodes cfg.yaml [key=value ...]`)
"""
