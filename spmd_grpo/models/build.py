"""Policy and reference models: build a Qwen-VL model sharded from the start, FSDP2, optimizer and LR schedule.

Which layers are sharded, which tower is frozen and how checkpoint names and expert layouts map is asked of
the model's family (`families.family_of`: Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5, dense or MoE); an
unsupported model_type fails before anything is built. MoE experts are sharded with their decoder layer
(dim 0, the expert index: a rank reads only its experts' bytes).

No rank ever holds a whole model. Each model is built on the meta device (no memory) from its config.json,
frozen / wrapped for activation checkpointing, sharded with `fully_shard` (per vision block and per language
decoder layer, then the root: torchtitan's `parallelize` order), given uninitialised local shards
(`to_empty`), and then filled from the checkpoint's safetensors by `weights.load_safetensors_into`:
`torch.distributed.checkpoint` plans which rows of which tensor each rank owns and every rank reads only
those rows (see weights.py for why that mechanism), so the transient beyond a rank's shards is one slice of
one tensor. What the checkpoint does not hold is restored here: the tied `lm_head` (the tie survives meta
construction and sharding; its key is left out of the load) and the non-persistent buffers (the text and the
vision rotary `inv_freq`, which `to_empty` leaves as garbage), recomputed from the config with transformers'
own `_init_weights`. A hub id is first resolved to its local snapshot (`*.json` + `*.safetensors`).

The policy keeps fp32 master weights on every device (AdamW steps on them, as verl); FSDP2's
MixedPrecisionPolicy gathers `fsdp.param_dtype` copies (bf16 on accelerators) and reduces gradients in
`fsdp.reduce_dtype`. An fp16 policy is refused by the config (deviation from verl, which trains fp16 with a
ShardedGradScaler; torchtitan refuses it too): without loss scaling the fp16 backward underflows, e.g. a
token-mean loss over 102,400 tokens gives the log-softmax a gradient below fp16's smallest subnormal on every
vocabulary entry but the sampled one, so the head's gradient loses those rows entirely and the hidden states'
gradient is 7.5 % off (0.3 % in bf16). The root unit does not cast its forward's inputs
(`cast_forward_inputs=False`): the batch reaches the policy as collated, so the float fields that are not
activations keep their values (the response mask, whose bf16 sum rounds above 256 tokens; Qwen2.5-VL's
`second_per_grid_ts`, which must be the value the engine reads: rounded to the rollout dtype by
`rollout.generate.attach_video_inputs`, not to param_dtype); the pixels are cast by the model's own patch
embedding, and every inner unit (vision block, decoder layer) still casts its inputs. The frozen reference is
built directly in `worker.ref.dtype` (auto: the policy's resolved param_dtype) and runs in that dtype: it never
exists in fp32 unless asked. With the default that gives the same numbers as an fp32 reference cast at the
all-gather (both round the same fp32 values once), at half the memory, and no sharded tensor is ever cast
(torch_npu cannot cast sharded DTensors).

Memory at load, Qwen2.5-VL-32B (33.45B parameters: 133.8 GB in fp32, 66.9 GB in bf16) on 8 ranks:
  * before (every rank `from_pretrained(fp32).to(device)`, then `fully_shard`; the reference again): 133.8 GB
    of host memory per rank (1.07 TB on an 8-rank node) and 133.8 GB on each 80 GB device: the job dies at
    load.
  * after: device 133.8 / 8 = 16.7 GB (policy, fp32) + 66.9 / 8 = 8.4 GB (reference, bf16) = 25.1 GB per
    rank, the same as after sharding before; transient: one read buffer of at most a rank's rows of the
    largest tensor, the 152064 x 5120 embedding: 1/8 of 778.6M values = 195 MB in bf16 (the checkpoint's
    dtype; on accelerators the cast to the shard's dtype may add that slice once more on the device). On
    64 ranks: 2.1 + 1.0 GB, 24 MB transient. Qwen2.5-VL-7B (8.29B, 33.2 GB fp32) on 8 ranks: 4.1 + 2.1 GB
    instead of 33.2 GB per model per rank.
  Measured on CPU (benchmarks/load_memory.py, 211M parameters, fsdp.param_dtype=bfloat16): the peak RSS
  of building policy + reference is 1.54 x the fp32 model at world 1 and 0.78 x at world 2, where the
  shards alone are 1.50 x and 0.75 x (docs/benchmarks.md).

CPU offload (`worker.actor.fsdp.offload_params`, `worker.ref.offload_params`): the shards are materialised
on the host (FSDP2 requires it) and the buffers on the compute device; pinned host memory on accelerators,
unpinned on CPU (pinning needs a CUDA driver; on CPU the "offload" is a no-op copy).

Expert parallelism (`worker.actor.fsdp.expert_parallel_size` > 1, an MoE model): before the layers are
sharded, every MoE layer's experts are split by expert index over EP groups of consecutive ranks and get
their own FSDP unit over the ranks outside the group (`moe.expert_parallel.shard_experts`); the reference
is built the same way.

Gradient clipping uses the true global norm: `clip_grad_norm_` over DTensor gradients reduces the
per-shard norms across ranks (FSDP2 semantics), so every rank gets the same norm.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from spmd_grpo.config.workers import ActorConfig, FSDPConfig, LoRAConfig, RefConfig
from spmd_grpo.models.attention import varlen_attention
from spmd_grpo.models.families import family_of
from spmd_grpo.models.lora import add_adapters, base_name, init_adapters, is_adapter_name, target_module_names
from spmd_grpo.models.moe.expert_parallel import expert_mesh, shard_experts
from spmd_grpo.models.moe.install import install_moe, moe_blocks, router_aux_loss_coef
from spmd_grpo.models.policy import PolicyModule, unsamplable_token_ids
from spmd_grpo.models.shared_flex import FLEX_SHARED, shared_prompt_attention
from spmd_grpo.models.weights import load_safetensors_into
from spmd_grpo.parallel.collectives import World, barrier
from spmd_grpo.parallel.devices import DTYPES, resolve_dtype

log = logging.getLogger(__name__)

HUB_PATTERNS = ["*.json", "*.safetensors"]


def reference_dtype(actor: ActorConfig, ref: RefConfig, device_type: str) -> torch.dtype:
    """The dtype the reference is held and run in: `worker.ref.dtype`, auto = the policy's param_dtype."""
    if ref.dtype == "auto":
        return resolve_dtype(actor.fsdp.param_dtype, device_type)
    return DTYPES[ref.dtype]


def model_dir(model_path: str, world: World) -> Path:
    """The local directory of `model_path`: itself, or the hub snapshot of its configs and safetensors
    (downloaded by local rank 0 while the others wait, then found in the cache by every rank)."""
    if Path(model_path).is_dir():
        return Path(model_path)
    from huggingface_hub import snapshot_download

    if world.local_rank == 0:
        snapshot_download(model_path, allow_patterns=HUB_PATTERNS)
    barrier()
    return Path(snapshot_download(model_path, allow_patterns=HUB_PATTERNS, local_files_only=True))


def decoder_layers(hf_model: nn.Module) -> list[nn.Module]:
    return list(family_of(hf_model.config).decoder_layers(hf_model))


def vision_blocks(hf_model: nn.Module) -> list[nn.Module]:
    return family_of(hf_model.config).vision_blocks(hf_model)


def shard_model(model: PolicyModule, fsdp: FSDPConfig, world: World) -> PolicyModule:
    """`fully_shard` each vision block and decoder layer, then the root. In place; returns the model.
    With `fsdp.expert_parallel_size` > 1 the experts are expert-parallel and their own units first.

    Parameters are gathered in `fsdp.param_dtype`. Every unit, the root included, reshards after its
    forward: between forwards a model holds only its shards (a forward-only reference would otherwise keep
    its root's gathered embeddings and lm_head on the device, offloaded or not), and backward regathers.
    With `fsdp.offload_params` the shards live in host memory (CPUOffloadPolicy), pinned on accelerators;
    on CPU unpinned, since pinning needs a CUDA driver.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    param_dtype = resolve_dtype(fsdp.param_dtype, world.device_type)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=DTYPES[fsdp.reduce_dtype])
    kwargs = {"mp_policy": mp}
    if fsdp.offload_params:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=world.device_type != "cpu")
    if fsdp.expert_parallel_size > 1:
        blocks = [block for _, block in moe_blocks(model.hf)]
        if not blocks:
            raise ValueError(
                f"worker.actor.fsdp.expert_parallel_size={fsdp.expert_parallel_size}: "
                f"{model.config.model_type} has no experts to shard; set 1"
            )
        ep = fsdp.expert_parallel_size
        mesh = expert_mesh(world, ep)
        shard_experts(blocks, mesh, world.world_size, **kwargs)
        if world.is_main and model.training:  # once: the policy's build, not the reference's
            log.info(
                "expert parallelism: the experts of %d MoE layers over EP groups of %d consecutive ranks, "
                "FSDP-sharded over %d (policy and reference)",
                len(blocks),
                ep,
                world.world_size // ep,
            )
    for block in vision_blocks(model.hf) + decoder_layers(model.hf):
        fully_shard(block, reshard_after_forward=True, **kwargs)
    root_mp = replace(mp, cast_forward_inputs=False)  # the batch as collated (module docstring)
    fully_shard(model, reshard_after_forward=True, **{**kwargs, "mp_policy": root_mp})
    return model


def attention_setup(padding_free: bool | str, device_type: str) -> tuple[bool, str]:
    """(pack the micro-batches?, transformers attn_implementation) for `worker.actor.padding_free`.

    Every device has a kernel for packed rows: `attention.varlen_attention` (flash attention on CUDA with
    `flash_attn`, the fused kernel on Ascend, per-length sdpa on the CPU), else, on CUDA, flex attention with
    the row's block-diagonal causal mask (`shared_flex.FLEX_SHARED`, which also computes shared prompts: on an
    H200 its packed rows, shared or not, were as close to float64 as the gathered sdpa's). So auto and true
    pack, false never does. The kernel is used either way: padded batches and the vision tower go through
    transformers' sdpa inside it.
    """
    return padding_free is not False, varlen_attention(device_type) or FLEX_SHARED


def shared_prompt_setup(setting: bool | str, packed: bool, device_type: str) -> bool:
    """Whether the passes hold each group's prompt once (`worker.actor.shared_prompt`). auto: on where the
    micro-batches are packed on the CPU (the varlen sdpa, `attention.VARLEN_SDPA`) and on CUDA (flex attention
    with the shared row's block mask, `shared_flex`; tests/gpu/test_gpu_shared_prompt.py passed on an H200:
    docs/models.md, Devices); off on Ascend, where only the gathered sdpa would compute it and nothing has run
    on an NPU. true: on wherever the batches are packed, with `shared_flex.shared_prompt_attention`'s kernel.
    Every family shares: a mixture-of-experts model's routes are laid out, recorded and replayed per token of
    the shared row (actor/routes.py), a hybrid model's linear-attention layers run each prompt once and seed
    its responses with its final state (linear_attention.py)."""
    if setting == "auto":
        return packed and device_type in ("cpu", "cuda")
    return bool(setting) and packed


def hf_config(path: Path, *, trust_remote_code: bool):
    """The transformers config in `path` (`trust_remote_code`: a checkpoint's own configuration code may run)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


def meta_hf_model(
    path: Path, dtype: torch.dtype, attn_implementation: str = "sdpa", *, trust_remote_code: bool = False
) -> nn.Module:
    """The HF model of the config in `path`, every parameter and buffer on the meta device (no memory)."""
    from transformers import AutoModelForImageTextToText

    config = hf_config(path, trust_remote_code=trust_remote_code)
    family_of(config)  # an unsupported model_type fails here, naming the supported families
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
        )


def check_lora_targets(model_path: str, cfg: LoRAConfig, *, trust_remote_code: bool = False) -> None:
    """`target_module_names` on the meta-device model of `model_path`'s config, before any process group:
    a target that matches no layer, or a rank wider than every adapted layer (`check_lora_rank`), fails in one
    line at start-up rather than after the process groups form.
    A hub id not yet in the local cache is checked when the model is built, after its download."""
    path = Path(model_path).expanduser()
    if not path.is_dir():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model_path, "config.json")
        except Exception:  # not a valid repo id: the model path checks name it
            return
        if not isinstance(cached, str):
            return
        path = Path(cached).parent
    model = meta_hf_model(path, torch.bfloat16, trust_remote_code=trust_remote_code)
    check_lora_rank(model, target_module_names(model, cfg), cfg.rank)


def check_lora_rank(hf_model: nn.Module, targets: list[str], rank: int) -> None:
    """The rank must not exceed the narrower side of every adapted layer: B A of a [out, in] layer has rank
    at most min(in, out), so a rank wider than all of them only adds parameters and Adam state (a rank of
    millions failed in the allocator once the model was built). A layer narrower than the rank is allowed:
    its adapter costs rank x (in + out) like any other layer's, and the default targets hold such layers
    (Qwen3.5-MoE's shared-expert gate, hidden -> 1, in every layer; Qwen3.5's linear-attention `in_proj_a`
    / `in_proj_b`, hidden -> value heads), which a per-layer bound refused at any rank above 1."""
    layers = dict(hf_model.named_modules())
    name = max(targets, key=lambda n: min(layers[n].in_features, layers[n].out_features))
    layer = layers[name]
    width = min(layer.in_features, layer.out_features)
    if rank > width:
        raise ValueError(
            f"worker.actor.model.lora.rank ({rank}) is wider than every adapted layer, the widest being {name} "
            f"({layer.in_features} -> {layer.out_features} features): an adapter's rank is at most {width} "
            "there; lower the rank"
        )


def init_non_persistent_buffers(hf_model: nn.Module, device: torch.device) -> None:
    """Recompute the buffers a checkpoint does not hold (the rotary `inv_freq` / `original_inv_freq` of the
    text and the vision tower) from the config, as transformers does after its own meta-device loading,
    and put every buffer on `device`. A non-persistent buffer of any other module is an error: nothing
    here would know its value."""
    for name, module in hf_model.named_modules():
        if not module._non_persistent_buffers_set:
            continue
        if not hasattr(module, "original_inv_freq"):
            unknown = sorted(module._non_persistent_buffers_set)
            raise NotImplementedError(f"no way to compute the non-persistent buffers {unknown} of {name}")
        hf_model._init_weights(module)
    for module in hf_model.modules():
        for key, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[key] = buf.to(device)


def fill_from_checkpoint(model: PolicyModule, path: Path, world: World, *, offload: bool) -> None:
    """Give the sharded meta model real local shards and read them from the safetensors in `path`."""
    hf = model.hf
    hf.to_empty(device="cpu" if offload else world.device)  # FSDP2 offload wants host shards
    # LoRA: the adapters are not in the checkpoint (initialised by the caller); base weights by their own name.
    state = {base_name(k): v for k, v in hf.state_dict().items() if not is_adapter_name(k)}
    if getattr(hf.config, "tie_word_embeddings", False):
        if hf.lm_head.weight is not hf.get_input_embeddings().weight:
            raise RuntimeError("tie_word_embeddings is set but lm_head and the embeddings are not tied")
        state.pop("lm_head.weight", None)  # not in the checkpoint: the embeddings' own tensor
    family = family_of(hf.config)
    fused = family.moe.is_fused_expert if family.moe is not None else None
    load_safetensors_into(state, path, name_map=family.on_disk_name, is_fused_expert=fused)
    init_non_persistent_buffers(hf, world.device)


def build_sharded(
    cfg: ActorConfig, dtype: torch.dtype, world: World, *, training: bool, seed: int = 0
) -> PolicyModule:
    """PolicyModule of `cfg.model` in `dtype`, sharded with `cfg.fsdp` and filled from the checkpoint; for
    training with `cfg.model.lora` the base is frozen and fp32 adapters (initialised from `seed`) are added."""
    path = model_dir(cfg.model.model_path, world)
    packed, attention = attention_setup(cfg.padding_free, world.device_type)
    hf = meta_hf_model(path, dtype, attention, trust_remote_code=cfg.model.trust_remote_code)
    family = family_of(hf.config)
    lora = training and cfg.model.lora.enabled
    if lora:
        hf = add_adapters(hf, cfg.model.lora)
    if training and cfg.model.freeze_vision_tower:
        family.vision_tower(hf).requires_grad_(False)
    if training and cfg.model.enable_gradient_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        layers = family.decoder_layers(hf)
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer)
    model = PolicyModule(hf, unsamplable_token_ids(hf.config), cfg.logprob_chunk_size, padding_free=packed)
    aux_coef = router_aux_loss_coef(cfg.moe.router_aux_loss_coef, hf.config) if training else 0.0
    model.moe = install_moe(hf, aux_loss_coef=aux_coef)  # grouped experts and replay-aware routers
    if model.moe is None and (cfg.moe.routing_replay != "none" or cfg.moe.router_aux_loss_coef):
        log.warning("worker.actor.moe ignored: %s is not a mixture-of-experts model", hf.config.model_type)
    model.shared_prompt = shared_prompt_setup(cfg.shared_prompt, packed, world.device_type)
    if model.shared_prompt:  # flash attention's varlen kernel cannot give a response its prompt
        hf.set_attn_implementation(shared_prompt_attention(world.device_type))
    model.train(training)  # before sharding: the EP build logs from the policy only
    if not training:
        model.requires_grad_(False)
    shard_model(model, cfg.fsdp, world)
    once = cfg.fsdp.gather_once_per_pass
    model.gather_once_per_pass = world.device_type == "cpu" if once == "auto" else bool(once)
    fill_from_checkpoint(model, path, world, offload=cfg.fsdp.offload_params)
    if lora:
        init_adapters(model, seed)
    return model


def build_policy(cfg: ActorConfig, world: World, *, seed: int = 0) -> PolicyModule:
    """The trainable policy, fp32 master weights on every device (NPU included), gathered in param_dtype.
    With LoRA the frozen base is held in param_dtype (resolved) and only the adapters are fp32."""
    dtype = (
        resolve_dtype(cfg.fsdp.param_dtype, world.device_type) if cfg.model.lora.enabled else torch.float32
    )
    return build_sharded(cfg, dtype, world, training=True, seed=seed)


def build_reference(cfg: ActorConfig, ref: RefConfig, world: World) -> PolicyModule:
    """Frozen FSDP2 copy for forward-only reference logprobs (all ranks run it together), held and run in
    `reference_dtype` (never built in fp32 unless `worker.ref.dtype` asks), offloaded with
    `worker.ref.offload_params`."""
    dtype = reference_dtype(cfg, ref, world.device_type)
    name = next(k for k, v in DTYPES.items() if v == dtype)
    fsdp = replace(cfg.fsdp, param_dtype=name, offload_params=ref.offload_params)
    return build_sharded(replace(cfg, fsdp=fsdp), dtype, world, training=False)
