"""A micro-batch as the model takes it.

Shapes: B sequences, L = padded prompt+response length, T = total tokens of a packed row, G = groups
(runs of sequences that share one prompt; G = B unless the prompt is shared).

`collate` builds a `SequenceBatch`: padded (B x L, left-aligned prompts, an attention mask) or packed (one
row of T valid tokens, `attention_mask=None`, 4-row position ids whose row 0 restarts at each sequence, which
is how transformers detects the packing). Packed with a shared prompt (`shared_prompt`), each group's
prompt is in the row once, followed by its responses: [prompt | response 1 | response 2 | ...]; every
response's four position rows continue from the prompt's end (row 0: prompt length + 0, 1, ...; rows 1-3:
its mrope positions in the unshared sequence), so row 0 restarts at the prompt length at each response
after the first. That restart is the whole layout description the attention function needs
(`attention.VARLEN_SDPA`). `mrope_position_ids` computes Qwen-VL's 3-row mrope positions over
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
    route_counted: bool = True
    """False for a padding micro-batch (a rank with fewer micro-batches than the others runs one of its
    samples with zero weight to keep FSDP's calls aligned): its tokens stand for no sequence, so they add
    nothing to the MoE load, route-difference and load-balancing counts."""
    shares_prompt: torch.Tensor | None = None
    """[B] bool, packed only: the sequence's prompt is the previous sequence's and is held in the row once,
    before the group's first response (its images and videos too); None: every prompt is in the row."""

    @property
    def packed(self) -> bool:
        return self.sequence_lengths is not None

    def to(self, device: torch.device) -> SequenceBatch:
        move = lambda t: t.to(device) if t is not None else None  # noqa: E731
        kept = (
            "image_features",
            "tower_in_forward",
            "video_in_forward",
            "replay_routes",
            "route_pass",
            "route_counted",
            "shares_prompt",
        )
        fields = {f: move(getattr(self, f)) for f in self.__dataclass_fields__ if f not in kept}
        feats = None if self.image_features is None else tuple(f.to(device) for f in self.image_features)
        flags = {f: getattr(self, f) for f in kept[1:]}
        return SequenceBatch(**fields, image_features=feats, **flags)

    def token_copies(self) -> torch.Tensor | None:
        """[T] float, packed with a shared prompt: how many of the batch's sequences each column stands
        for (a group's prompt: its samples here; a response: 1); None when every prompt is in the row."""
        if self.shares_prompt is None or not self.shares_prompt.any():
            return None
        copies = torch.ones(self.input_ids.shape[1], dtype=torch.float64)
        _, response_starts, prompt_ends = self.segments()
        prompts = self.prompt_lengths.tolist()
        for i, s in enumerate(self.shares_prompt.tolist()):
            if s:
                copies[prompt_ends[i] - prompts[i] : prompt_ends[i]] += 1
        return copies.to(self.input_ids.device)

    @property
    def response_lengths(self) -> list[int]:
        # Counted, not summed: the lengths hold whatever the mask's dtype (a bf16 sum rounds above 256, 750
        # ones to 752, which misplaced the packed sequences' boundaries while FSDP2 cast the batch).
        return self.response_mask.count_nonzero(1).tolist()

    def segments(self) -> tuple[list[int], list[int], list[int]]:
        """Packed: per sequence, (where its part of the row starts, where its response starts, where its
        prompt ends: the end of its group's prompt), as row columns."""
        prompts, responses = self.prompt_lengths.tolist(), self.response_lengths
        shared = self.shares_prompt.tolist() if self.shares_prompt is not None else [False] * len(prompts)
        starts, response_starts, prompt_ends, at, end = [], [], [], 0, 0
        for p, r, s in zip(prompts, responses, shared, strict=True):
            starts.append(at)
            if not s:
                at, end = at + p, at + p
            response_starts.append(at)
            prompt_ends.append(end)
            at += r
        return starts, response_starts, prompt_ends


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
    prompt_groups: list[int] | None = None,
) -> SequenceBatch:
    """`prompt + response` sequences, right-padded or (`packed`) back to back in one row; the images (and
    `video_inputs`, per sequence: the processor's video outputs, None without videos) concatenated in
    sequence order. With `image_features` (per sequence, None for one without images) the batch carries the
    features instead of the pixels. `tower_in_forward`, `video_in_forward`: see `SequenceBatch`.

    `prompt_groups` (packed only): a key per sequence; a sequence with the previous one's key has its prompt,
    images and videos (the caller's promise), which the row holds once (the module docstring)."""
    shared = _shares_prompt(prompt_groups, packed)
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
    L, R, B = max(lengths), max(max(len(r) for r in response_ids), 1), len(prompt_ids)
    response_mask = torch.zeros((B, R), dtype=torch.float32)
    for i, r in enumerate(response_ids):
        response_mask[i, : len(r)] = 1
    # A sequence sharing its group's prompt brings its response (and nothing else: no images, no videos).
    tokens = [
        torch.tensor(r if s else p + r, dtype=torch.long)
        for p, r, s in zip(prompt_ids, response_ids, shared or [False] * B, strict=True)
    ]
    if shared is not None:
        pixel_values, image_grid_thw = _held_once(pixel_values, shared), _held_once(image_grid_thw, shared)
        image_features, video_inputs = _held_once(image_features, shared), _held_once(video_inputs, shared)
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
        shares_prompt=torch.tensor(shared, dtype=torch.bool) if shared is not None else None,
    )


def _shares_prompt(prompt_groups: list[int] | None, packed: bool) -> list[bool] | None:
    """Per sequence: its group key is the previous sequence's (its prompt is held once); None: no sharing."""
    if prompt_groups is None:
        return None
    if not packed:
        raise ValueError("a shared prompt needs the packed layout")
    return [False] + [a == b for a, b in zip(prompt_groups[1:], prompt_groups[:-1], strict=True)]


def _held_once(values: list | None, shared: list[bool]) -> list | None:
    """The per-sequence prompt inputs `values` with None where the sequence shares the previous one's."""
    return None if values is None else [None if s else v for v, s in zip(values, shared, strict=True)]


def _concat_videos(videos: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor | None]:
    """The batch's video fields: each processor output concatenated over the sequences' videos."""
    keys = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
    return {k: torch.cat([v[k] for v in videos]) if videos and k in videos[0] else None for k in keys}


def _group_representatives(batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(input_ids, attention_mask) [G, L] right-padded, one row per group of a packed batch: its prompt and
    its longest response (every sequence when no prompt is shared), and the first sequence of each group.
    The response tokens are text, so a response's positions depend on its length only: those of the
    longest one serve every response of the group."""
    row = batch.input_ids[0]
    starts, response_starts, _ = batch.segments()
    lengths = batch.response_lengths
    shared = batch.shares_prompt.tolist() if batch.shares_prompt is not None else [False] * len(lengths)
    firsts = [i for i, s in enumerate(shared) if not s]
    seqs = []
    for g, first in enumerate(firsts):
        last = firsts[g + 1] if g + 1 < len(firsts) else len(lengths)
        longest = max(range(first, last), key=lambda i: lengths[i])
        prompt = row[starts[first] : response_starts[first]]
        seqs.append(
            torch.cat([prompt, row[response_starts[longest] : response_starts[longest] + lengths[longest]]])
        )
    ids = nn.utils.rnn.pad_sequence(seqs, batch_first=True)
    mask = nn.utils.rnn.pad_sequence([torch.ones_like(s) for s in seqs], batch_first=True)
    return ids, mask, firsts


def mrope_position_ids(hf_model: nn.Module, batch: SequenceBatch) -> torch.Tensor:
    """Positions for the full prompt+response (vLLM uses the same), from the model's family: [3, B, L] padded.

    Packed: [4, 1, T], computed per sequence (the family's positions of the unpacked rows, valid tokens kept, in
    order) with a first row of plain text positions 0..len-1 restarting at every sequence. transformers 5
    reads that row to find the sequence boundaries (block-diagonal causal mask for sdpa/eager, `cu_seqlens`
    for flash attention); given only the 3 mrope rows it does not look for boundaries at all, and packed
    sequences would attend to each other without any error. With a shared prompt, each response after the
    group's first restarts row 0 at the prompt length instead of 0, and its rows 1-3 are the ones it has
    after the prompt in the unshared sequence (the module docstring).
    """
    family = family_of(hf_model.config)
    videos = dict(video_grid_thw=batch.video_grid_thw, second_per_grid_ts=batch.second_per_grid_ts)
    if not batch.packed:
        return family.position_ids(
            hf_model, batch.input_ids, batch.attention_mask, batch.image_grid_thw, **videos
        )
    input_ids, attention_mask, firsts = _group_representatives(batch)
    position_ids = family.position_ids(hf_model, input_ids, attention_mask, batch.image_grid_thw, **videos)
    prompts, responses = batch.prompt_lengths.tolist(), batch.response_lengths
    firsts = [*firsts, len(responses)]
    parts, text = [], []
    for g in range(len(firsts) - 1):
        p = prompts[firsts[g]]
        parts.append(position_ids[:, g, :p])
        text.append(torch.arange(p))
        for i in range(firsts[g], firsts[g + 1]):
            parts.append(position_ids[:, g, p : p + responses[i]])
            text.append(torch.arange(p, p + responses[i]))
    mrope = torch.cat(parts, dim=1)  # [3, T]
    return torch.cat([torch.cat(text)[None, :].to(mrope), mrope])[:, None, :]


def response_token_index(batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, column of the token that PREDICTS it, column of the token itself) in `input_ids` for each valid
    response token, [N] each, in (sequence, token) order: response token j of a sequence sits at its
    response's start + j and is predicted by the token before it, the first one by its prompt's last token
    (with a shared prompt, the group's prompt: every response of the group reads that one hidden state)."""
    B, R = batch.response_mask.shape
    device = batch.input_ids.device
    valid = batch.response_mask.bool()
    j = torch.arange(R, device=device)[None, :]
    if batch.packed:
        _, response_starts, prompt_ends = batch.segments()
        start = torch.tensor(response_starts, device=device)[:, None]
        end = torch.tensor(prompt_ends, device=device)[:, None]
        rows = torch.zeros(B, dtype=torch.long, device=device)
        target = start + j
        source = torch.where(j == 0, end - 1, target - 1)
    else:
        rows = torch.arange(B, device=device)
        target = batch.prompt_lengths.to(device)[:, None] + j
        source = target - 1
    return rows[:, None].expand(B, R)[valid], source[valid], target[valid]


def dummy_image(hf_config) -> ImageBatch:
    """The smallest image the vision tower takes (2 x 2 patches, one merged token), for a rank with nothing to
    encode while other ranks run the tower (FSDP needs the same calls on every rank)."""
    v = hf_config.vision_config
    dim = v.in_channels * v.temporal_patch_size * v.patch_size**2
    merge = v.spatial_merge_size
    return ImageBatch(torch.zeros(merge * merge, dim), torch.tensor([[1, merge, merge]]))
