"""LoRA adapters on the policy (`worker.actor.model.lora`), built with PEFT.

Library: PEFT's `inject_adapter_in_model` replaces each targeted `nn.Linear` in place by PEFT's
`lora.Linear` (the original layer kept as `base_layer`, the adapters as `lora_A.default` [r, in] and
`lora_B.default` [out, r], output `base(x) + alpha / r * B(A(dropout(x)))`). No `PeftModel` wrapper: the HF
model keeps its attributes and forward, `PolicyModule` is unchanged, and the in-memory names only gain
`.base_layer` (base weights) and `.lora_A.default` / `.lora_B.default` (adapters). PEFT's module classes and
key layout are what every PEFT user and vLLM's `enable_lora` load, so export and adapter-only sync speak
its format.

Which modules: `target_modules` `all-linear` is every `nn.Linear` but the output head (PEFT's definition),
a list matches a module whose name is an entry or ends with `.<entry>` (PEFT's rule) and may name the head
(`lm_head`, untied models only: the trainer's chunked log-softmax then adds the head's adapter itself,
`head_parts`); `exclude_modules`
are module-name PREFIXES (deviation from PEFT, which matches excludes like targets: a tower has hundreds of
linear layers and one prefix names them all). Default: the vision tower and its merger (`model.visual`).

Precision and memory (as LoRA promises; verl casts the whole model to the compute dtype instead): the base
is built in the compute dtype (`fsdp.param_dtype` resolved: bf16 on accelerators, fp32 on CPU) and frozen,
the adapters are fp32 master weights; both live in the same FSDP2 unit per decoder layer (FSDP2 in torch
2.13 all-gathers mixed dtypes in one unit and casts everything to `param_dtype` for compute; checked on
CPU with gloo, world 2). Only adapters require grad, so only they get gradients, Adam state and clipping.

Initialisation: PEFT's default (A: kaiming-uniform with a = sqrt(5), B: 0), drawn for the full tensor from
a generator seeded identically on every rank and then sharded, so all ranks agree on one adapter. B = 0
makes the initial policy equal the base model.

The reference policy for the KL term is this same model under `adapters_disabled` (verl's "ref = actor
without LoRA"): no second model.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from spmd_grpo.config.workers import LORA_ALL_LINEAR, LoRAConfig

ADAPTER = "default"  # PEFT's adapter name; one adapter per model
ADAPTER_KEYS = (f".lora_A.{ADAPTER}.", f".lora_B.{ADAPTER}.")
BASE_LAYER = ".base_layer."
ADAPTER_FILE = "adapter_model.safetensors"  # a PEFT adapter directory's weights
ADAPTER_CONFIG = "adapter_config.json"  # ... and its settings (written by PEFT's `save_pretrained`)


def is_adapter_name(name: str) -> bool:
    """Whether a parameter / state-dict name is one of a LoRA adapter's tensors."""
    return any(k in name for k in ADAPTER_KEYS)


def base_name(name: str) -> str:
    """The name a wrapped base weight had before PEFT (`q_proj.base_layer.weight` -> `q_proj.weight`)."""
    return name.replace(BASE_LAYER, ".")


def target_module_names(hf_model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Names of the `nn.Linear` modules that get an adapter; ValueError if none does or a name is unused."""
    head = hf_model.get_output_embeddings()
    linear = [n for n, m in hf_model.named_modules() if isinstance(m, nn.Linear)]
    kept = [n for n in linear if not any(n == p or n.startswith(p + ".") for p in cfg.exclude_modules)]
    head_name = next(n for n, m in hf_model.named_modules() if m is head)
    if cfg.target_modules == LORA_ALL_LINEAR:
        targets = [n for n in kept if n != head_name]
    else:
        targets = [n for n in kept if any(n == t or n.endswith("." + t) for t in cfg.target_modules)]
        unused = [t for t in cfg.target_modules if not any(n == t or n.endswith("." + t) for n in kept)]
        if unused:
            raise ValueError(
                f"worker.actor.model.lora.target_modules: {unused} match no linear layer outside "
                f"exclude_modules {list(cfg.exclude_modules)} (e.g. {kept[:3]})"
            )
    if not targets:
        raise ValueError("worker.actor.model.lora: no linear layer to adapt (check target/exclude_modules)")
    if head_name in targets and getattr(hf_model.config, "tie_word_embeddings", False):
        raise ValueError(
            f"worker.actor.model.lora.target_modules: {head_name} is tied to the input embeddings in this "
            "model; an adapter on it would untie them"
        )
    return targets


def add_adapters(hf_model: nn.Module, cfg: LoRAConfig) -> nn.Module:
    """Inject LoRA adapters (fp32) into `hf_model` (on the meta device) and freeze everything else."""
    from peft import LoraConfig, inject_adapter_in_model

    peft_cfg = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=target_module_names(hf_model, cfg),
        bias="none",
    )
    with torch.device("meta"):
        hf_model = inject_adapter_in_model(peft_cfg, hf_model, adapter_name=ADAPTER)
    for name, param in hf_model.named_parameters():
        adapter = is_adapter_name(name)
        param.requires_grad_(adapter)
        if adapter:
            param.data = param.data.float()
    return hf_model


def lora_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(module name, PEFT LoRA layer) of every adapted layer."""
    if "peft" not in sys.modules:  # no adapter exists before peft is imported (full fine-tuning never does)
        return
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


def has_adapters(model: nn.Module) -> bool:
    return next(lora_layers(model), None) is not None


def set_full_tensor(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor (the same on every rank) into a parameter, sharded or not."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if isinstance(param, DTensor):
            full = full.detach()
            param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements).to_local())
        else:
            param.copy_(full)


def init_adapters(model: nn.Module, seed: int) -> None:
    """PEFT's default initialisation of every adapter (A: kaiming-uniform, B: 0), identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    for _, layer in lora_layers(model):
        a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
        full_a = torch.empty(a.shape, dtype=torch.float32)
        # kaiming_uniform_(a=sqrt(5)) of an [r, in] weight is U(-1/sqrt(in), 1/sqrt(in))
        bound = 1 / math.sqrt(a.shape[1])
        full_a.uniform_(-bound, bound, generator=gen)
        set_full_tensor(a, full_a.to(a.device))
        set_full_tensor(b, torch.zeros(b.shape, dtype=torch.float32, device=b.device))


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run `model` as its base (the KL reference): every LoRA layer skips its adapter inside the block.

    The parameters keep their `requires_grad`: PEFT's `enable_adapters(False)` also clears the adapters'
    flags, and FSDP2 fixes each unit's gradient dtypes at the model's first forward from the parameters
    requiring grad then. When that first forward was the reference pass (no old-logprob pass before it:
    the update takes the old logprobs from its own forward), the bf16-gathered adapters' gradients were
    later handed uncast to their fp32 shards and the first backward failed ("attempting to assign a
    gradient with dtype BFloat16 to a tensor with grad_dtype Float"). The block is for forward-only passes:
    a disabled adapter takes no part in the output whatever its flag."""
    layers = [layer for _, layer in lora_layers(model)]
    flags = [(p, p.requires_grad) for layer in layers for p in layer.parameters()]
    for layer in layers:
        layer.enable_adapters(False)
    for p, flag in flags:
        p.requires_grad_(flag)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for p, flag in flags:
            p.requires_grad_(flag)


def merge_sources(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """{HF name of an adapted base weight: (lora_A, lora_B, scale)}: what a merged weight push adds to it."""
    from spmd_grpo.models.weights import hf_name

    return {
        hf_name(f"{name}.base_layer.weight"): (
            layer.lora_A[ADAPTER].weight,
            layer.lora_B[ADAPTER].weight,
            float(layer.scaling[ADAPTER]),
        )
        for name, layer in lora_layers(model)
    }


def merged_weight(base: torch.Tensor, source: tuple[torch.Tensor, torch.Tensor, float]) -> torch.Tensor:
    """`base + scale * B @ A` in fp32, returned in `base`'s dtype on `base`'s device. Collective when the
    adapters are sharded (each is gathered whole: [r, in] and [out, r], small next to the base weight)."""
    # on `base`'s device: offloaded adapters (`fsdp.offload_params`) live in host memory, a gathered base not
    a, b = ((t.full_tensor() if hasattr(t, "full_tensor") else t).to(base.device) for t in source[:2])
    scale = source[2]
    with torch.no_grad():
        return (base.float() + scale * (b.detach().float() @ a.detach().float())).to(base.dtype)


def write_peft_adapter(
    tensors: dict[str, torch.Tensor],
    out,
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    base_model: str | None = None,
) -> list[str]:
    """Write the PEFT adapter directory `out` (`adapter_model.safetensors` of `tensors`, keyed
    `base_model.model.<module>.lora_A.weight` / `.lora_B.weight`, and PEFT's own `adapter_config.json`), the
    format `PeftModel.from_pretrained` and vLLM's `LoRARequest` load; returns the adapted modules' names."""
    from pathlib import Path

    from peft import LoraConfig
    from safetensors.torch import save_file

    out = Path(out)
    modules = sorted({k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in tensors})
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_FILE), metadata={"format": "pt"})
    LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=modules,
        bias="none",
        base_model_name_or_path=base_model,
    ).save_pretrained(str(out))
    return modules


def head_parts(head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, tuple | None]:
    """(weight, bias, adapter) of the output head for the trainer's own chunked projection: `adapter` is
    (A, B, scale, dropout) when the head carries an enabled LoRA adapter, else None."""
    if not hasattr(head, "lora_A"):  # a plain head (no peft import on the hot path)
        return head.weight, head.bias, None
    base = head.get_base_layer()
    if head.disable_adapters:
        return base.weight, base.bias, None
    adapter = (
        head.lora_A[ADAPTER].weight,
        head.lora_B[ADAPTER].weight,
        float(head.scaling[ADAPTER]),
        head.lora_dropout[ADAPTER],
    )
    return base.weight, base.bias, adapter
