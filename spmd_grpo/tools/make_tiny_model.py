"""Build a tiny random checkpoint of any supported family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5,
Qwen3.5-MoE) with no download: model, tokenizer, chat template, processor.

    python -m spmd_grpo.tools.make_tiny_model OUT_DIR [--family qwen3_vl] [--seed S] [--tie-word-embeddings] ...

The result loads in transformers (`AutoModelForImageTextToText`, `AutoProcessor`) and in vLLM, exactly like a
real directory of that family, so tests and the smoke job exercise the production loading path.
Deterministic for a seed (same bytes for the same seed and options). `--family` is a model_type of
`spmd_grpo.models.families` (default qwen2_5_vl).

Constraints from vLLM's CPU backend: its attention supports only some head sizes (32, 64, 80, ...), so
head_dim is 32 or 64, and mrope_section must sum to the rotating dims / 2 (head_dim / 2; Qwen3.5 rotates a
quarter). MoE families: every layer sparse, `num_experts` (8) experts, top `num_experts_per_tok` (2),
renormalised; the expert width (96) makes no expert tensor square, and the file
holds the published expert layout (`save_model`). Qwen3.5 families: linear-attention and full-attention
layers alternate, the Gated DeltaNet key/value head dim is 128, the only one vLLM's CPU kernel takes
(which also runs only in bf16: serve these with `dtype=bfloat16`), and its heads keep their state for a few
tokens (`moderate_decays`).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# Qwen2-VL / Qwen2.5-VL's own chat template (as shipped in their tokenizer_config.json).
QWEN_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Text the BPE merges are learnt from: chat scaffolding, the smoke task's words, geometry-style problems.
_CORPUS = [
    "system\nYou are a helpful assistant.\nuser\nassistant\n",
    "Which color is the image? Answer with a digit. How many shapes are there? Answer with one digit.",
    "red green blue yellow black white 0 1 2 3 4 5 6 7 8 9 10 12 15 20 25 30 45 60 90 180 360",
    "Find x. Find the area of the triangle. Find the measure of angle ABC. Round to the nearest tenth.",
    "You FIRST think about the reasoning process as an internal monologue and then provide the final answer.",
    "The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \\boxed{}.",
    "<think> the answer is </think> \\boxed{4} \\frac{1}{2} \\sqrt{3} \\pi x^2 + y = 7.5 degrees",
]


@dataclass(frozen=True)
class TinyModelSpec:
    family: str = "qwen2_5_vl"
    seed: int = 0
    tie_word_embeddings: bool = False
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    vision_hidden_size: int = 64
    vision_depth: int = 2
    vision_num_heads: int = 2
    vocab_merges: int = 200
    init_std: float = 0.02
    head_logit_std: float | None = None  # None: the head as HF's init draws it (initializer_range)
    # Mixture-of-experts families (every layer sparse). The expert MLP width differs from hidden_size and
    # hidden_size / 2 so that no expert tensor is square: a transposed expert then fails on shape instead of
    # loading silently.
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 96
    # Hybrid (Gated DeltaNet) families: vLLM's CPU kernel needs key/value head dim 128.
    linear_head_dim: int = 128
    linear_num_heads: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def build_tokenizer(num_merges: int):
    """Byte-level BPE trained on a fixed corpus; deterministic. Returns a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + num_merges,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    # Specials are added after training so their ids sit at the end, as in Qwen's vocabulary.
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = QWEN_VL_CHAT_TEMPLATE
    return fast


def make_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write a tiny random model of `spec.family` (model + tokenizer + processor) into out_dir and return it."""
    from spmd_grpo.models.families import family_for_type

    family = family_for_type(spec.family, "TinyModelSpec.family")
    if spec.head_dim not in (32, 64):
        raise ValueError(f"head_dim {spec.head_dim} not supported by vLLM's CPU attention: use 32 or 64")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(spec.vocab_merges)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = tiny_config(spec, ids, len(tokenizer))
    torch.manual_seed(spec.seed)
    model = family.model_cls()(config).to(torch.float32)
    if spec.head_logit_std is not None:
        _draw_head(model, spec)
    moderate_decays(model)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    save_model(model, out)
    _save_processor(out, tokenizer, family)
    (out / "tiny_model_spec.json").write_text(json.dumps(asdict(spec), indent=1))
    return out


def save_model(model, out: Path) -> None:
    """`save_pretrained`, then the weights rewritten in the published expert layout where transformers saves
    another one (Qwen3-VL-MoE's fused experts: `save_pretrained` writes its memory layout, which vLLM refuses;
    Qwen3.5-MoE's per-expert tensors are already what `save_pretrained` writes)."""
    from safetensors.torch import load_file, save_file

    from spmd_grpo.models.families import family_of

    model.save_pretrained(out, safe_serialization=True)
    family = family_of(model.config)
    if family.moe is None:
        return
    path = out / "model.safetensors"
    tensors = {
        n: t.contiguous() for k, v in load_file(str(path)).items() for n, t in family.hub_tensors(k, v)
    }
    save_file(tensors, str(path), metadata={"format": "pt"})


def _draw_head(model, spec: TinyModelSpec) -> None:
    """Redraw the output head (the shared embedding when tied) at std `head_logit_std / sqrt(hidden_size)`:
    logits at init then have a std of about `head_logit_std` nats whatever the width.

    Why a model may need it: after the final RMSNorm a hidden state has norm sqrt(hidden_size), so a token's
    logit can be raised by at most |head row| * sqrt(hidden_size), which is sqrt(hidden_size) times the spread
    of the logits at init. A run that trains only below a frozen head (LoRA on every linear layer) has no
    other way to make an answer likely. HF's init (0.02) at width 64 leaves a token 1.3 nats of reach: no
    answer digit of the colour task gets above ~2 % (a supervised LoRA fit stalls at 1.4 %). A trained model
    has tens of nats. `spmd_grpo.smoke`'s model is 256 wide with head_logit_std 0.6: 9.8 nats of reach, an
    initial entropy of 6.06 nats over the 512 tokens (uniform: 6.24), and a supervised LoRA fit reaches 97 %
    (`benchmarks/head_reach.py`).
    """
    std = spec.head_logit_std / spec.hidden_size**0.5
    generator = torch.Generator().manual_seed(spec.seed + 1)
    weight = model.get_output_embeddings().weight
    with torch.no_grad():
        weight.copy_(torch.randn(weight.shape, generator=generator) * std)


def moderate_decays(model) -> None:
    """Give each Gated DeltaNet head of `model` a decay that keeps its state for a few tokens: exp(A_log) from
    0.05 to 0.5 over the heads, so exp(g) runs from ~0.94 to ~0.52 per token at init (per token
    g = -exp(A_log) * softplus(a + dt_bias)). HF draws exp(A_log) from uniform(0, 16); the tiny models' 2
    heads got 8.7 and 11.5, g of -11 to -15: a state forgotten at every token, so no test could see whether it
    is carried (from a prompt into its responses, from vLLM's prefill into its decode), and decay gradients of
    ~3e-8 that transformers' chunked delta rule (its CPU path) gets 50 % wrong in fp64 against the
    token-by-token rule. Used by the builder and by the tests' hand-configured tiny MoE models."""
    for module in model.modules():
        if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
            rates = torch.linspace(0.05, 0.5, module.A_log.numel())
            with torch.no_grad():
                module.A_log.copy_(rates.log().reshape(module.A_log.shape))


def _mrope_section(rotary_dim: int) -> list[int]:
    half = rotary_dim // 2
    return [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]


def _text_config(spec: TinyModelSpec, family, ids: dict[str, int], vocab_size: int) -> dict:
    rotary_dim = int(spec.head_dim * family.partial_rotary_factor)
    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": _mrope_section(rotary_dim)}
    if family.mrope_interleaved:
        rope["mrope_interleaved"] = True
    if family.partial_rotary_factor != 1.0:
        rope["partial_rotary_factor"] = family.partial_rotary_factor
    text = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=8192,
        rope_parameters=rope,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        initializer_range=spec.init_std,
        tie_word_embeddings=spec.tie_word_embeddings,
    )
    if family.explicit_head_dim:
        text["head_dim"] = spec.head_dim
    if family.moe is not None:
        text.update(
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size,
            norm_topk_prob=True,  # what transformers' router does; vLLM reads the flag
        )
        if family.moe.shared_expert:
            text["shared_expert_intermediate_size"] = spec.moe_intermediate_size
        else:
            text.update(decoder_sparse_step=1, mlp_only_layers=[])
    if family.linear_attention is not None:
        layers = spec.num_hidden_layers
        text.update(
            linear_key_head_dim=spec.linear_head_dim,
            linear_value_head_dim=spec.linear_head_dim,
            linear_num_key_heads=spec.linear_num_heads,
            linear_num_value_heads=spec.linear_num_heads,
            linear_conv_kernel_dim=4,
            # every other layer full attention, the last one included (published: every 4th)
            layer_types=["full_attention" if i % 2 else "linear_attention" for i in range(layers)],
        )
    return text


def _vision_config(spec: TinyModelSpec, family) -> dict:
    """The family's vision tower at tiny size (its published layout, fewer and narrower blocks, MLP 2x wide);
    a DeepStack tower (Qwen3-VL) feeds every block to the language model, as far as it has layers."""
    width, depth = spec.vision_hidden_size, spec.vision_depth
    extra = {}
    if family.patch_size == 16:  # the Qwen3-VL tower: learnt position embeddings, a square count
        extra["position_embeddings"] = 144
    if family.deepstack:
        extra["deepstack"] = range(min(depth, spec.num_hidden_layers))
    layout = family.vision_layout(depth, width, 2 * width, spec.vision_num_heads, spec.hidden_size, **extra)
    return dict(
        layout,
        initializer_range=spec.init_std,
        spatial_merge_size=family.merge_size,
        temporal_patch_size=2,
    )


def tiny_config(spec: TinyModelSpec, ids: dict[str, int], num_tokens: int):
    """The HF config of `spec`, for a tokenizer of `num_tokens` tokens whose special-token ids are `ids`."""
    from spmd_grpo.models.families import family_for_type

    family = family_for_type(spec.family, "TinyModelSpec.family")
    vocab_size = num_tokens + -num_tokens % 64  # padded like real checkpoints (vLLM shards the vocab)
    config = family.config_cls()(
        text_config=_text_config(spec, family, ids, vocab_size),
        vision_config=_vision_config(spec, family),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=spec.tie_word_embeddings,
    )
    config.architectures = [family.model_class]
    return config


def _save_processor(out: Path, tokenizer, family) -> None:
    """The family's processor (image and video processors, tokenizer, chat template) into `out`."""
    from transformers import Qwen2VLImageProcessor

    patch = family.patch_size
    image_processor = Qwen2VLImageProcessor(
        min_pixels=3136, max_pixels=262144, patch_size=patch, merge_size=family.merge_size
    )
    processor = family.processor_cls()(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=_video_processor(family),
        chat_template=QWEN_VL_CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)


def _video_processor(family):
    return family.video_processor_cls()(patch_size=family.patch_size, merge_size=family.merge_size)


def cached_tiny_model(cache_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """A tiny model for `spec` under cache_dir, built on first use; keyed by the spec and this file's code."""
    import hashlib
    import os
    import shutil

    key = hashlib.sha1(
        json.dumps(asdict(spec), sort_keys=True).encode() + Path(__file__).read_bytes()
    ).hexdigest()
    out = Path(cache_dir) / "tiny_models" / key[:12]
    if not (out / "model.safetensors").exists():
        tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
        make_tiny_model(tmp, spec)
        if out.exists():  # another process finished first: keep its copy
            shutil.rmtree(tmp)
        else:
            tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    for f, default in asdict(TinyModelSpec()).items():
        flag = "--" + f.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", default=default)
        elif default is None:  # head_logit_std: a float, None keeping HF's init
            parser.add_argument(flag, type=float, default=None)
        else:
            parser.add_argument(flag, type=type(default), default=default)
    args = vars(parser.parse_args(argv))
    args_family = args["family"]
    out = make_tiny_model(args.pop("out_dir"), TinyModelSpec(**args))
    num_params = sum(
        v.numel()
        for v in __import__("safetensors.torch").torch.load_file(str(out / "model.safetensors")).values()
    )
    print(f"wrote tiny {args_family} ({num_params / 1e6:.2f}M parameters) to {out}")


if __name__ == "__main__":
    main()
