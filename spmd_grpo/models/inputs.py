"""A micro-batch as the model takes it.

Shapes: B sequences, L = padded prompt+response length, T = total tokens of a packed row.

`collate` builds a `SequenceBatch`: padded (B x L, left-aligned prompts, an attention mask) or packed (one
row of T valid tokens, `attention_mask=None`, 4-row position ids whose row 0 restarts at each sequence, which
is how transformers detects the packing). `mrope_position_ids` computes Qwen-VL's 3-row mrope positions over
the WHOLE prompt+response: given only input ids, transformers silently uses wrong positions for the
response tokens. `ImageBatch` holds the pixel values and grids of the micro-batch's images; a batch's
videos travel as the processor's `pixel_values_videos`, `video_grid_thw`, `second_per_grid_ts`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from spmd_grpo.models.families import family_of


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
    tower_in_forward: bool = True
    """Whether the forward runs the vision tower itself: True unless this pass's features were encoded before
    it (then no rank runs the tower in the pass). Decided by the pass from the config, so it is the same on
    every rank; with it and no pixels, the forward runs the tower on a dummy image (`PolicyModule`)."""
    pixel_values_videos: torch.Tensor | None = None  # [num_video_patches, C*T*P*P], all videos in order
    video_grid_thw: torch.Tensor | None = None  # [num_videos, 3] long
    second_per_grid_ts: torch.Tensor | None = None  # [num_videos] float (Qwen2.5-VL's mrope time scale)
    video_in_forward: bool = False
    """Whether every forward runs the tower on video input (the run allows videos: the config decides, the
    same on every rank): the model encodes images and videos in two tower calls, so a micro-batch without
    a video runs the tower on a dummy video to keep the calls per forward equal across ranks."""
    routes: torch.Tensor | None = None
    """MoE models: [B x L or T, decoder layers, top-k] int16, reference routes of every row of the flattened
    batch (-1: none), which the routers compare with or (`replay_routes`) use instead of their own top-k."""
    replay_routes: bool = False
    route_pass: str = "update"
    """The pass this forward belongs to (old, ref, update): names its `moe/route_diff/<pass>` counts."""

    @property
    def packed(self) -> bool:
        return self.sequence_lengths is not None

    def to(self, device: torch.device) -> SequenceBatch:
        move = lambda t: t.to(device) if t is not None else None  # noqa: E731
        kept = ("image_features", "tower_in_forward", "video_in_forward", "replay_routes", "route_pass")
        fields = {f: move(getattr(self, f)) for f in self.__dataclass_fields__ if f not in kept}
        feats = None if self.image_features is None else tuple(f.to(device) for f in self.image_features)
        flags = {f: getattr(self, f) for f in kept[1:]}
        return SequenceBatch(**fields, image_features=feats, **flags)


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
    tower_in_forward: bool = True,
    video_inputs: list[dict[str, torch.Tensor] | None] | None = None,
    video_in_forward: bool = False,
) -> SequenceBatch:
    """`prompt + response` sequences, right-padded or (`packed`) back to back in one row; the images (and
    `video_inputs`, per sequence: the processor's video outputs, None without videos) concatenated in
    sequence order. With `image_features` (per sequence, None for one without images) the batch carries the
    features instead of the pixels. `tower_in_forward`, `video_in_forward`: see `SequenceBatch`."""
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
        tower_in_forward=tower_in_forward,
        video_in_forward=video_in_forward,
        **_concat_videos([v for v in video_inputs or [] if v is not None]),
    )


def _concat_videos(videos: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor | None]:
    """The batch's video fields: each processor output concatenated over the sequences' videos."""
    keys = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
    return {k: torch.cat([v[k] for v in videos]) if videos and k in videos[0] else None for k in keys}


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
    position_ids = family.position_ids(
        hf_model,
        input_ids,
        attention_mask,
        batch.image_grid_thw,
        video_grid_thw=batch.video_grid_thw,
        second_per_grid_ts=batch.second_per_grid_ts,
    )
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


def dummy_image(hf_config) -> ImageBatch:
    """The smallest image the vision tower takes (2 x 2 patches, one merged token), for a rank with nothing to
    encode while other ranks run the tower (FSDP needs the same calls on every rank)."""
    v = hf_config.vision_config
    dim = v.in_channels * v.temporal_patch_size * v.patch_size**2
    merge = v.spatial_merge_size
    return ImageBatch(torch.zeros(merge * merge, dim), torch.tensor([[1, merge, merge]]))
