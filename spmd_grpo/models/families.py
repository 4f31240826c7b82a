"""Model families: everything that differs between Qwen2-VL, Qwen2.5-VL and Qwen3-VL (dense), in one table.

The rest of the package asks `family_of(hf_config)` (or `family_of_model_path(path)` before anything is
built) and never checks a model type itself. A family says:

  * its transformers classes (model, config, processor) and its image patch size (14 for Qwen2-VL and
    Qwen2.5-VL, 16 for Qwen3-VL; the spatial merge is 2 in all three, so one language-model token covers
    28 x 28 or 32 x 32 pixels);
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
    head_dim, interleaved mrope, DeepStack), which both the published rows below and the tiny-model builder
    (`spmd_grpo.tools.make_tiny_model`) use;
  * the published architectures the `--dry-run` knows without the hub.

This module imports neither torch nor transformers at import time (the config layer uses it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Published:
    """The architecture of a published checkpoint (values of its config.json), for `--dry-run` offline."""

    model_id: str
    text: dict[str, Any]
    """text_config fields: hidden_size, intermediate_size, num_hidden_layers, heads, vocab_size, ..."""
    vision: dict[str, Any]
    tie_word_embeddings: bool


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
    of that size (the module functions `_qwen2_vl_vision`, ... below)."""
    published: tuple[Published, ...] = field(default=())
    merge_size: int = 2
    explicit_head_dim: bool = False
    """The text config states head_dim (Qwen3-VL: 128 at every size, also where hidden / heads is not 128)."""
    mrope_interleaved: bool = False
    """T/H/W rotary frequencies interleaved rather than in three blocks (Qwen3-VL)."""
    deepstack: bool = False
    """Vision features of intermediate tower blocks are added to the first decoder layers' hidden states at
    the image tokens (Qwen3-VL's DeepStack; `vision_layout` then takes `deepstack=` block indexes)."""
    linear_attention: bool = False
    """Some decoder layers are linear attention (a recurrent state and a causal convolution over the
    sequence). A shared prompt would need the prompt's final state to seed each response, which is not
    done: shared prompts are off for such a family (`worker.actor.shared_prompt`)."""

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

    @staticmethod
    def position_ids(
        hf_model, input_ids, attention_mask, image_grid_thw, *, video_grid_thw=None, second_per_grid_ts=None
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
                frames_split=config.model_type == "qwen3_vl",
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

    def published_config(self, model_id: str):
        """The HF config of one of `published` (built from the table, no hub)."""
        arch = next(p for p in self.published if p.model_id == model_id)
        text = dict(arch.text, tie_word_embeddings=arch.tie_word_embeddings)
        return self.config_cls()(
            text_config=text, vision_config=dict(arch.vision), tie_word_embeddings=arch.tie_word_embeddings
        )


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


def _qwen2_vl_vision(depth: int, width: int, mlp: int, heads: int, out_hidden: int) -> dict[str, Any]:
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


def _qwen2_5_vl_vision(depth: int, width: int, mlp: int, heads: int, out_hidden: int) -> dict[str, Any]:
    """Qwen2.5-VL's tower: RMSNorm blocks with window attention (112 pixels), full attention in every 8th block
    and the last (7/15/23/31 at depth 32)."""
    full = [i for i in range(depth) if (i + 1) % 8 == 0 or i == depth - 1]
    tower = _tower(depth, width, mlp, heads, out_hidden, patch=14)
    return dict(tower, window_size=112, fullatt_block_indexes=full)


def _qwen3_vl_vision(
    depth: int, width: int, mlp: int, heads: int, out_hidden: int, *, deepstack=(), position_embeddings=2304
) -> dict[str, Any]:
    """Qwen3-VL's tower: patch 16, learnt position embeddings (a square count), DeepStack mergers after the
    blocks `deepstack`."""
    tower = _tower(depth, width, mlp, heads, out_hidden, patch=16)
    return dict(tower, num_position_embeddings=position_embeddings, deepstack_visual_indexes=list(deepstack))


def _qwen2_vl_published(model_id: str, text: tuple[int, int, int, int, int], tie: bool) -> Published:
    """Qwen2-VL instruct: vocab 152064 (151936 when tied), rope theta 1e6, mrope [16, 24, 24]; vision tower
    of 32 blocks, width 1280, MLP ratio 4, 16 heads, patch 14, merge 2."""
    vision = _qwen2_vl_vision(32, 1280, 5120, 16, text[0])
    return Published(model_id, _qwen2_text(text, tie), vision, tie)


def _qwen2_5_vl_published(model_id: str, text: tuple[int, int, int, int, int], tie: bool) -> Published:
    """Qwen2.5-VL instruct: rope theta 1e6, mrope [16, 24, 24]; vision tower of 32 blocks, width 1280, MLP
    3420, 16 heads, patch 14, merge 2, full attention in blocks 7/15/23/31 (window attention elsewhere)."""
    vision = _qwen2_5_vl_vision(32, 1280, 3420, 16, text[0])
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
    vision_cfg = _qwen3_vl_vision(depth, width, mlp, 16, hidden, deepstack=deepstack)
    return Published(model_id, text_cfg, vision_cfg, tie)


# Values of the published config.json files. Each row's parameter count, built on the meta device, must equal
# its published model size (`SIZES_B`, tested), which catches a wrong width or depth. The two 2B rows were
# not read from a published config.json but put together from partial public copies; the count settles the
# one value those copies disagree on, the 2B MLP width: Qwen3-VL-2B's language model is Qwen3-1.7B's (MLP
# 6144 gives 2.13B; the 5632 and 8192 seen elsewhere give 2.04B and 2.48B), Qwen2-VL-2B's is Qwen2-1.5B's
# (MLP 8960 gives 2.21B).
QWEN2_VL = Family(
    name="Qwen2-VL",
    model_type="qwen2_vl",
    model_class="Qwen2VLForConditionalGeneration",
    config_class="Qwen2VLConfig",
    processor_class="Qwen2VLProcessor",
    video_processor_class="Qwen2VLVideoProcessor",
    vision_layout=_qwen2_vl_vision,
    patch_size=14,
    legacy_weight_names=True,
    published=(
        _qwen2_vl_published("Qwen/Qwen2-VL-2B-Instruct", (1536, 8960, 28, 12, 2), True),
        _qwen2_vl_published("Qwen/Qwen2-VL-7B-Instruct", (3584, 18944, 28, 28, 4), False),
    ),
)
QWEN2_5_VL = Family(
    name="Qwen2.5-VL",
    model_type="qwen2_5_vl",
    model_class="Qwen2_5_VLForConditionalGeneration",
    config_class="Qwen2_5_VLConfig",
    processor_class="Qwen2_5_VLProcessor",
    video_processor_class="Qwen2VLVideoProcessor",
    vision_layout=_qwen2_5_vl_vision,
    patch_size=14,
    legacy_weight_names=True,
    published=(
        _qwen2_5_vl_published("Qwen/Qwen2.5-VL-3B-Instruct", (2048, 11008, 36, 16, 2), True),
        _qwen2_5_vl_published("Qwen/Qwen2.5-VL-7B-Instruct", (3584, 18944, 28, 28, 4), False),
        _qwen2_5_vl_published("Qwen/Qwen2.5-VL-32B-Instruct", (5120, 27648, 64, 40, 8), False),
        _qwen2_5_vl_published("Qwen/Qwen2.5-VL-72B-Instruct", (8192, 29568, 80, 64, 8), False),
    ),
)
QWEN3_VL = Family(
    name="Qwen3-VL",
    model_type="qwen3_vl",
    model_class="Qwen3VLForConditionalGeneration",
    config_class="Qwen3VLConfig",
    processor_class="Qwen3VLProcessor",
    video_processor_class="Qwen3VLVideoProcessor",
    vision_layout=_qwen3_vl_vision,
    patch_size=16,
    legacy_weight_names=False,
    explicit_head_dim=True,
    mrope_interleaved=True,
    deepstack=True,
    published=(
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
    ),
)
FAMILIES: dict[str, Family] = {f.model_type: f for f in (QWEN2_VL, QWEN2_5_VL, QWEN3_VL)}
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
}
"""Published model sizes in billions of parameters (the model cards' figures), checked against the table."""

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
        return family_for_type(json.loads(config.read_text()).get("model_type"), str(config))
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
