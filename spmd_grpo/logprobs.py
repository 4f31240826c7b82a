"""Trainer-side logprobs and entropy of response tokens, matching what vLLM sampled from.

Shapes: B sequences in a micro-batch, L = padded prompt+response length, R = padded response length,
N = number of valid response tokens in the micro-batch, H = hidden size, V = vocabulary.

Correctness: Qwen2.5-VL needs mrope positions over the WHOLE prompt+response; given only input_ids,
attention_mask and the images, transformers 5.x silently uses wrong positions for the response tokens
(per-token logprob errors of 1-18 nats against vLLM, measured on a tiny model in fp32, no warning). We
compute `position_ids` [3, B, L] explicitly with the model's `get_rope_index` and `mm_token_type_ids`
(1 on image pad tokens, 0 elsewhere, response included) and pass them in.

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

VISION_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def unsamplable_token_ids(hf_config) -> list[int]:
    """Token ids that must never be sampled (the vision placeholders), read from the model config."""
    return sorted(
        {int(getattr(hf_config, k)) for k in VISION_TOKEN_KEYS if getattr(hf_config, k, None) is not None}
    )


@dataclass
class SequenceBatch:
    """A micro-batch of prompt+response sequences, right-padded, ready for the policy's forward."""

    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor  # [B, L] long
    prompt_lengths: torch.Tensor  # [B] long
    response_mask: torch.Tensor  # [B, R] float (1 on valid response tokens)
    pixel_values: torch.Tensor | None  # [num_patches, C*T*P*P] for all images of the micro-batch, in order
    image_grid_thw: torch.Tensor | None  # [num_images, 3] long

    def to(self, device: torch.device) -> SequenceBatch:
        move = lambda t: t.to(device) if t is not None else None  # noqa: E731
        return SequenceBatch(*(move(getattr(self, f)) for f in self.__dataclass_fields__))


def collate(
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    pixel_values: list[torch.Tensor | None],
    image_grid_thw: list[torch.Tensor | None],
    pad_token_id: int,
) -> SequenceBatch:
    """Right-pad `prompt + response` sequences; concatenate the images in sequence order."""
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
    L, R, B = max(lengths), max(max(len(r) for r in response_ids), 1), len(prompt_ids)
    input_ids = torch.full((B, L), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    response_mask = torch.zeros((B, R), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        input_ids[i, : lengths[i]] = torch.tensor(p + r, dtype=torch.long)
        attention_mask[i, : lengths[i]] = 1
        response_mask[i, : len(r)] = 1
    pv = [x for x in pixel_values if x is not None]
    grids = [x for x in image_grid_thw if x is not None]
    return SequenceBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        prompt_lengths=torch.tensor([len(p) for p in prompt_ids], dtype=torch.long),
        response_mask=response_mask,
        pixel_values=torch.cat(pv) if pv else None,
        image_grid_thw=torch.cat(grids) if grids else None,
    )


def mrope_position_ids(hf_model: nn.Module, batch: SequenceBatch) -> torch.Tensor:
    """[3, B, L] Qwen2.5-VL positions for the full prompt+response (vLLM uses the same)."""
    image_token_id = hf_model.config.image_token_id
    mm_token_type_ids = (batch.input_ids == image_token_id).to(torch.int32)
    position_ids, _ = hf_model.model.get_rope_index(
        batch.input_ids,
        mm_token_type_ids=mm_token_type_ids,
        image_grid_thw=batch.image_grid_thw,
        attention_mask=batch.attention_mask,
    )
    return position_ids


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
    """Root module around an HF Qwen2.5-VL whose forward returns response logprobs (and entropy).

    It is the FSDP2 root, so the root-level parameters (embeddings, final norm, lm_head, ViT patch
    embedding/merger) are gathered for exactly this forward.
    """

    def __init__(self, hf_model: nn.Module, suppress_token_ids: list[int], chunk_size: int = 1024) -> None:
        super().__init__()
        self.hf = hf_model
        self.register_buffer(
            "suppress_ids", torch.tensor(suppress_token_ids, dtype=torch.long), persistent=False
        )
        self.chunk_size = chunk_size

    @property
    def config(self):
        return self.hf.config

    def forward(
        self, batch: SequenceBatch, temperature: float = 1.0, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (logprobs [B, R], entropy [B, R]); zeros where response_mask is 0."""
        position_ids = mrope_position_ids(self.hf, batch)
        out = self.hf.model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=position_ids,
            pixel_values=batch.pixel_values,
            image_grid_thw=batch.image_grid_thw,
            use_cache=False,
        )
        hidden = out.last_hidden_state  # [B, L, H]
        B, R = batch.response_mask.shape
        valid = batch.response_mask.bool()  # [B, R]
        # Token j of the response sits at prompt_len + j and is predicted by the hidden state one before it.
        src = (batch.prompt_lengths[:, None] - 1 + torch.arange(R, device=hidden.device)[None, :])[valid]
        row = torch.arange(B, device=hidden.device)[:, None].expand(B, R)[valid]
        h = hidden[row, src]  # [N, H]
        targets = batch.input_ids[row, src + 1]  # [N]
        head = self.hf.lm_head
        logprob_chunks, entropy_chunks = [], []
        for start in range(0, h.shape[0], self.chunk_size):
            args = (
                h[start : start + self.chunk_size],
                targets[start : start + self.chunk_size],
                head.weight,
                head.bias,
            )
            kwargs = dict(
                inv_temperature=1.0 / temperature, suppress_ids=self.suppress_ids, with_entropy=with_entropy
            )
            if torch.is_grad_enabled():
                lp, ent = checkpoint(_chunk_logprob_entropy, *args, use_reentrant=False, **kwargs)
            else:
                lp, ent = _chunk_logprob_entropy(*args, **kwargs)
            logprob_chunks.append(lp)
            entropy_chunks.append(ent)
        logprobs = torch.zeros(B, R, dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros(B, R, dtype=torch.float32, device=hidden.device)
        if logprob_chunks:
            logprobs = logprobs.masked_scatter(valid, torch.cat(logprob_chunks))
            entropy = entropy.masked_scatter(valid, torch.cat(entropy_chunks))
        elif torch.is_grad_enabled():
            # No response token: a zero term keeps every parameter in the graph, so a loss of this batch
            # can run backward (and FSDP reduces the same gradients on every rank), adding zero.
            anchor = F.linear(hidden[:, -1], head.weight, head.bias).float().sum() * 0.0
            logprobs, entropy = logprobs + anchor, entropy + anchor
        return logprobs, entropy
