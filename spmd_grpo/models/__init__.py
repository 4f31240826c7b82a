"""The policy model: families, building it sharded, loading weights, attention, and the forward pass.

    families.py   what differs between Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense, MoE), Qwen3.5 (dense, MoE)
    architectures.py  the published architectures (config values, sizes) and the tower/text layouts
    expert_layout.py  read MoE expert tensors from the checkpoint's layout (transposed, per expert)
    linear_attention.py  packed rows through Gated DeltaNet layers: restart at every sequence
    build.py      build a policy or reference model sharded from the start (meta init -> FSDP2 -> shard-true load)
    lora.py       LoRA adapters (PEFT): which layers, fp32 adapters on a frozen base, init, adapters off
    weights.py    read each rank's slice of a safetensors checkpoint; FSDP -> Hugging Face parameter names
    attention.py  which attention kernel runs packed sequences, and the CPU variable-length sdpa path
    inputs.py     a micro-batch as the model takes it: padded or packed rows, image inputs, mrope positions
    video_rope.py mrope positions of sequences with videos, by vLLM's rule (transformers 5.19's differs)
    moe/          mixture-of-experts compute and controls: grouped experts, routing replay, load metrics
    policy.py     `PolicyModule`: logprobs and entropy of the response tokens, chunked over the vocabulary

The names below are imported on first use, so importing one module of the package stays light.
"""

from spmd_grpo import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "attention": (
            "VARLEN_SDPA",
            "sequence_bounds",
            "varlen_sdpa_forward",
            "varlen_sdpa_mask",
            "varlen_attention",
        ),
        "build": (
            "DTYPES",
            "HUB_PATTERNS",
            "resolve_dtype",
            "reference_dtype",
            "model_dir",
            "decoder_layers",
            "vision_blocks",
            "shard_model",
            "attention_setup",
            "hf_config",
            "meta_hf_model",
            "check_lora_targets",
            "init_non_persistent_buffers",
            "fill_from_checkpoint",
            "build_sharded",
            "build_policy",
            "build_reference",
        ),
        "architectures": ("MoE", "LinearAttention", "Published", "SIZES_B", "UNCHECKED_SIZES"),
        "expert_layout": ("checkpoint_views",),
        "linear_attention": ("split_packed_linear_attention",),
        "families": (
            "Family",
            "QWEN2_VL",
            "QWEN2_5_VL",
            "QWEN3_VL",
            "QWEN3_VL_MOE",
            "QWEN3_5",
            "QWEN3_5_MOE",
            "FAMILIES",
            "PUBLISHED",
            "supported",
            "family_for_type",
            "family_of",
            "family_of_model_path",
        ),
        "inputs": (
            "SequenceBatch",
            "ImageBatch",
            "collate",
            "mrope_position_ids",
            "response_token_index",
            "dummy_image",
        ),
        "lora": (
            "ADAPTER",
            "ADAPTER_FILE",
            "is_adapter_name",
            "base_name",
            "target_module_names",
            "add_adapters",
            "lora_layers",
            "has_adapters",
            "set_full_tensor",
            "init_adapters",
            "adapters_disabled",
            "merge_sources",
            "head_parts",
            "merged_weight",
            "write_peft_adapter",
        ),
        "policy": (
            "VISION_TOKEN_KEYS",
            "unsamplable_token_ids",
            "PolicyModule",
        ),
        "video_rope": ("video_rope_index",),
        "weights": (
            "INDEX",
            "SAFETENSORS_DTYPES",
            "weight_files",
            "SliceReader",
            "load_safetensors_into",
            "hf_name",
        ),
    },
)
