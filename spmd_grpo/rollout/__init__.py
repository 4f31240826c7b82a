"""The rollout half of the hybrid engine: vLLM in-process, weight sync, generation, DAPO sampling, validation.

    engine.py            `RolloutEngine`: one in-process vLLM per rank, sleep/wake, weights version, optimizer offload
    vllm_args.py         the vllm.LLM arguments from the config, the vision-token suppressor, vLLM log filters
    weight_sync.py       the sharded weight stream from the FSDP2 policy into vLLM, in buckets
    lora_sync.py         adapter-only weight sync: LoRA adapters into vLLM's enable_lora under a new id each push
    generate.py          this rank's prompts -> sampled responses (tensor-parallel groups submit identical requests)
    dynamic_sampling.py  DAPO dynamic sampling as SPMD: keep generating until enough groups have spread
    sample_exchange.py   moving samples between ranks as raw bytes (DAPO rebalancing)
    validation.py        generate on the held-out set, score, report verl-named metrics

The names below are imported on first use, so importing one module of the package stays light.
"""

from spmd_grpo import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "dynamic_sampling": (
            "collect_groups",
            "kept_groups",
            "count_groups",
            "select_and_rebalance",
        ),
        "lora_sync": (
            "VLLM_MAX_LORA_RANKS",
            "vllm_lora_kwargs",
            "adapter_tensors",
            "AdapterSync",
        ),
        "engine": (
            "NO_WEIGHTS",
            "EngineStats",
            "RolloutEngine",
            "move_optimizer_state",
        ),
        "vllm_args": (
            "suppress_vision_tokens_processor",
            "quiet_vllm",
            "host_side_image_normalisation",
            "llm_kwargs",
            "engine_processor_kwargs",
        ),
        "generate": (
            "SamplingConfig",
            "request_seed",
            "generate_for_group",
            "generate",
            "attach_pixel_values",
            "attach_video_inputs",
            "VIDEO_INPUTS",
        ),
        "sample_exchange": (
            "LIST_FIELDS",
            "TENSOR_FIELDS",
            "TENSOR_TUPLE_FIELDS",
            "TENSOR_DICT_FIELDS",
            "SCALAR_FIELDS",
            "exchange_samples",
        ),
        "validation": (
            "VAL_SEED_OFFSET",
            "validate",
        ),
        "weight_sync": (
            "CountingIterator",
            "iter_weight_buckets",
            "iter_sharded_weights",
        ),
    },
)
