"""The accelerators' shared-prompt attention (flex attention with a block mask, models/shared_flex.py) against
the CPU's gathered sdpa (`attention.VARLEN_SDPA`), on the CPU.

* The block mask's rule, evaluated over the whole shared row, is exactly "a token sees its group's prompt and
  its own earlier tokens", built here independently from the batch's segments.
* The tiny Qwen2.5-VL (two-image, text-only and single-sample groups, trained tower) and the tiny Qwen3-VL-MoE
  (routing replay of recorded routes) give the same logprobs, entropy and every parameter's gradient with
  either function, shared and unshared packed rows. torch runs flex attention's forward on the CPU (unfused)
  and refuses its backward there; the gradients are taken with that device check lifted, through torch's
  reference implementation. The fused GPU kernel is tests/gpu's.
* Every layer of a forward asks for the same row: only the first reads the row's positions or copies index
  lists to the device (each would make the host wait for a GPU at every layer), in flex attention and in a
  hybrid model's linear-attention layers.
"""

from __future__ import annotations

import dataclasses
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForImageTextToText, AutoProcessor

from spmd_grpo.actor.logprob_pass import compute_logprobs
from spmd_grpo.actor.micro_batches import collate_for, collate_samples
from spmd_grpo.models.attention import VARLEN_SDPA
from spmd_grpo.models.inputs import mrope_position_ids
from spmd_grpo.models.policy import PolicyModule, unsamplable_token_ids
from spmd_grpo.models.shared_flex import (
    FLEX_SHARED,
    flex_shared_forward,
    shared_prompt_attention,
    shared_row_mask_mod,
)
from tests.conftest import tiny_model
from tests.unit.test_packing import _run
from tests.unit.test_shared_prompt import BASE, _same, group_samples
from tests.unit.test_shared_prompt_moe import by_group, moe_samples, tiny_moe_policy


@pytest.fixture(scope="module")
def tiny():
    d = tiny_model()
    hf = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32, attn_implementation=VARLEN_SDPA)
    return AutoProcessor.from_pretrained(d), PolicyModule(
        hf, unsamplable_token_ids(hf.config), 5, padding_free=True
    )


@pytest.fixture
def flex_backward_on_cpu(monkeypatch) -> list:
    """Let flex attention's reference backward run on the CPU (torch refuses it there by a device check);
    returns the list of the calls' query lengths (that the flex path ran at all)."""
    monkeypatch.setattr(torch_flex, "_validate_device", lambda *_: None)
    calls, real = [], torch_flex.flex_attention

    def counted(query, *args, **kwargs):
        calls.append(query.shape[2])
        return real(query, *args, **kwargs)

    monkeypatch.setattr(torch_flex, "flex_attention", counted)
    return calls


def _expected_visibility(batch) -> torch.Tensor:
    """[T, T] bool from the batch's segments: a prompt token sees its prompt causally; a response token its
    group's prompt and its own response causally."""
    T = batch.input_ids.shape[1]
    visible = torch.zeros(T, T, dtype=torch.bool)
    _, response_starts, prompt_ends = batch.segments()
    for p, r, start, end in zip(
        batch.prompt_lengths.tolist(), batch.response_lengths, response_starts, prompt_ends, strict=True
    ):
        prompt = torch.arange(end - p, end)
        visible[prompt[:, None], prompt[None, :]] |= prompt[None, :] <= prompt[:, None]
        own = torch.arange(start, start + r)
        visible[own[:, None], prompt[None, :]] = True
        visible[own[:, None], own[None, :]] = own[None, :] <= own[:, None]
    return visible


def test_the_block_mask_shows_a_response_its_prompt_and_itself_only(tiny):
    processor, policy = tiny
    for shared in (False, True):
        batch = collate_samples(group_samples(processor), 0, packed=True, shared_prompt=shared)
        positions = mrope_position_ids(policy.hf, batch)[0, 0]
        T = positions.numel()
        q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
        got = shared_row_mask_mod(positions)(0, 0, q, k)
        expected = _expected_visibility(batch)
        assert torch.equal(got, expected)
    _, response_starts, _ = batch.segments()
    assert not got[response_starts[1], response_starts[0]]  # group 0's second response, its first's token
    assert shared_prompt_attention("cuda") == FLEX_SHARED
    assert shared_prompt_attention("cpu") == shared_prompt_attention("npu") == VARLEN_SDPA


def _both_functions(policy, batch, weights):
    out = {}
    for name in (VARLEN_SDPA, FLEX_SHARED):
        policy.hf.set_attn_implementation(name)
        out[name] = _run(policy, batch, weights)
    policy.hf.set_attn_implementation(VARLEN_SDPA)
    return out[VARLEN_SDPA], out[FLEX_SHARED]


@pytest.mark.parametrize("shared", [True, False])
def test_flex_gives_the_gathered_sdpa_results(tiny, flex_backward_on_cpu, shared):
    processor, policy = tiny
    batch = collate_samples(group_samples(processor), 0, packed=True, shared_prompt=shared)
    weights = torch.rand(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
    sdpa, flex = _both_functions(policy, batch, weights)
    _same(sdpa, flex)
    assert any(".visual." in n for n in flex[2])
    assert flex_backward_on_cpu == [batch.input_ids.shape[1]] * policy.config.text_config.num_hidden_layers


def test_flex_gives_the_gathered_sdpa_results_for_moe_with_replayed_routes(flex_backward_on_cpu):
    moe_policy = tiny_moe_policy()
    samples = moe_samples()
    spec = dataclasses.replace(BASE, pad_token_id=0, routing_replay="old")
    moe_policy.shared_prompt = True
    try:
        compute_logprobs(moe_policy, samples, spec)  # records the routes the update replays
        batch = collate_for(moe_policy, by_group(samples), spec, for_update=True)
        assert batch.replay_routes and batch.shares_prompt.sum() == 4
        weights = torch.rand(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
        sdpa, flex = _both_functions(moe_policy, batch, weights)
    finally:
        moe_policy.shared_prompt = False
    _same(sdpa, flex)
    assert flex_backward_on_cpu == [batch.input_ids.shape[1]] * 2  # both decoder layers


class _HostWaits(TorchFunctionMode):
    """The calls, made by the packed-row modules themselves, of the torch functions that make the host wait
    for a CUDA device: reading values back (equal, tolist, item, nonzero, cpu) or copying to it (to,
    tensor)."""

    NAMES = {"equal", "tolist", "item", "nonzero", "cpu", "to", "tensor"}
    MODULES = ("models/attention.py", "models/shared_flex.py", "models/linear_attention.py")

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if torch.compiler.is_compiling():  # flex attention's own graph, traced by dynamo
            return func(*args, **(kwargs or {}))
        caller = sys._getframe(1).f_code
        if getattr(func, "__name__", "") in self.NAMES and caller.co_filename.endswith(self.MODULES):
            self.calls.append(f"{func.__name__} in {caller.co_name}")
        return func(*args, **(kwargs or {}))


def test_only_the_first_layer_of_a_forward_reads_the_row():
    policy = tiny_moe_policy("qwen3_5_moe")
    linear = next(
        layer.linear_attn for layer in policy.hf.model.language_model.layers if hasattr(layer, "linear_attn")
    )
    # a prompt of 30 with its first response (20), then responses of 15 and 10 restarting at 30
    positions = torch.cat([torch.arange(50), torch.arange(30, 45), torch.arange(30, 40)])[None]
    T, H, Hkv, D = positions.shape[1], 4, 2, 16
    module = SimpleNamespace(num_key_value_groups=H // Hkv, is_causal=True, training=False)
    q, k, v = (torch.randn(1, h, T, D) for h in (H, Hkv, Hkv))
    hidden = torch.randn(1, T, policy.config.text_config.hidden_size)
    waits = []
    for _ in range(3):  # three layers of one forward: transformers hands each the same positions tensor
        with _HostWaits() as mode, torch.no_grad():
            flex_shared_forward(module, q, k, v, None, position_ids=positions, scaling=D**-0.5)
            linear.__dict__["_packed_positions"] = positions  # what its decoder layer's pre-hook leaves
            linear(hidden)
        waits.append(mode.calls)
    assert waits[0] and waits[1:] == [[], []], waits
