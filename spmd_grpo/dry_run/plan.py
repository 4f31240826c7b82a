"""`--dry-run`: the plan of a job for a production world size, computed on one CPU process in seconds.

    python -m spmd_grpo.train cfg.yaml --dry-run --nnodes 4 --nproc-per-node 8 [key=value ...]

Validates the config for that world size, builds the model on the meta device (no weights, no download when
the model id is one of the published architectures of `models/architectures.py` -- Qwen2-VL 2B/7B,
Qwen2.5-VL 3B/7B/32B/72B, Qwen3-VL 2B/4B/8B/32B, Qwen3-VL-MoE 30B-A3B/235B-A22B, Qwen3.5 4B/9B/27B,
Qwen3.5-MoE 35B-A3B/397B-A17B -- and the hub is unreachable), and prints: the mesh layout (TP groups, which rank
owns which prompts), batch arithmetic, the first batch's tensor shapes, for an MoE model its experts under
`worker.actor.fsdp.expert_parallel_size`, and a per-rank memory estimate (`memory.py`, which states what the
figures assume). The memory figures are ARITHMETIC from parameter counts and config, not measurements:
activations in particular are an order-of-magnitude estimate.

With LoRA (`worker.actor.model.lora.rank` > 0) the table shows the frozen base in the compute dtype
(bf16 on accelerators; on the host with `fsdp.offload_params`), the fp32 adapters, gradients and AdamW
states of the adapters only, and no reference model (the policy with its adapters disabled).
"""

from __future__ import annotations

from spmd_grpo.config.checks import require
from spmd_grpo.config.schema import Config
from spmd_grpo.config.validate import validate
from spmd_grpo.dry_run.counts import (
    BYTES,
    Batches,
    GiB,
    ModelCounts,
    batches,
    count_parameters,
    model_config,
    param_dtype,
    shares_prompt,
)
from spmd_grpo.dry_run.memory import memory_lines
from spmd_grpo.models.families import family_of


def dry_run(cfg: Config, nnodes: int, nproc_per_node: int, device_memory_gb: float = 80.0) -> str:
    """The plan of `cfg` on nnodes x nproc_per_node devices of device_memory_gb each, as printable lines."""
    world = nnodes * nproc_per_node
    validate(cfg, world)  # planned for another machine: its files are not checked (run/preflight.py)
    a = cfg.worker.actor
    hf_config, source = model_config(a.model.model_path, trust_remote_code=a.model.trust_remote_code)
    model = count_parameters(hf_config, a.model.lora)
    check_expert_parallel(cfg, model)
    b = batches(cfg, world)
    lines = [
        f"plan: {nnodes} nodes x {nproc_per_node} devices = world {world}; config valid for this world size",
        f"model: {a.model.model_path} ({source} config): {model.num_params / 1e9:.2f}B parameters "
        f"(vision {model.num_vision / 1e6:.0f}M, largest decoder layer {model.layer_params / 1e6:.0f}M), "
        f"tie_word_embeddings={hf_config.tie_word_embeddings}",
        *_lora_lines(cfg, model),
        *_expert_lines(cfg, model, world),
        *_layout_lines(cfg, b),
        _shared_prompt_line(cfg, b),
        _shapes_line(cfg, b.seq, family_of(hf_config).patch_size),
        *memory_lines(cfg, model, b, device_memory_gb),
    ]
    return "\n".join(lines)


def check_expert_parallel(cfg: Config, model: ModelCounts) -> None:
    """`worker.actor.fsdp.expert_parallel_size` needs experts, and must divide their number (the config's own
    check only sees the world size: the model's expert count is known once its config is read)."""
    ep = cfg.worker.actor.fsdp.expert_parallel_size
    path = cfg.worker.actor.model.model_path
    require(
        ep == 1 or model.num_expert > 0,
        f"worker.actor.fsdp.expert_parallel_size={ep}: {path} is a dense model (no experts to shard); set 1",
    )
    require(
        ep == 1 or model.num_experts % ep == 0,
        f"worker.actor.fsdp.expert_parallel_size={ep} must divide the model's {model.num_experts} experts "
        f"({path}: text_config.num_experts)",
    )


def _expert_lines(cfg: Config, model: ModelCounts, world: int) -> list[str]:
    """An MoE model's experts under expert parallelism: what an EP rank holds and what a rank's shard is."""
    if not model.num_expert:
        return []
    ep, e = cfg.worker.actor.fsdp.expert_parallel_size, model.num_experts
    layers = model.num_expert // model.layer_expert
    per_ep_rank = model.num_expert / ep
    # full fine-tuning: fp32 master, gradient, two AdamW moments; LoRA leaves the experts frozen in param_dtype
    bytes_per = BYTES[param_dtype(cfg)] if cfg.worker.actor.model.lora.enabled else 16
    held = (
        f"an EP rank holds experts p x {e // ep} .. p x {e // ep} + {e // ep - 1} of each layer"
        if ep > 1
        else f"no expert parallelism: every rank's FSDP group holds all {e} experts"
    )
    return [
        f"experts (worker.actor.fsdp.expert_parallel_size={ep}): {e} experts x {layers} layers, top {model.top_k}: "
        f"{model.num_expert / 1e9:.2f}B of the {model.num_params / 1e9:.2f}B parameters; {held} "
        f"({per_ep_rank / 1e9:.2f}B parameters, {bytes_per * per_ep_rank / GiB:.1f} GiB at {bytes_per} bytes each), "
        f"FSDP-sharded over the {world // ep} rank(s) holding them: {model.num_expert / world / 1e9:.3f}B per rank "
        f"(= experts / world at any EP); the other {(model.num_params - model.num_expert) / 1e9:.2f}B FSDP-sharded "
        f"over all {world} ranks; a layer gathers {e // ep} experts ({model.layer_expert / ep / 1e6:.0f}M "
        "parameters)" + (f", tokens reach them by all-to-all over groups of {ep} ranks" if ep > 1 else ""),
    ]


def _lora_lines(cfg: Config, model: ModelCounts) -> list[str]:
    lora = cfg.worker.actor.model.lora
    if not lora.enabled:
        return []
    return [
        f"LoRA: rank {lora.rank}, alpha {lora.alpha:g} on {model.num_adapted} linear layers: "
        f"{model.num_adapter / 1e6:.1f}M trainable parameters ({100 * model.num_adapter / model.num_params:.2f}%"
        f" of {model.num_params / 1e9:.2f}B); a checkpoint holds the adapters + Adam moments: "
        f"{12 * model.num_adapter / GiB:.2f} GiB (full fine-tuning: {12 * model.num_params / GiB:.0f} GiB); "
        f"no reference model (the policy with its adapters disabled)"
    ]


def _layout_lines(cfg: Config, b: Batches) -> list[str]:
    """TP groups, which rank owns which prompts, and the update's mini/micro-batches."""
    d, a, r = cfg.data, cfg.worker.actor, cfg.worker.rollout
    world, tp, prompts_per_rank = b.world, b.tp, b.prompts_per_rank
    groups = [list(range(g * tp, (g + 1) * tp)) for g in range(world // tp)]
    shown = groups[:2] + ([["..."]] if len(groups) > 3 else []) + groups[-1:] if len(groups) > 3 else groups
    owners = [
        f"rank {k}: prompts {k * prompts_per_rank}..{(k + 1) * prompts_per_rank - 1}"
        for k in sorted({0, min(1, world - 1), world - 1})  # each rank once: a world of 1 has no rank 1
    ]
    return [
        f"rollout TP groups ({len(groups)} x TP {tp}, consecutive ranks): {shown}",
        f"prompts per step {d.rollout_batch_size}: {prompts_per_rank} per rank, each with all {r.n} samples "
        f"({'; '.join(owners)}); a TP group generates its {prompts_per_rank * tp} prompts together",
        f"update: {b.samples_per_rank} samples per rank -> {b.num_mini} mini-batch(es) of {b.mini_per_rank} "
        f"per rank (global {a.global_batch_size}) x "
        + (
            f"micro-batches of ~{a.max_token_len_per_device_for_update} tokens (token budget; their count is "
            "set each step from the lengths, the same on every rank)"
            if a.dynamic_batching
            else f"{b.micro_per_mini} micro-batches of {a.micro_batch_size_per_device_for_update}"
        )
        + f" x {a.ppo_epochs} epoch(s) = "
        f"{b.num_mini * a.ppo_epochs} optimizer steps per training step",
    ]


def _shared_prompt_line(cfg: Config, b: Batches) -> str:
    """The shared-prompt layout's tokens per group at the longest prompt and response, and whether it is on."""
    d, n = cfg.data, cfg.worker.rollout.n
    p, r = d.max_prompt_length, d.max_response_length
    unshared, shared = n * (p + r), p + n * r
    why = (
        "on"
        if shares_prompt(cfg)
        else "off on Ascend NPUs with auto (on GPUs and the CPU, auto shares)"
        if cfg.worker.actor.shared_prompt == "auto" and cfg.worker.actor.padding_free is not False
        else "off"
    )
    return (
        f"shared prompt (worker.actor.shared_prompt={str(cfg.worker.actor.shared_prompt).lower()}): {why}; a group of {n} at "
        f"the longest holds {shared} tokens instead of {unshared} ({100 * (1 - shared / unshared):.0f} % fewer) "
        "in the old, reference and update passes"
    )


def _shapes_line(cfg: Config, seq: int, patch: int) -> str:
    """The largest tensors of one update micro-batch, and the image token range of min/max_pixels."""
    d = cfg.data
    micro = cfg.worker.actor.micro_batch_size_per_device_for_update
    merge = 2 * patch  # patch x spatial merge 2: one LM token per 28x28 (Qwen3-VL: 32x32) pixels
    max_img_tokens = d.max_pixels // merge**2
    min_img_tokens = max(1, d.min_pixels // merge**2)
    patch_dim = 3 * 2 * patch * patch
    too_large = (
        f" -- images above {d.max_prompt_length * merge**2} pixels cannot fit data.max_prompt_length and "
        "their prompts will be filtered"
        if max_img_tokens > d.max_prompt_length
        else ""
    )
    images = f"an image gives {min_img_tokens}..{max_img_tokens} tokens (min/max_pixels)" + too_large
    if cfg.worker.actor.dynamic_batching:
        budget = cfg.worker.actor.max_token_len_per_device_for_update
        return (
            f"update micro-batch shapes: ~{budget} prompt + response tokens each (token budget), as input_ids "
            f"[1, tokens] packed (padding_free) or [samples, longest] padded; pixel_values [<= tokens x 4, "
            f"{patch_dim}]; {images}"
        )
    return (
        f"first batch shapes per micro-batch (padded to the longest; at most): input_ids [{micro}, {seq}], "
        f"position_ids [3, {micro}, {seq}], pixel_values [<= {micro * max_img_tokens * 4}, {patch_dim}], "
        f"image_grid_thw [{micro}, 3]; {images}"
    )
