"""Trainer-side logprobs and entropy of response tokens, matching what vLLM sampled from.

Shapes: B sequences in a micro-batch, L = padded prompt+response length, R = padded response length,
N = number of valid response tokens in the micro-batch, H = hidden size, V = vocabulary.

Correctness: Qwen-VL models need mrope positions over the WHOLE prompt+response; given only input_ids,
attention_mask and the images, transformers 5.x silently uses wrong positions for the response tokens
(per-token logprob errors of 1-18 nats against vLLM, measured on a tiny Qwen2.5-VL in fp32, no warning).
We compute `position_ids` [3, B, L] explicitly, as the model's family says (`families.Family.position_ids`:
the model's `get_rope_index` with `mm_token_type_ids`, 1 on image pad tokens, 0 elsewhere, response
included), and pass them in.

Padding-free (`worker.actor.padding_free`): a micro-batch's sequences are packed back to back into one row
with no attention mask, and the positions get a 4th row (first) of plain per-sequence text positions.
transformers 5.x reads it to keep attention inside each sequence: varlen `cu_seqlens` with flash attention
(CUDA, and Ascend's fused kernel behind the same name), causal sdpa per sequence length on the CPU
(`attention.VARLEN_SDPA`), a dense block-diagonal causal mask with plain sdpa (CUDA without `flash_attn`:
correct, not faster). Checked here on CPU only (fp32, both sdpa paths): logprobs, entropy and gradients
equal the padded forward's to fp32 rounding (tests/unit/test_packing.py). No padding token is computed.

Image features (`ImageBatch`, `SequenceBatch.image_features`): the root module can run the vision tower
alone and take its output back instead of pixels (transformers' `mm_encoder_outputs`, matched to the image
pad tokens in order), so a frozen tower encodes each prompt's images once per step (update.encode_images).

The distribution is vLLM's `processed_logprobs`: logits / temperature with the unsamplable vision tokens at
-inf. top-p / top-k truncation is NOT applied (as in verl): with top_p < 1 the logged
`rollout/logprob_diff_*` includes that truncation, by design.

Memory: the root module (`PolicyModule`) returns only what is needed. Hidden states of the N tokens that
predict response tokens are projected to the vocabulary in chunks of `chunk_size` tokens under activation
checkpointing, so neither forward nor backward holds more than one [chunk, V] fp32 block of logits (a
152k vocabulary never materialises a [N, V] fp32 log-softmax).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .families import family_of

VISION_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def unsamplable_token_ids(hf_config) -> list[int]:
    """Token ids that must never be sampled (the vision placeholders), read from the model config."""
    return sorted(
        {int(getattr(hf_config, k)) for k in VISION_TOKEN_KEYS if getattr(hf_config, k, None) is not None}
    )


@dataclass
class SequenceBatch:
    """A micro-batch of prompt+response sequences, ready for the policy's forward.

    Padded (`sequence_lengths` None): B right-padded rows. Packed (padding-free, `sequence_lengths` set): one
    row holding the B sequences back to back, no attention mask; the forward gives the model 4-row position
    ids so attention stays inside each sequence (see `mrope_position_ids`).
    """

    input_ids: torch.Tensor  # [B, L] long, or [1, T] packed (T = sum of the sequence lengths)
    attention_mask: torch.Tensor | None  # [B, L] long; None when packed
    prompt_lengths: torch.Tensor  # [B] long
    response_mask: torch.Tensor  # [B, R] float (1 on valid response tokens)
    pixel_values: torch.Tensor | None  # [num_patches, C*T*P*P] for all images of the micro-batch, in order
    image_grid_thw: torch.Tensor | None  # [num_images, 3] long
    sequence_lengths: torch.Tensor | None = None  # [B] long (prompt + response), only when packed
    image_features: tuple[torch.Tensor, ...] | None = None
    """Precomputed vision-tower output, one [tokens of image i, H] per image in order; replaces pixel_values."""

    @property
    def packed(self) -> bool:
        return self.sequence_lengths is not None

    def to(self, device: torch.device) -> SequenceBatch:
        move = lambda t: t.to(device) if t is not None else None  # noqa: E731
        fields = {f: move(getattr(self, f)) for f in self.__dataclass_fields__ if f != "image_features"}
        feats = None if self.image_features is None else tuple(f.to(device) for f in self.image_features)
        return SequenceBatch(**fields, image_features=feats)


@dataclass
class ImageBatch:
    """Images to encode with the vision tower alone (`PolicyModule` returns one feature tensor per image)."""

    pixel_values: torch.Tensor  # [num_patches, C*T*P*P]
    image_grid_thw: torch.Tensor  # [num_images, 3] long

    def to(self, device: torch.device) -> ImageBatch:
        return ImageBatch(self.pixel_values.to(device), self.image_grid_thw.to(device))


def collate(
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    pixel_values: list[torch.Tensor | None],
    image_grid_thw: list[torch.Tensor | None],
    pad_token_id: int,
    *,
    packed: bool = False,
    image_features: list[tuple[torch.Tensor, ...] | None] | None = None,
) -> SequenceBatch:
    """`prompt + response` sequences, right-padded or (`packed`) back to back in one row; the images
    concatenated in sequence order. With `image_features` (per sequence, None for one without images) the
    batch carries the features instead of the pixels."""
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
    L, R, B = max(lengths), max(max(len(r) for r in response_ids), 1), len(prompt_ids)
    response_mask = torch.zeros((B, R), dtype=torch.float32)
    for i, r in enumerate(response_ids):
        response_mask[i, : len(r)] = 1
    tokens = [torch.tensor(p + r, dtype=torch.long) for p, r in zip(prompt_ids, response_ids, strict=True)]
    if packed:
        input_ids, attention_mask = torch.cat(tokens)[None, :], None
    else:
        input_ids = torch.full((B, L), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((B, L), dtype=torch.long)
        for i, t in enumerate(tokens):
            input_ids[i, : lengths[i]] = t
            attention_mask[i, : lengths[i]] = 1
    pv = [x for x in pixel_values if x is not None]
    grids = [x for x in image_grid_thw if x is not None]
    feats = [f for x in image_features or [] if x is not None for f in x]
    return SequenceBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        prompt_lengths=torch.tensor([len(p) for p in prompt_ids], dtype=torch.long),
        response_mask=response_mask,
        pixel_values=torch.cat(pv) if pv and not feats else None,
        image_grid_thw=torch.cat(grids) if grids else None,
        sequence_lengths=torch.tensor(lengths, dtype=torch.long) if packed else None,
        image_features=tuple(feats) if feats else None,
    )


def _padded_ids(batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, L] of the batch, right-padded (unpacked when packed)."""
    if not batch.packed:
        return batch.input_ids, batch.attention_mask
    seqs = batch.input_ids[0].split(batch.sequence_lengths.tolist())
    ids = nn.utils.rnn.pad_sequence(list(seqs), batch_first=True)
    mask = nn.utils.rnn.pad_sequence([torch.ones_like(s) for s in seqs], batch_first=True)
    return ids, mask


def mrope_position_ids(hf_model: nn.Module, batch: SequenceBatch) -> torch.Tensor:
    """Positions for the full prompt+response (vLLM uses the same), from the model's family: [3, B, L] padded.

    Packed: [4, 1, T], computed per sequence (the family's positions of the unpacked rows, valid tokens kept, in
    order) with a first row of plain text positions 0..len-1 restarting at every sequence. transformers 5
    reads that row to find the sequence boundaries (block-diagonal causal mask for sdpa/eager, `cu_seqlens`
    for flash attention); given only the 3 mrope rows it does not look for boundaries at all, and packed
    sequences would attend to each other without any error.
    """
    input_ids, attention_mask = _padded_ids(batch)
    family = family_of(hf_model.config)
    position_ids = family.position_ids(hf_model, input_ids, attention_mask, batch.image_grid_thw)
    if not batch.packed:
        return position_ids
    mrope = position_ids[:, attention_mask.bool()]  # [3, T], sequence by sequence
    text = torch.cat([torch.arange(n, device=mrope.device) for n in batch.sequence_lengths.tolist()])
    return torch.cat([text[None, :].to(mrope.dtype), mrope])[:, None, :]


def response_token_index(batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) in `input_ids` of the token that PREDICTS each valid response token, [N] each, in
    (sequence, token) order: response token j of sequence i sits at its start + prompt_len + j."""
    B, R = batch.response_mask.shape
    device = batch.input_ids.device
    valid = batch.response_mask.bool()
    if batch.packed:
        starts = torch.cumsum(batch.sequence_lengths, 0) - batch.sequence_lengths
        rows = torch.zeros(B, dtype=torch.long, device=device)
    else:
        starts = torch.zeros(B, dtype=torch.long, device=device)
        rows = torch.arange(B, device=device)
    col = (starts + batch.prompt_lengths - 1)[:, None] + torch.arange(R, device=device)[None, :]
    return rows[:, None].expand(B, R)[valid], col[valid]


def _chunk_logprob_entropy(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    inv_temperature: float,
    suppress_ids: torch.Tensor,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden, weight, bias).float() * inv_temperature  # [chunk, V]
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
    root forward (an `ImageBatch`) for that reason.
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
        self.padding_free = padding_free
        """Whether callers should hand it packed batches (its attention implementation has a varlen path)."""
        self.register_buffer(
            "suppress_ids", torch.tensor(suppress_token_ids, dtype=torch.long), persistent=False
        )
        self.chunk_size = chunk_size

    @property
    def config(self):
        return self.hf.config

    def forward(
        self, batch: SequenceBatch | ImageBatch, temperature: float = 1.0, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, ...]:
        """SequenceBatch: (logprobs [B, R], entropy [B, R]), zeros where response_mask is 0.
        ImageBatch: the vision tower's features, one [tokens of image i, H] per image (for reuse)."""
        if isinstance(batch, ImageBatch):
            return self.hf.model.get_image_features(batch.pixel_values, batch.image_grid_thw).pooler_output
        precomputed = None
        if batch.image_features is not None:
            from transformers.modeling_outputs import BaseModelOutputWithPooling

            precomputed = {"image": BaseModelOutputWithPooling(pooler_output=batch.image_features)}
        out = self.hf.model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=mrope_position_ids(self.hf, batch),
            pixel_values=batch.pixel_values,
            image_grid_thw=batch.image_grid_thw,
            mm_encoder_outputs=precomputed,
            use_cache=False,
        )
        return self._response_logprobs(out.last_hidden_state, batch, temperature, with_entropy)

    def _response_logprobs(
        self, hidden: torch.Tensor, batch: SequenceBatch, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunked log-softmax over the vocabulary at the N positions that predict response tokens."""
        row, src = response_token_index(batch)
        h = hidden[row, src]  # [N, H]
        targets = batch.input_ids[row, src + 1]  # [N]
        head = self.hf.lm_head
        kwargs = dict(
            inv_temperature=1.0 / temperature, suppress_ids=self.suppress_ids, with_entropy=with_entropy
        )
        logprob_chunks, entropy_chunks = [], []
        for start in range(0, h.shape[0], self.chunk_size):
            piece = slice(start, start + self.chunk_size)
            args = (h[piece], targets[piece], head.weight, head.bias)
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
            anchor = F.linear(hidden[:, -1], head.weight, head.bias).float().sum() * 0.0
            logprobs, entropy = logprobs + anchor, entropy + anchor
        return logprobs, entropy
