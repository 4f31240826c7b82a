"""The policy model: families, building it sharded, loading weights, attention, and the forward pass.

    families.py   what differs between Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense, MoE), Qwen3.5 (dense, MoE)
    architectures.py  the published architectures (config values, sizes) and the tower/text layouts
    expert_layout.py  read MoE expert tensors from the checkpoint's layout (transposed, per expert)
    linear_attention.py  packed rows through Gated DeltaNet layers: restart at every sequence
    build.py      build a policy or reference model sharded from the start (meta init -> FSDP2 -> shard-true load)
    lora.py       LoRA adapters (PEFT): which layers, fp32 adapters on a frozen base, init, adapters off
    weights.py    read each rank's slice of a safetensors checkpoint; FSDP -> Hugging Face parameter names
    attention.py  which attention kernel runs packed sequences, and the CPU variable-length sdpa path
    shared_flex.py  shared-prompt rows on CUDA: flex attention with a block mask (prefix + own causal)
    inputs.py     a micro-batch as the model takes it: padded or packed rows, image inputs, mrope positions
    video_rope.py mrope positions of sequences with videos, by vLLM's rule (transformers 5.19's differs)
    moe/          mixture-of-experts compute and controls: grouped experts, routing replay, load metrics
    policy.py     `PolicyModule`: logprobs and entropy of the response tokens, chunked over the vocabulary

Import each name from the module that defines it: this package re-exports nothing.
"""
