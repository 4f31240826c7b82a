"""Trainer-side logprobs and entropy of response tokens, matching what vLLM sampled from.

Shapes: B sequences in a micro-batch, L = padded prompt+response length, R = padded response length,
N = number of valid response tokens in the micro-batch, H = hidden size, V = vocabulary.

Correctness: Qwen-VL models need mrope positions over the WHOLE prompt+response; given only input_ids,
attention_mask and the images, transformers 5.x silently uses wrong positions for the response tokens
(per-token logprob errors of 1-18 nats against vLLM, measured on a tiny Qwen2.5-VL in fp32, no warning).
We compute `position_ids` [3, B, L] explicitly, as the model's family says (`families.Family.position_ids`:
the model's `get_rope_index` with `mm_token_type_ids`, 1 on image pad tokens, 0 elsewhere, response
included; with videos, `models.video_rope`, vLLM's rule), and pass them in. Video inputs
(`pixel_values_videos`, `video_grid_thw`, Qwen2.5-VL's `second_per_grid_ts`) go to the model as they are.

Padding-free (`worker.actor.padding_free`): a micro-batch's sequences are packed back to back into one row
with no attention mask, and the positions get a 4th row (first) of plain per-sequence text positions.
transformers 5.x reads it to keep attention inside each sequence: varlen `cu_seqlens` with flash attention
(CUDA, and Ascend's fused kernel behind the same name), causal sdpa per sequence length on the CPU
(`attention.VARLEN_SDPA`), flex attention with the row's block mask (CUDA without `flash_attn`:
`shared_flex`). Logprobs, entropy and gradients equal the padded forward's to fp32 rounding
(tests/unit/test_packing.py on the CPU; tests/gpu on CUDA). No padding token is computed.

Image features (`ImageBatch`, `SequenceBatch.image_features`): the root module can run the vision tower
alone and take its output back instead of pixels (transformers' `mm_encoder_outputs`, matched to the image
pad tokens in order), so a frozen tower encodes each prompt's images once per step (actor.image_features.encode_images).

The distribution is vLLM's `processed_logprobs`: logits / temperature with the unsamplable vision tokens at
-inf. top-p / top-k truncation is NOT applied (as in verl): with top_p < 1 the logged
`rollout/logprob_diff_*` includes that truncation, by design.

Memory: the root module (`PolicyModule`) returns only what is needed. Hidden states of the N tokens that
predict response tokens are projected to the vocabulary in chunks of `chunk_size` tokens under activation
checkpointing, so neither forward nor backward holds more than one [chunk, V] fp32 block of logits (a
152k vocabulary never materialises a [N, V] fp32 log-softmax).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from spmd_grpo.models.families import family_of
from spmd_grpo.models.inputs import (
    ImageBatch,
    SequenceBatch,
    dummy_image,
    mrope_position_ids,
    response_token_index,
)
from spmd_grpo.models.linear_attention import split_packed_linear_attention
from spmd_grpo.models.lora import head_parts
from spmd_grpo.models.moe.routing import MoEState

VISION_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def unsamplable_token_ids(hf_config) -> list[int]:
    """Token ids that must never be sampled (the vision placeholders), read from the model config."""
    return sorted(
        {int(getattr(hf_config, k)) for k in VISION_TOKEN_KEYS if getattr(hf_config, k, None) is not None}
    )


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor in a model output (nested tuples, lists, dicts and `ModelOutput`s)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list | tuple) else ()
    return [t for v in values for t in _tensors(v)]


def _head_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, adapter: tuple | None
) -> torch.Tensor:
    """The output head's logits; with a LoRA adapter on the head (A, B, scale, dropout) as PEFT computes
    them: base(x) + scale * B(A(dropout(x)))."""
    logits = F.linear(hidden, weight, bias)
    if adapter is not None:
        a, b, scale, dropout = adapter
        logits = logits + scale * F.linear(F.linear(dropout(hidden), a), b)
    return logits


def _chunk_logprob_entropy(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    inv_temperature: float,
    suppress_ids: torch.Tensor,
    with_entropy: bool,
    adapter: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = _head_logits(hidden, weight, bias, adapter).float() * inv_temperature  # [chunk, V]
    if suppress_ids.numel():
        logits = logits.index_fill(1, suppress_ids, float("-inf"))
    logz = torch.logsumexp(logits, dim=-1)
    logprob = logits.gather(1, targets[:, None]).squeeze(1) - logz
    if not with_entropy:
        return logprob, torch.zeros_like(logprob)
    probs = torch.softmax(logits, dim=-1)
    # -inf * 0 would be nan: suppressed tokens have probability 0 and contribute nothing.
    entropy = logz - (probs * logits.masked_fill(probs == 0, 0)).sum(-1)
    return logprob, entropy


class PolicyModule(nn.Module):
    """Root module around an HF Qwen-VL model (any supported family) whose forward returns response logprobs (and entropy).

    It is the FSDP2 root, so the root-level parameters (embeddings, final norm, lm_head, ViT patch
    embedding/merger) are gathered for exactly this forward; encoding images alone goes through the same
    root forward (an `ImageBatch`) for that reason. A hybrid model's linear-attention layers are made to
    restart at packed sequence starts here (`linear_attention.split_packed_linear_attention`).
    """

    def __init__(
        self,
        hf_model: nn.Module,
        suppress_token_ids: list[int],
        chunk_size: int = 1024,
        *,
        padding_free: bool = False,
    ) -> None:
        super().__init__()
        self.hf = hf_model
        family = family_of(hf_model.config)
        if family.linear_attention is not None:
            split_packed_linear_attention(family.decoder_layers(hf_model), family.linear_attention.module)
        self.padding_free = padding_free
        """Whether callers should hand it packed batches (its attention implementation has a varlen path)."""
        self.shared_prompt = False
        """Whether callers hand it each group's prompt once (`worker.actor.shared_prompt`, resolved at build;
        packed batches only)."""
        self.gather_once_per_pass = False
        """Whether a pass keeps the sharded parameters gathered across its micro-batches (set with the
        sharding, `worker.actor.fsdp.gather_once_per_pass`; actor/gathering.py)."""
        self.register_buffer(
            "suppress_ids", torch.tensor(suppress_token_ids, dtype=torch.long), persistent=False
        )
        self.chunk_size = chunk_size
        self.moe: MoEState | None = None
        """An MoE model's routing state (models/moe: grouped experts and routers installed at build)."""

    @property
    def config(self):
        return self.hf.config

    @property
    def compute_device(self) -> torch.device:
        """Where this model computes, so where its inputs go. Not its parameters' device: with
        `fsdp.offload_params` the parameter shards live in host memory and FSDP2 gathers them onto the
        accelerator for each forward. The buffers show it: `fully_shard` and the build put them there."""
        return self.suppress_ids.device

    def forward(
        self, batch: SequenceBatch | ImageBatch, temperature: float = 1.0, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, ...]:
        """SequenceBatch: (logprobs [B, R], entropy [B, R]), zeros where response_mask is 0.
        ImageBatch: the vision tower's features, one [tokens of image i, H] per image (for reuse)."""
        if isinstance(batch, ImageBatch):
            return self.hf.model.get_image_features(batch.pixel_values, batch.image_grid_thw).pooler_output
        # Before the language model, where a micro-batch with pixels runs the tower: FSDP gathers the
        # vision blocks and the decoder layers in the same order on every rank. The model runs the tower
        # once for the images and once for the videos: each missing call is made here on a dummy input.
        idle = []
        if batch.tower_in_forward and batch.pixel_values is None:
            idle.append(self._idle_tower(batch.input_ids.device, self.hf.model.get_image_features))
        if batch.video_in_forward and batch.pixel_values_videos is None:
            idle.append(self._idle_tower(batch.input_ids.device, self.hf.model.get_video_features))
        precomputed = None
        if batch.image_features is not None:
            from transformers.modeling_outputs import BaseModelOutputWithPooling

            precomputed = {"image": BaseModelOutputWithPooling(pooler_output=batch.image_features)}
        videos = {}
        if batch.pixel_values_videos is not None:
            videos = dict(pixel_values_videos=batch.pixel_values_videos, video_grid_thw=batch.video_grid_thw)
            if batch.second_per_grid_ts is not None:
                videos["second_per_grid_ts"] = batch.second_per_grid_ts
        if self.moe is not None:
            self._begin_routing(batch)
        out = self.hf.model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=mrope_position_ids(self.hf, batch),
            pixel_values=batch.pixel_values,
            image_grid_thw=batch.image_grid_thw,
            mm_encoder_outputs=precomputed,
            use_cache=False,
            **videos,
        )
        logprobs, entropy = self._response_logprobs(out.last_hidden_state, batch, temperature, with_entropy)
        for zero in idle:
            logprobs, entropy = logprobs + zero, entropy + zero
        return logprobs, entropy

    def _begin_routing(self, batch: SequenceBatch) -> None:
        """Tell the MoE routers about this forward: its real tokens and the routes to compare or replay."""
        valid = batch.input_ids.new_ones(batch.input_ids.numel(), dtype=torch.bool)
        if batch.attention_mask is not None:
            valid = batch.attention_mask.reshape(-1).bool()
        copies = batch.token_copies() if batch.packed else None
        if not batch.route_counted:  # a padding micro-batch: its tokens stand for no sequence
            copies = torch.zeros(valid.numel(), dtype=torch.float64, device=valid.device)
        self.moe.begin(
            valid, batch.routes, replay=batch.replay_routes, pass_name=batch.route_pass, copies=copies
        )

    def _idle_tower(self, device: torch.device, encode) -> torch.Tensor:
        """The vision tower run on a dummy image (`encode`: the model's `get_image_features`, or
        `get_video_features` for a one-temporal-patch dummy video), as 0: for a micro-batch without pixels
        (or without a video, in a run that allows videos) in a pass whose forwards run the tower (text-only
        prompts, a padding micro-batch), while other ranks' micro-batches hold images (or videos). FSDP2 gathers each sharded vision block in its forward, and with a trained tower
        reduce-scatters its gradients in the backward, on every rank together; skipping the tower here
        would leave the other ranks waiting in those collectives ("Received data size doesn't match" on
        gloo, a hang on nccl). Every output of the tower (Qwen3-VL's DeepStack features too) enters the
        result times zero, so the backward reaches every tower parameter and adds exactly zero.

        Cost: one more tower forward (and backward) per such micro-batch, on a 2 x 2-patch image. For
        Qwen2.5-VL-7B (675M-parameter tower, 32 blocks) the compute is negligible (~4 patch tokens: ~5
        GFLOP); the price is the collectives the rank would have run with an image anyway: the tower's
        all-gather (~1.35 GB in bf16) and, when trained, its gradient reduce-scatter. A run that allows
        videos pays this twice for a text-only micro-batch (a dummy image and a dummy video)."""
        dummy = dummy_image(self.config).to(device)
        out = encode(dummy.pixel_values, dummy.image_grid_thw)
        return sum(t.float().sum() for t in _tensors(out)) * 0.0

    def _response_logprobs(
        self, hidden: torch.Tensor, batch: SequenceBatch, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunked log-softmax over the vocabulary at the N positions that predict response tokens."""
        row, src, tgt = response_token_index(batch)
        h = hidden[row, src]  # [N, H]
        targets = batch.input_ids[row, tgt]  # [N]
        weight, bias, adapter = head_parts(self.hf.lm_head)
        kwargs = dict(
            inv_temperature=1.0 / temperature,
            suppress_ids=self.suppress_ids,
            with_entropy=with_entropy,
            adapter=adapter,
        )
        logprob_chunks, entropy_chunks = [], []
        for start in range(0, h.shape[0], self.chunk_size):
            piece = slice(start, start + self.chunk_size)
            args = (h[piece], targets[piece], weight, bias)
            if torch.is_grad_enabled():
                lp, ent = checkpoint(_chunk_logprob_entropy, *args, use_reentrant=False, **kwargs)
            else:
                lp, ent = _chunk_logprob_entropy(*args, **kwargs)
            logprob_chunks.append(lp)
            entropy_chunks.append(ent)
        valid = batch.response_mask.bool()
        logprobs = torch.zeros(valid.shape, dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros(valid.shape, dtype=torch.float32, device=hidden.device)
        if logprob_chunks:
            logprobs = logprobs.masked_scatter(valid, torch.cat(logprob_chunks))
            entropy = entropy.masked_scatter(valid, torch.cat(entropy_chunks))
        elif torch.is_grad_enabled():
            # No response token: a zero term keeps every parameter in the graph, so a loss of this batch
            # can run backward (and FSDP reduces the same gradients on every rank), adding zero.
            anchor = _head_logits(hidden[:, -1], weight, bias, adapter).float().sum() * 0.0
            logprobs, entropy = logprobs + anchor, entropy + anchor
        return logprobs, entropy
