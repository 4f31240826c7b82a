"""The policy model: families, building it sharded, loading weights, attention, and the forward pass.

    families.py   what differs between Qwen2-VL, Qwen2.5-VL and Qwen3-VL (classes, towers, published sizes)
    build.py      build a policy or reference model sharded from the start (meta init -> FSDP2 -> shard-true load)
    lora.py       LoRA adapters (PEFT): which layers, fp32 adapters on a frozen base, init, adapters off
    weights.py    read each rank's slice of a safetensors checkpoint; FSDP -> Hugging Face parameter names
    attention.py  which attention kernel runs packed sequences, and the CPU variable-length sdpa path
    inputs.py     a micro-batch as the model takes it: padded or packed rows, image inputs, mrope positions
    video_rope.py mrope positions of sequences with videos, by vLLM's rule (transformers 5.19's differs)
    policy.py     `PolicyModule`: logprobs and entropy of the response tokens, chunked over the vocabulary

Import each name from the module that defines it: this package re-exports nothing.
"""
