"""`--dry-run`: the plan of a job for a production world size, computed on one CPU process in seconds.

    python -m spmd_grpo.train cfg.yaml --dry-run --nnodes 4 --nproc-per-node 8 [key=value ...]

Validates the config for that world size, builds the model on the meta device (no weights, no download when
the model id is one of the Qwen2.5-VL sizes below and the hub is unreachable), and prints: the mesh layout
(TP groups, which rank owns which prompts), batch arithmetic, the first batch's tensor shapes, and a
per-rank memory estimate. The memory figures are ARITHMETIC from parameter counts and config, not
measurements: activations in particular are an order-of-magnitude estimate.
"""

from __future__ import annotations

import math

import torch

from .config import Config, validate

# Published architecture of the Qwen2.5-VL instruct checkpoints (their config.json), used when the hub
# cannot be reached. Vision tower: 32 blocks, width 1280, MLP 3420, 16 heads, patch 14, merge 2.
KNOWN_ARCHITECTURES = {
    "Qwen/Qwen2.5-VL-3B-Instruct": dict(
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "Qwen/Qwen2.5-VL-7B-Instruct": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "Qwen/Qwen2.5-VL-32B-Instruct": dict(
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}
GiB = 2**30


def model_config(model_path: str):
    """The HF config from a local dir or the hub; else the published architecture of a known id."""
    from transformers import AutoConfig, Qwen2_5_VLConfig

    # A dry run must answer in seconds: a known id never waits on the hub (local HF cache only).
    try:
        return AutoConfig.from_pretrained(
            model_path, local_files_only=model_path in KNOWN_ARCHITECTURES
        ), "loaded"
    except Exception as e:  # offline, not cached, or not a local directory
        if model_path not in KNOWN_ARCHITECTURES:
            raise ValueError(
                f"worker.actor.model.model_path={model_path!r}: config not loadable ({type(e).__name__}) and not one "
                f"of the built-in architectures {sorted(KNOWN_ARCHITECTURES)}"
            ) from None
        arch = dict(KNOWN_ARCHITECTURES[model_path])
        tie = arch.pop("tie_word_embeddings")
        text = dict(
            arch, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
        )
        vision = dict(
            depth=32,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            out_hidden_size=arch["hidden_size"],
            fullatt_block_indexes=[7, 15, 23, 31],
        )
        return Qwen2_5_VLConfig(
            text_config=text, vision_config=vision, tie_word_embeddings=tie
        ), "built-in (offline)"


def dry_run(cfg: Config, nnodes: int, nproc_per_node: int, device_memory_gb: float = 80.0) -> str:
    from transformers import Qwen2_5_VLForConditionalGeneration

    world = nnodes * nproc_per_node
    validate(cfg, world)
    d, a, r = cfg.data, cfg.worker.actor, cfg.worker.rollout
    hf_config, source = model_config(a.model.model_path)
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(hf_config)
    num_params = sum(p.numel() for p in model.parameters())
    num_vision = sum(p.numel() for p in model.model.visual.parameters())
    layer_params = max(
        sum(p.numel() for p in layer.parameters()) for layer in model.model.language_model.layers
    )
    text = hf_config.text_config
    head_dim = text.hidden_size // text.num_attention_heads

    tp = r.tensor_parallel_size
    prompts_per_rank = d.rollout_batch_size // world
    samples_per_rank = prompts_per_rank * r.n
    mini_per_rank = a.global_batch_size // world
    num_mini = samples_per_rank // mini_per_rank
    micro_per_mini = mini_per_rank // a.micro_batch_size_per_device_for_update
    seq = d.max_prompt_length + d.max_response_length

    lines = [
        f"plan: {nnodes} nodes x {nproc_per_node} devices = world {world}; config valid for this world size"
    ]
    lines.append(
        f"model: {a.model.model_path} ({source} config): {num_params / 1e9:.2f}B parameters "
        f"(vision {num_vision / 1e6:.0f}M, largest decoder layer {layer_params / 1e6:.0f}M), "
        f"tie_word_embeddings={hf_config.tie_word_embeddings}"
    )
    groups = [list(range(g * tp, (g + 1) * tp)) for g in range(world // tp)]
    shown = groups[:2] + ([["..."]] if len(groups) > 3 else []) + groups[-1:] if len(groups) > 3 else groups
    lines.append(f"rollout TP groups ({len(groups)} x TP {tp}, consecutive ranks): {shown}")
    owners = [
        f"rank {k}: prompts {k * prompts_per_rank}..{(k + 1) * prompts_per_rank - 1}"
        for k in (0, 1, world - 1)
    ]
    lines.append(
        f"prompts per step {d.rollout_batch_size}: {prompts_per_rank} per rank, each with all {r.n} samples "
        f"({'; '.join(owners)}); a TP group generates its {prompts_per_rank * tp} prompts together"
    )
    lines.append(
        f"update: {samples_per_rank} samples per rank -> {num_mini} mini-batch(es) of {mini_per_rank} per rank "
        f"(global {a.global_batch_size}) x {micro_per_mini} micro-batches of "
        f"{a.micro_batch_size_per_device_for_update} x {a.ppo_epochs} epoch(s) = "
        f"{num_mini * a.ppo_epochs} optimizer steps per training step"
    )

    merge = 2 * 14  # patch 14 x spatial merge 2: one LM token per 28x28 pixels
    max_img_tokens = d.max_pixels // merge**2
    min_img_tokens = max(1, d.min_pixels // merge**2)
    patch_dim = 3 * 2 * 14 * 14
    lines.append(
        f"first batch shapes per micro-batch (padded to the longest; at most): input_ids "
        f"[{a.micro_batch_size_per_device_for_update}, {seq}], position_ids [3, "
        f"{a.micro_batch_size_per_device_for_update}, {seq}], pixel_values [<= "
        f"{a.micro_batch_size_per_device_for_update * max_img_tokens * 4}, {patch_dim}], image_grid_thw "
        f"[{a.micro_batch_size_per_device_for_update}, 3]; an image gives {min_img_tokens}..{max_img_tokens} "
        f"tokens (min/max_pixels)"
        + (
            f" -- images above {d.max_prompt_length * merge**2} pixels cannot fit data.max_prompt_length and "
            "their prompts will be filtered"
            if max_img_tokens > d.max_prompt_length
            else ""
        )
    )

    # Memory per rank (arithmetic).
    shard = num_params / world
    trainable = num_params - (num_vision if a.model.freeze_vision_tower else 0)
    bf16 = 2
    est = {
        "policy fp32 master shard": 4 * shard,
        "gradients fp32 shard": 4 * trainable / world,
        "AdamW states fp32 shard": 8 * trainable / world,
        "gathered bf16 layer (+ prefetch)": 2 * bf16 * layer_params,
        "reference fp32 shard" + (" (CPU offload)" if cfg.worker.ref.offload_params else ""): 0.0
        if cfg.worker.ref.offload_params or not cfg.algorithm.use_kl_loss
        else 4 * shard,
        f"logits chunk fp32 ({a.logprob_chunk_size} tokens x vocab)": 4
        * a.logprob_chunk_size
        * text.vocab_size
        * 2,
        "activations (estimate: layer inputs kept"
        + (
            ", checkpointing)" if a.model.enable_gradient_checkpointing else ", no checkpointing x ~16)"
        ): a.micro_batch_size_per_device_for_update
        * seq
        * text.hidden_size
        * bf16
        * text.num_hidden_layers
        * (1 if a.model.enable_gradient_checkpointing else 16),
    }
    kv_per_token = (
        2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * bf16 / tp
    )  # this rank's heads
    vllm_weights = bf16 * num_params / tp
    budget = r.gpu_memory_utilization * device_memory_gb * GiB  # what vLLM reserves while awake
    kv_capacity = max(0.0, budget - vllm_weights)
    concurrent = int(kv_capacity // (seq * kv_per_token))
    group_seqs = prompts_per_rank * tp * r.n
    resident = est["policy fp32 master shard"] + (
        0.0 if a.fsdp.offload_optimizer else est["AdamW states fp32 shard"]
    )
    lines.append(f"memory per rank (GiB, arithmetic; device {device_memory_gb:g} GiB):")
    lines += [f"  train   {name:<70} {v / GiB:8.2f}" for name, v in est.items()]
    train_total = sum(est.values())
    headroom = "fits" if train_total <= 0.9 * device_memory_gb * GiB else "TOO TIGHT (> 90% of the device)"
    lines.append(
        f"  peak while training  ~{train_total / GiB:.1f} GiB"
        + (" (vLLM asleep: weights and KV released)" if r.enable_sleep_mode else " + vLLM resident")
        + f" -> {headroom}"
    )
    lines.append(
        f"  rollout: trainer state kept on the device {resident / GiB:.1f} GiB (policy shard"
        + (")" if a.fsdp.offload_optimizer else " + AdamW states; fsdp.offload_optimizer moves them off)")
        + f" + vLLM reservation {budget / GiB:.1f} GiB (gpu_memory_utilization {r.gpu_memory_utilization})"
        f" = {(resident + budget) / GiB:.1f} GiB -> {'fits' if resident + budget <= device_memory_gb * GiB else 'DOES NOT FIT'}"
    )
    lines.append(
        f"  vLLM: weights {vllm_weights / GiB:.2f} GiB (bf16 / TP {tp}), KV space {kv_capacity / GiB:.1f} GiB at "
        f"{kv_per_token / 2**10:.0f} KiB/token/rank -> {concurrent} concurrent max-length ({seq}-token) sequences"
        f" per TP group; the step's {group_seqs} sequences per group run in "
        f"{math.ceil(group_seqs / concurrent) if concurrent else 'NO'} wave(s) at worst"
    )
    return "\n".join(lines)
