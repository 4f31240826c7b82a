"""The architecture pieces a family is made of and the published architectures the `--dry-run` knows
offline: `MoE` (where the sparse MLP sits, its expert layout), `LinearAttention` (Gated DeltaNet layers), the
layout helpers (vision towers, text models) that both the published rows and the tiny-model builder use, and
the values of each published checkpoint's config.json.

Each row's parameter count, built on the meta device, must equal its published model size (`SIZES_B`,
tested), which catches a wrong width or depth. The two 2B rows were not read from a published config.json
but put together from partial public copies; the count settles the one value those copies disagree on, the
2B MLP width: Qwen3-VL-2B's language model is Qwen3-1.7B's (MLP 6144 gives 2.13B; the 5632 and 8192 seen
elsewhere give 2.04B and 2.48B), Qwen2-VL-2B's is Qwen2-1.5B's (MLP 8960 gives 2.21B). The Qwen3-VL-MoE
rows (30B-A3B: 48 layers of 128 experts, top 8, expert MLP 768; 235B-A22B: 94 layers, hidden 4096, expert
MLP 1536) are checked the same way; their language-model values are also those of the Megatron arguments
public RL trainers ship for these two checkpoints (slime's `scripts/models/qwen3-vl-30b-a3b.sh` and
`qwen3-vl-235b-a22b.sh`).

The Qwen3.5 model cards give no parameter count finer than the size in the name, so those rows are not
checked by count (`UNCHECKED_SIZES`); each row says where its values come from, and two independent public
sources agree on every language-model value of each: transformers 5.19's own defaults (`Qwen3_5TextConfig`:
the 9B; `Qwen3_5MoeTextConfig`: the 35B-A3B), the Megatron arguments of slime's and miles' Qwen3.5 recipes
(`scripts/models/qwen3.5-*.sh`: widths, depths, heads, expert counts, untied or tied), and config.json copies
in public code (linear-attention heads and the vision tower, which those recipes do not spell). The table's
counts: 4.54B, 9.41B, 27.4B, 35.1B and 397B (no MTP layer: transformers does not build it). Not listed,
because nothing offline gives their config.json values: Qwen3.5-0.8B (slime's recipe gives the language model,
hidden 1024, 24 layers, 8 heads, 2 KV heads, MLP 3584, tied, but neither the linear-attention heads nor the
vision tower), Qwen3.5-2B and Qwen3.5-122B-A10B.

This module imports neither torch nor transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoE:
    """Where a family's sparse MLP lives and how its experts are laid out, for everything that treats experts
    apart from dense layers (weight layout, LoRA targets, grouped GEMM, expert parallelism, routing replay).

    In every decoder layer `block` (relative to the layer) is the sparse MLP module; its `experts` child holds
    the stacked expert weights as two 3-D parameters, `gate_up_proj` [E, 2 x I, H] (gate rows first, then up
    rows, the order vLLM splits them in) and `down_proj` [E, H, I], in transformers' in-memory layout; its
    `router` child is the token-choice top-k router (`weight` [E, H]: softmax in fp32, top-k, the top-k
    probabilities renormalised to sum 1; no capacity, so no token is ever dropped).
    """

    block_class: str
    """transformers class name of the sparse MLP block (what expert parallelism would wrap)."""
    experts_class: str
    router_class: str
    hub_transposed: bool
    """Published checkpoints and vLLM hold the fused experts transposed ([E, H, 2 x I], [E, I, H]; Qwen3-VL-MoE):
    the push and the export transpose (`Family.hub_tensors`). False: the published files hold one tensor per
    expert (`experts.{e}.gate_proj.weight`, ...; Qwen3.5-MoE), and the push and the export split them so."""
    shared_expert: bool = False
    """A dense shared expert with a sigmoid gate runs beside the routed experts (Qwen3.5-MoE)."""
    block: str = "mlp"
    experts: str = "mlp.experts"
    router: str = "mlp.gate"
    expert_weights: tuple[str, ...] = ("gate_up_proj", "down_proj")

    def is_fused_expert(self, name: str) -> bool:
        """Whether the parameter `name` is one of the stacked 3-D expert tensors."""
        return any(name.endswith(f".{self.experts}.{w}") for w in self.expert_weights)


@dataclass(frozen=True)
class LinearAttention:
    """The Gated DeltaNet layers of a hybrid model (`text_config.layer_types`: `linear_attention` or
    `full_attention`). Their recurrent state and causal convolution restart at each packed sequence."""

    module: str = "linear_attn"
    """The layer's attribute holding the Gated DeltaNet (full-attention layers hold `self_attn`)."""
    module_class: str = ""
    vllm_cpu_dtype: str = "bfloat16"
    """vLLM's CPU Gated DeltaNet kernel runs only in this dtype (and with a key/value head dim of 128)."""
    vllm_cpu_head_dim: int = 128


@dataclass(frozen=True)
class Published:
    """The architecture of a published checkpoint (values of its config.json), for `--dry-run` offline."""

    model_id: str
    text: dict[str, Any]
    """text_config fields: hidden_size, intermediate_size, num_hidden_layers, heads, vocab_size, ..."""
    vision: dict[str, Any]
    tie_word_embeddings: bool


def _qwen2_text(text: tuple[int, int, int, int, int], tie: bool) -> dict[str, Any]:
    """The language model of Qwen2-VL and Qwen2.5-VL: (hidden, MLP, layers, heads, KV heads); vocab 152064
    (151936 when tied), rope theta 1e6, mrope [16, 24, 24]."""
    hidden, inter, layers, heads, kv = text
    return dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=151936 if tie else 152064,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
    )


def qwen2_vl_vision(depth: int, width: int, mlp: int, heads: int, out_hidden: int) -> dict[str, Any]:
    """Qwen2-VL's tower: LayerNorm blocks, MLP given as a ratio, no window attention; its `hidden_size` is the
    language model's width (the merger's output)."""
    return dict(depth=depth, embed_dim=width, hidden_size=out_hidden, mlp_ratio=mlp // width, num_heads=heads)


def _tower(depth: int, width: int, mlp: int, heads: int, out_hidden: int, patch: int) -> dict[str, Any]:
    """The vision_config fields Qwen2.5-VL and Qwen3-VL name alike."""
    return dict(
        depth=depth,
        hidden_size=width,
        intermediate_size=mlp,
        num_heads=heads,
        out_hidden_size=out_hidden,
        patch_size=patch,
    )


def qwen2_5_vl_vision(depth: int, width: int, mlp: int, heads: int, out_hidden: int) -> dict[str, Any]:
    """Qwen2.5-VL's tower: RMSNorm blocks with window attention (112 pixels), full attention in every 8th block
    and the last (7/15/23/31 at depth 32)."""
    full = [i for i in range(depth) if (i + 1) % 8 == 0 or i == depth - 1]
    tower = _tower(depth, width, mlp, heads, out_hidden, patch=14)
    return dict(tower, window_size=112, fullatt_block_indexes=full)


def qwen3_vl_vision(
    depth: int, width: int, mlp: int, heads: int, out_hidden: int, *, deepstack=(), position_embeddings=2304
) -> dict[str, Any]:
    """Qwen3-VL's tower: patch 16, learnt position embeddings (a square count), DeepStack mergers after the
    blocks `deepstack`."""
    tower = _tower(depth, width, mlp, heads, out_hidden, patch=16)
    return dict(tower, num_position_embeddings=position_embeddings, deepstack_visual_indexes=list(deepstack))


def _qwen2_vl_published(model_id: str, text: tuple[int, int, int, int, int], tie: bool) -> Published:
    """Qwen2-VL instruct: vocab 152064 (151936 when tied), rope theta 1e6, mrope [16, 24, 24]; vision tower
    of 32 blocks, width 1280, MLP ratio 4, 16 heads, patch 14, merge 2."""
    vision = qwen2_vl_vision(32, 1280, 5120, 16, text[0])
    return Published(model_id, _qwen2_text(text, tie), vision, tie)


def _qwen2_5_vl_published(model_id: str, text: tuple[int, int, int, int, int], tie: bool) -> Published:
    """Qwen2.5-VL instruct: rope theta 1e6, mrope [16, 24, 24]; vision tower of 32 blocks, width 1280, MLP
    3420, 16 heads, patch 14, merge 2, full attention in blocks 7/15/23/31 (window attention elsewhere)."""
    vision = qwen2_5_vl_vision(32, 1280, 3420, 16, text[0])
    return Published(model_id, _qwen2_text(text, tie), vision, tie)


def _qwen3_vl_published(model_id: str, text: tuple, vision: tuple, tie: bool):
    """Qwen3-VL instruct (dense): head_dim 128, vocab 151936, rope theta 5e6, interleaved mrope [24, 20, 20];
    vision tower patch 16, merge 2, 2304 learnt position embeddings, DeepStack from three blocks."""
    hidden, inter, layers, heads, kv = text
    depth, width, mlp, deepstack = vision
    text_cfg = dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=128,
        vocab_size=151936,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5e6,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
    )
    vision_cfg = qwen3_vl_vision(depth, width, mlp, 16, hidden, deepstack=deepstack)
    return Published(model_id, text_cfg, vision_cfg, tie)


def _qwen3_vl_moe_published(model_id: str, text: tuple, moe: tuple) -> Published:
    """Qwen3-VL-MoE instruct: Qwen3-VL's text particulars (head_dim 128, vocab 151936, rope theta 5e6,
    interleaved mrope [24, 20, 20]) with a sparse MLP in every layer (`moe`: experts, experts per token,
    expert MLP width; top-k renormalised), untied; Qwen3-VL-8B's vision tower (27 blocks, DeepStack 8/16/24)."""
    base = _qwen3_vl_published(model_id, text, (27, 1152, 4304, (8, 16, 24)), False)
    num_experts, top_k, moe_inter = moe
    text_cfg = dict(
        base.text,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_inter,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    )
    return Published(model_id, text_cfg, base.vision, False)


def qwen3_5_vision(
    depth: int, width: int, mlp: int, heads: int, out_hidden: int, *, position_embeddings=2304
) -> dict[str, Any]:
    """Qwen3.5's tower: Qwen3-VL's (patch 16, learnt position embeddings) without DeepStack: the language
    model takes only the final merger's output (vLLM reads `deepstack_visual_indexes` and needs it empty)."""
    tower = _tower(depth, width, mlp, heads, out_hidden, patch=16)
    return dict(tower, num_position_embeddings=position_embeddings, deepstack_visual_indexes=[])


def qwen3_5_text(hidden: int, layers: int, heads: int, kv: int, linear_heads: tuple[int, int]) -> dict:
    """Qwen3.5's hybrid language model: head_dim 256 with 1/4 of it rotating (interleaved mrope
    [11, 11, 10] over the 64 rotating dims), every 4th layer full attention and the others Gated DeltaNet
    with key/value head dim 128 (`linear_heads`: key heads, value heads), conv kernel 4, vocab 248320."""
    return dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=256,
        vocab_size=248320,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=linear_heads[0],
        linear_num_value_heads=linear_heads[1],
        linear_conv_kernel_dim=4,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    )


QWEN2_VL_ROWS: tuple[Published, ...] = (
    _qwen2_vl_published("Qwen/Qwen2-VL-2B-Instruct", (1536, 8960, 28, 12, 2), True),
    _qwen2_vl_published("Qwen/Qwen2-VL-7B-Instruct", (3584, 18944, 28, 28, 4), False),
)
QWEN2_5_VL_ROWS: tuple[Published, ...] = (
    _qwen2_5_vl_published("Qwen/Qwen2.5-VL-3B-Instruct", (2048, 11008, 36, 16, 2), True),
    _qwen2_5_vl_published("Qwen/Qwen2.5-VL-7B-Instruct", (3584, 18944, 28, 28, 4), False),
    _qwen2_5_vl_published("Qwen/Qwen2.5-VL-32B-Instruct", (5120, 27648, 64, 40, 8), False),
    _qwen2_5_vl_published("Qwen/Qwen2.5-VL-72B-Instruct", (8192, 29568, 80, 64, 8), False),
)
QWEN3_VL_ROWS: tuple[Published, ...] = (
    _qwen3_vl_published(
        "Qwen/Qwen3-VL-2B-Instruct", (2048, 6144, 28, 16, 8), (24, 1024, 4096, (5, 11, 17)), True
    ),
    _qwen3_vl_published(
        "Qwen/Qwen3-VL-4B-Instruct", (2560, 9728, 36, 32, 8), (24, 1024, 4096, (5, 11, 17)), True
    ),
    _qwen3_vl_published(
        "Qwen/Qwen3-VL-8B-Instruct", (4096, 12288, 36, 32, 8), (27, 1152, 4304, (8, 16, 24)), False
    ),
    _qwen3_vl_published(
        "Qwen/Qwen3-VL-32B-Instruct", (5120, 25600, 64, 64, 8), (27, 1152, 4304, (8, 16, 24)), False
    ),
)
QWEN3_VL_MOE_ROWS: tuple[Published, ...] = (
    _qwen3_vl_moe_published("Qwen/Qwen3-VL-30B-A3B-Instruct", (2048, 6144, 48, 32, 4), (128, 8, 768)),
    _qwen3_vl_moe_published("Qwen/Qwen3-VL-235B-A22B-Instruct", (4096, 12288, 94, 64, 4), (128, 8, 1536)),
)
QWEN3_5_MOE_ROWS: tuple[Published, ...] = (
    # transformers 5.19's `Qwen3_5MoeTextConfig` defaults (its docstring names this checkpoint) and slime's
    # `qwen3.5-35B-A3B.sh` (hidden 2048, 40 layers, 16 heads, 2 KV heads, 256 experts, top 8, expert MLP 512 and
    # a shared expert of 512, linear attention 16 key / 32 value heads, untied); the vision tower is
    # transformers' `Qwen3_5MoeVisionConfig` default (Qwen3-VL-8B's 27 blocks without DeepStack; a config.json
    # copy in public code agrees on the depth and the empty DeepStack list).
    Published(
        "Qwen/Qwen3.5-35B-A3B",
        dict(
            qwen3_5_text(2048, 40, 16, 2, (16, 32)),
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            num_experts=256,
            num_experts_per_tok=8,
        ),
        qwen3_5_vision(27, 1152, 4304, 16, 2048),
        False,
    ),
    # slime's `qwen3.5-397B-A17B.sh` (hidden 4096, 60 layers, 32 heads, 2 KV heads, 512 experts, top 10, expert
    # MLP 1024 and a shared expert of 1024, untied) and the defaults the JAX port omegalax
    # (`omegalax/models/qwen3_5/config.py`) keeps for this checkpoint, which add linear attention 16 key / 64
    # value heads and the 27-block tower.
    Published(
        "Qwen/Qwen3.5-397B-A17B",
        dict(
            qwen3_5_text(4096, 60, 32, 2, (16, 64)),
            moe_intermediate_size=1024,
            shared_expert_intermediate_size=1024,
            num_experts=512,
            num_experts_per_tok=10,
        ),
        qwen3_5_vision(27, 1152, 4304, 16, 4096),
        False,
    ),
)
SIZES_B: dict[str, float] = {
    "Qwen/Qwen2-VL-2B-Instruct": 2.21,
    "Qwen/Qwen2-VL-7B-Instruct": 8.29,
    "Qwen/Qwen2.5-VL-3B-Instruct": 3.75,
    "Qwen/Qwen2.5-VL-7B-Instruct": 8.29,
    "Qwen/Qwen2.5-VL-32B-Instruct": 33.5,
    "Qwen/Qwen2.5-VL-72B-Instruct": 73.4,
    "Qwen/Qwen3-VL-2B-Instruct": 2.13,
    "Qwen/Qwen3-VL-4B-Instruct": 4.44,
    "Qwen/Qwen3-VL-8B-Instruct": 8.77,
    "Qwen/Qwen3-VL-32B-Instruct": 33.4,
    "Qwen/Qwen3-VL-30B-A3B-Instruct": 31.1,
    "Qwen/Qwen3-VL-235B-A22B-Instruct": 236,
}
"""Published model sizes in billions of parameters (the model cards' figures), checked against the table."""
UNCHECKED_SIZES: frozenset[str] = frozenset(
    {
        "Qwen/Qwen3.5-4B",
        "Qwen/Qwen3.5-9B",
        "Qwen/Qwen3.5-27B",
        "Qwen/Qwen3.5-35B-A3B",
        "Qwen/Qwen3.5-397B-A17B",
    }
)
"""Rows whose parameter count could not be checked against a model card (the Qwen3.5 cards state only the
size in the name); their sources are named at each row."""
QWEN3_5_ROWS: tuple[Published, ...] = (
    # miles' `qwen3.5-4B.sh` (hidden 2560, 32 layers, 16 heads, 4 KV heads, MLP 9216, tied embeddings); linear
    # attention 16 key / 32 value heads and Qwen3-VL-4B's tower without DeepStack (24 blocks, width 1024, MLP
    # 4096) as config.json copies in public code give them.
    Published(
        "Qwen/Qwen3.5-4B",
        dict(qwen3_5_text(2560, 32, 16, 4, (16, 32)), intermediate_size=9216),
        qwen3_5_vision(24, 1024, 4096, 16, 2560),
        True,
    ),
    # transformers 5.19's `Qwen3_5TextConfig` defaults (its docstring: "the Qwen3.5-9B style") and miles'
    # `qwen3.5-9B.sh` (hidden 4096, 32 layers, 16 heads, 4 KV heads, MLP 12288, untied); linear attention
    # 16 key / 32 value heads; Qwen3-VL-8B's tower without DeepStack, as config.json copies give it.
    Published(
        "Qwen/Qwen3.5-9B",
        dict(qwen3_5_text(4096, 32, 16, 4, (16, 32)), intermediate_size=12288),
        qwen3_5_vision(27, 1152, 4304, 16, 4096),
        False,
    ),
    # slime's and miles' `qwen3.5-27B.sh` (hidden 5120, 64 layers, 24 heads, 4 KV heads, MLP 17408, untied);
    # linear attention 16 key / 48 value heads and the 27-block tower as config.json copies give them.
    Published(
        "Qwen/Qwen3.5-27B",
        dict(qwen3_5_text(5120, 64, 24, 4, (16, 48)), intermediate_size=17408),
        qwen3_5_vision(27, 1152, 4304, 16, 5120),
        False,
    ),
)
