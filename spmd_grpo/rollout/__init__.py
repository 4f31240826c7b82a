"""The rollout half of the hybrid engine: vLLM in-process, weight sync, generation, DAPO sampling, validation.

    engine.py            `RolloutEngine`: one in-process vLLM per rank, sleep/wake, weights version, optimizer offload
    vllm_args.py         the vllm.LLM arguments from the config, the vision-token suppressor, vLLM log filters
    weight_sync.py       the sharded weight stream from the FSDP2 policy into vLLM, in buckets
    lora_sync.py         adapter-only weight sync: LoRA adapters into vLLM's enable_lora under a new id each push
    moe_reload.py        vLLM CPU's fused-MoE experts re-packed at every weight push (its reload skips that)
    generate.py          this rank's prompts -> sampled responses (tensor-parallel groups submit identical requests)
    dynamic_sampling.py  DAPO dynamic sampling as SPMD: keep generating until enough groups have spread
    sample_exchange.py   moving samples between ranks as raw bytes (DAPO rebalancing)
    validation.py        generate on the held-out set, score, report verl-named metrics

Import each name from the module that defines it: this package re-exports nothing.
"""
