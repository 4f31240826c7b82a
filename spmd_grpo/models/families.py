"""Model families: everything that differs between Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense and MoE), Qwen3.5
and Qwen3.5-MoE, in one table.

The rest of the package asks `family_of(hf_config)` (or `family_of_model_path(path)` before anything is
built) and never checks a model type itself. A family says:

  * its transformers classes (model, config, processor) and its image patch size (14 for Qwen2-VL and
    Qwen2.5-VL, 16 for the Qwen3 generation; the spatial merge is 2 in all, so one language-model token
    covers 28 x 28 or 32 x 32 pixels);
  * where the vision tower, its blocks and the decoder layers sit in the HF model (the same attribute paths
    in transformers 5.x for all three: `model.visual`, `model.visual.blocks`, `model.language_model.layers`);
    the vision tower of Qwen3-VL also holds the DeepStack mergers and the learnt position embedding, so
    freezing `model.visual` freezes them too;
  * the position ids of a prompt + response: three mrope rows from the model's own `get_rope_index` with
    `mm_token_type_ids` marking the image pad tokens over the WHOLE sequence (response included). The
    signature is the same in the three families; Qwen3-VL's interleaved mrope (T/H/W frequencies
    interleaved instead of in three blocks) lives in its rotary embedding, not in the ids, and its
    DeepStack features (vision features of intermediate ViT blocks added to the first LM layers' hidden
    states at the image tokens) are computed inside the model's forward from `pixel_values`;
  * the on-disk weight names: transformers 5.x nests the language model and the vision tower under
    `model.` in memory (`model.language_model.layers.*`, `model.visual.*`); for Qwen2-VL and Qwen2.5-VL
    `save_pretrained` writes (and the published checkpoints hold) the older layout (`model.layers.*`,
    `visual.*`), for Qwen3-VL the in-memory names. vLLM's `hf_to_vllm_mapper` of each family accepts the
    in-memory names, so the weight push sends those for every family;
  * the layout of its vision tower at any size (`vision_layout`) and its text-config particulars (explicit
    head_dim, interleaved mrope, DeepStack, partial rotary), which both the published rows
    (`architectures`) and the tiny-model builder (`spmd_grpo.tools.make_tiny_model`) use. Qwen3.5 has
    Qwen3-VL's tower without DeepStack and rotates a quarter of each head (partial rotary 0.25: its
    mrope_section sums to head_dim / 8);
  * its sparse MLP (`MoE`: the module classes of the block, experts and router, for what treats experts
    apart, and the fused expert layout: Qwen3-VL-MoE's published checkpoints, and vLLM, hold
    `gate_up_proj`/`down_proj` transposed relative to transformers' memory, so the weight push and the
    export apply `hub_tensors` and the loader transposes back; Qwen3.5-MoE's hold one tensor per expert,
    which the push and the export write too);
  * its linear-attention layers (`LinearAttention`, Qwen3.5's Gated DeltaNet in `layer_types`), which a
    packed row must restart at every sequence (`linear_attention.py`) and which vLLM's CPU build serves in
    bf16 only (`rollout_dtype_error`);
  * tied embeddings come from each checkpoint's config (`tie_word_embeddings`), as for the dense families;
  * the published architectures the `--dry-run` knows without the hub (`architectures.py`).

This module imports neither torch nor transformers at import time (the config layer uses it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from spmd_grpo.models.architectures import (
    QWEN2_5_VL_ROWS,
    QWEN2_VL_ROWS,
    QWEN3_5_MOE_ROWS,
    QWEN3_5_ROWS,
    QWEN3_VL_MOE_ROWS,
    QWEN3_VL_ROWS,
    LinearAttention,
    MoE,
    Published,
    qwen2_5_vl_vision,
    qwen2_vl_vision,
    qwen3_5_vision,
    qwen3_vl_vision,
)
from spmd_grpo.models.architectures import SIZES_B as SIZES_B  # re-exported: the table's sizes
from spmd_grpo.models.architectures import UNCHECKED_SIZES as UNCHECKED_SIZES


@dataclass(frozen=True)
class Family:
    """What differs between the supported model families (see the module docstring)."""

    name: str
    model_type: str
    model_class: str
    config_class: str
    processor_class: str
    patch_size: int
    legacy_weight_names: bool
    """The checkpoint stores `model.layers.*` / `visual.*` rather than the in-memory names."""
    video_processor_class: str
    vision_layout: Callable[..., dict[str, Any]]
    """`vision_layout(depth, width, mlp, heads, out_hidden, **extra)`: the vision_config of this family's tower
    of that size (the module functions `qwen2_vl_vision`, ... below)."""
    published: tuple[Published, ...] = field(default=())
    merge_size: int = 2
    explicit_head_dim: bool = False
    """The text config states head_dim (Qwen3-VL: 128 at every size, also where hidden / heads is not 128)."""
    mrope_interleaved: bool = False
    """T/H/W rotary frequencies interleaved rather than in three blocks (Qwen3-VL)."""
    deepstack: bool = False
    """Vision features of intermediate tower blocks are added to the first decoder layers' hidden states at
    the image tokens (Qwen3-VL's DeepStack; `vision_layout` then takes `deepstack=` block indexes)."""
    moe: MoE | None = None
    """The sparse MLP of a mixture-of-experts language model (None: dense MLPs)."""
    linear_attention: LinearAttention | None = None
    """Gated DeltaNet layers mixed with full-attention layers (Qwen3.5; None: full attention everywhere). With
    shared prompts the prompt's final recurrent and convolution state seeds each response
    (`linear_attention.py`)."""
    video_timestamps: bool = False
    """Each temporal patch of a video is its own frame group behind a timestamp in the text (the Qwen3
    generation); its mrope positions are laid out per frame group (`video_rope_index(frames_split=...)`)."""
    partial_rotary_factor: float = 1.0
    """The share of each attention head's dimensions that rotate (Qwen3.5: 0.25); mrope_section sums to
    head_dim x this / 2."""

    @property
    def reusable_image_features(self) -> bool:
        """The tower's final output is all the language model takes from it, so features encoded once can stand
        in for the pixels (`worker.actor.reuse_image_features`). Not with DeepStack: the reuse path carries
        only the final features, so such a model re-encodes."""
        return not self.deepstack

    @property
    def image_factor(self) -> int:
        """Pixels per image-token side: patch size x spatial merge."""
        return self.patch_size * self.merge_size

    def model_cls(self):
        import transformers

        return getattr(transformers, self.model_class)

    def config_cls(self):
        import transformers

        return getattr(transformers, self.config_class)

    def processor_cls(self):
        import transformers

        return getattr(transformers, self.processor_class)

    def video_processor_cls(self):
        import transformers

        return getattr(transformers, self.video_processor_class)

    @staticmethod
    def vision_tower(hf_model):
        """The vision tower (patch embedding, blocks, mergers; Qwen3-VL: DeepStack mergers too)."""
        return hf_model.model.visual

    def vision_blocks(self, hf_model) -> list:
        return list(self.vision_tower(hf_model).blocks)

    @staticmethod
    def decoder_layers(hf_model):
        """The language model's decoder layers (an nn.ModuleList, replaceable in place)."""
        return hf_model.model.language_model.layers

    def position_ids(
        self,
        hf_model,
        input_ids,
        attention_mask,
        image_grid_thw,
        *,
        video_grid_thw=None,
        second_per_grid_ts=None,
    ):
        """[3, B, L] mrope positions of right-padded prompt + response sequences (what vLLM uses). Without
        videos: the model's `get_rope_index` (image pad tokens typed 1). With videos: `video_rope_index`,
        vLLM's rule, where transformers 5.19 continues the text after a video at another position;
        `second_per_grid_ts` (seconds per temporal patch) scales Qwen2.5-VL's video time axis (Qwen3-VL's
        time is in the timestamp tokens of the text)."""
        import torch

        config = hf_model.config
        if video_grid_thw is not None:
            from spmd_grpo.models.video_rope import video_rope_index

            return video_rope_index(
                config,
                input_ids,
                attention_mask,
                image_grid_thw,
                video_grid_thw,
                second_per_grid_ts,
                frames_split=self.video_timestamps,
            )
        mm_token_type_ids = (input_ids == config.image_token_id).to(torch.int32)
        position_ids, _ = hf_model.model.get_rope_index(
            input_ids,
            mm_token_type_ids=mm_token_type_ids,
            image_grid_thw=image_grid_thw,
            attention_mask=attention_mask,
        )
        return position_ids

    def on_disk_name(self, name: str) -> str:
        """The checkpoint's name of an in-memory parameter name (see the module docstring)."""
        if not self.legacy_weight_names:
            return name
        if name.startswith("model.language_model."):
            return "model." + name.removeprefix("model.language_model.")
        if name.startswith("model.visual."):
            return name.removeprefix("model.")
        return name

    def hub_tensors(self, name: str, tensor):
        """`(name, tensor)` pairs of the parameter `name` (transformers' memory layout) as the published
        checkpoints hold it and vLLM's loader reads it: a `hub_transposed` MoE family's fused experts
        transposed (views), a `hub_per_expert` one's split into one tensor per expert, everything else as is."""
        moe = self.moe
        if moe is None or not moe.is_fused_expert(name):
            yield name, tensor
        elif moe.hub_transposed:
            yield name, tensor.transpose(-1, -2)
        else:  # one tensor per expert: gate_up_proj [E, 2I, H] -> gate, up [I, H]; down_proj [E, H, I]
            prefix, weight = name.rsplit(".", 1)
            for e in range(tensor.shape[0]):
                if weight == "gate_up_proj":
                    gate, up = tensor[e].chunk(2)
                    yield f"{prefix}.{e}.gate_proj.weight", gate
                    yield f"{prefix}.{e}.up_proj.weight", up
                else:
                    yield f"{prefix}.{e}.down_proj.weight", tensor[e]

    def checkpoint_config_error(self, config: dict) -> str | None:
        """Why a checkpoint's config.json would make vLLM compute another model than the trainer, or None.
        transformers' routers renormalise the top-k probabilities whatever `norm_topk_prob` says; vLLM obeys
        it: `false` gives every MoE layer output scaled by the top-k mass in vLLM only."""
        if self.moe is not None and config.get("text_config", {}).get("norm_topk_prob") is False:
            return (
                "text_config.norm_topk_prob is false, but transformers always renormalises the top-k and vLLM "
                "would not (the two would compute different models); set it to true, as the published "
                "checkpoints do"
            )
        return None

    def rollout_dtype_error(self, dtype: str, device_type: str) -> str | None:
        """Why vLLM cannot serve this family in `dtype` on `device_type`, or None when it can."""
        la = self.linear_attention
        if la is not None and device_type == "cpu" and dtype != la.vllm_cpu_dtype:
            return (
                f"{self.name}'s linear-attention layers run in vLLM's CPU build only in {la.vllm_cpu_dtype} "
                f"(got {dtype})"
            )
        return None

    def published_config(self, model_id: str):
        """The HF config of one of `published` (built from the table, no hub)."""
        arch = next(p for p in self.published if p.model_id == model_id)
        text = dict(arch.text, tie_word_embeddings=arch.tie_word_embeddings)
        return self.config_cls()(
            text_config=text, vision_config=dict(arch.vision), tie_word_embeddings=arch.tie_word_embeddings
        )


QWEN2_VL = Family(
    name="Qwen2-VL",
    model_type="qwen2_vl",
    model_class="Qwen2VLForConditionalGeneration",
    config_class="Qwen2VLConfig",
    processor_class="Qwen2VLProcessor",
    video_processor_class="Qwen2VLVideoProcessor",
    vision_layout=qwen2_vl_vision,
    patch_size=14,
    legacy_weight_names=True,
    published=QWEN2_VL_ROWS,
)
QWEN2_5_VL = Family(
    name="Qwen2.5-VL",
    model_type="qwen2_5_vl",
    model_class="Qwen2_5_VLForConditionalGeneration",
    config_class="Qwen2_5_VLConfig",
    processor_class="Qwen2_5_VLProcessor",
    video_processor_class="Qwen2VLVideoProcessor",
    vision_layout=qwen2_5_vl_vision,
    patch_size=14,
    legacy_weight_names=True,
    published=QWEN2_5_VL_ROWS,
)
QWEN3_VL = Family(
    video_timestamps=True,
    name="Qwen3-VL",
    model_type="qwen3_vl",
    model_class="Qwen3VLForConditionalGeneration",
    config_class="Qwen3VLConfig",
    processor_class="Qwen3VLProcessor",
    video_processor_class="Qwen3VLVideoProcessor",
    vision_layout=qwen3_vl_vision,
    patch_size=16,
    legacy_weight_names=False,
    explicit_head_dim=True,
    mrope_interleaved=True,
    deepstack=True,
    published=QWEN3_VL_ROWS,
)
QWEN3_VL_MOE = replace(  # Qwen3-VL with a sparse MLP in every decoder layer
    QWEN3_VL,
    name="Qwen3-VL-MoE",
    model_type="qwen3_vl_moe",
    model_class="Qwen3VLMoeForConditionalGeneration",
    config_class="Qwen3VLMoeConfig",
    moe=MoE(
        block_class="Qwen3VLMoeTextSparseMoeBlock",
        experts_class="Qwen3VLMoeTextExperts",
        router_class="Qwen3VLMoeTextTopKRouter",
        hub_transposed=True,
    ),
    published=QWEN3_VL_MOE_ROWS,
)
QWEN3_5 = Family(
    video_timestamps=True,
    name="Qwen3.5",
    model_type="qwen3_5",
    model_class="Qwen3_5ForConditionalGeneration",
    config_class="Qwen3_5Config",
    processor_class="Qwen3VLProcessor",
    video_processor_class="Qwen3VLVideoProcessor",
    vision_layout=qwen3_5_vision,
    patch_size=16,
    legacy_weight_names=False,
    explicit_head_dim=True,
    mrope_interleaved=True,
    partial_rotary_factor=0.25,
    linear_attention=LinearAttention(module_class="Qwen3_5GatedDeltaNet"),
    published=QWEN3_5_ROWS,
)
QWEN3_5_MOE = replace(  # Qwen3.5 with routed experts and a shared expert in every decoder layer
    QWEN3_5,
    name="Qwen3.5-MoE",
    model_type="qwen3_5_moe",
    model_class="Qwen3_5MoeForConditionalGeneration",
    config_class="Qwen3_5MoeConfig",
    linear_attention=LinearAttention(module_class="Qwen3_5MoeGatedDeltaNet"),
    moe=MoE(
        block_class="Qwen3_5MoeSparseMoeBlock",
        experts_class="Qwen3_5MoeExperts",
        router_class="Qwen3_5MoeTopKRouter",
        hub_transposed=False,
        shared_expert=True,
    ),
    published=QWEN3_5_MOE_ROWS,
)
FAMILIES: dict[str, Family] = {
    f.model_type: f for f in (QWEN2_VL, QWEN2_5_VL, QWEN3_VL, QWEN3_VL_MOE, QWEN3_5, QWEN3_5_MOE)
}
PUBLISHED: dict[str, Family] = {p.model_id: f for f in FAMILIES.values() for p in f.published}


def supported() -> str:
    """The supported families, for error messages."""
    return ", ".join(f"{f.name} (model_type {f.model_type})" for f in FAMILIES.values())


def family_for_type(model_type: str | None, where: str = "the model") -> Family:
    """The family of a config's `model_type`; an unknown one is a ValueError listing the supported ones."""
    if model_type not in FAMILIES:
        raise ValueError(
            f"{where} has model_type {model_type!r}, which is not supported; supported: {supported()}"
        )
    return FAMILIES[model_type]


def family_of(hf_config) -> Family:
    """The family of an HF config object."""
    return family_for_type(getattr(hf_config, "model_type", None))


def family_of_model_path(model_path: str) -> Family | None:
    """The family of a model path before anything is built: a local directory's config.json, a published id
    of the table, or a hub id's config already in the local HF cache; None when it cannot be told offline
    (the model build then asks `family_of` on the downloaded config). Raises ValueError for a known but
    unsupported model_type."""
    path = Path(model_path)
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ValueError(f"{model_path} has no config.json")
        try:
            model_type = json.loads(config.read_text()).get("model_type")
        except ValueError as e:
            raise ValueError(f"{config} is not JSON ({e})") from None
        except AttributeError:
            raise ValueError(f"{config} is not a JSON object") from None
        return family_for_type(model_type, str(config))
    if model_path in PUBLISHED:
        return PUBLISHED[model_path]
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model_path, "config.json")
    except Exception:  # not a valid repo id: the build will say so
        return None
    if isinstance(cached, str):
        return family_for_type(json.loads(Path(cached).read_text()).get("model_type"), model_path)
    return None
