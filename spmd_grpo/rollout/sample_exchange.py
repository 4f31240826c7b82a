"""Moving `Sample`s between ranks as raw bytes (DAPO rebalancing), not as pickled objects.

Each destination's samples are packed into one uint8 buffer: a small pickled header (field layout, scalars,
which samples share a prompt) followed by every tensor, list field and image (its raw pixel bytes, not
re-encoded) at a 16-byte aligned offset, so the receiver views the tensors in place. Two `all_to_all_single`
calls move the sizes and the bytes. Samples that shared a prompt (or a pixel tensor) before the exchange share it after.
"""

from __future__ import annotations

import pickle

import torch
from PIL import Image

from spmd_grpo.data.samples import Prompt, Sample
from spmd_grpo.data.videos import Video
from spmd_grpo.parallel.collectives import World, exchange_bytes

# ------------------------------------------------------------------------------- samples as raw bytes
# How each Sample field travels (tests/unit/test_sample_exchange.py checks that this covers every field).
LIST_FIELDS = {"prompt_ids": torch.int64, "response_ids": torch.int64, "rollout_logprobs": torch.float64}


TENSOR_FIELDS = ("pixel_values", "image_grid_thw", "old_logprobs", "ref_logprobs", "routes")


TENSOR_TUPLE_FIELDS = ("image_features",)


TENSOR_DICT_FIELDS = ("video_inputs",)


SCALAR_FIELDS = (
    "sample_index",
    "response_text",
    "finish_reason",
    "gen_batch",
    "group_index",
    "scores",
    "advantage",
)


_ALIGN = 16  # every tensor starts at a multiple of this in the receive buffer, so it can be viewed in place


class _Packer:
    """One destination's segment: a small pickled header (structure, strings, scalars) followed by the
    numeric payload as raw bytes; every tensor is written once however many samples share it."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []  # uint8 views of the sources, copied once into the send buffer
        self.nbytes = 0
        self.refs: dict[int, tuple] = {}  # id(source) -> its reference, so shared tensors travel once
        self.sources: list[torch.Tensor] = []  # held, so that no id is reused while packing

    def tensor(self, t: torch.Tensor) -> tuple:
        if id(t) not in self.refs:
            data = t.detach().contiguous().reshape(-1).view(torch.uint8)
            self.refs[id(t)] = (self.nbytes, data.numel(), t.dtype, tuple(t.shape))
            self.parts.append(data)
            self.sources.append(t)
            self.nbytes += -(-data.numel() // _ALIGN) * _ALIGN
        return self.refs[id(t)]

    def image(self, img: Image.Image) -> tuple:
        data = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
        return (img.mode, img.size, img.getpalette(), dict(img.info), self.tensor(data))

    def prompt(self, p: Prompt) -> tuple:
        ids = self.tensor(torch.tensor(p.prompt_token_ids, dtype=torch.int64))
        videos = [(self.tensor(torch.from_numpy(v.frames)), v.metadata) for v in p.videos]
        return (p.uid, ids, [self.image(img) for img in p.images], p.ground_truth, p.extra, videos)

    def sample(self, s: Sample, prompt_index: int) -> dict:
        out = {name: getattr(s, name) for name in SCALAR_FIELDS}
        for name, dtype in LIST_FIELDS.items():
            out[name] = self.tensor(torch.tensor(getattr(s, name), dtype=dtype))
        for name in TENSOR_FIELDS:
            value = getattr(s, name)
            out[name] = None if value is None else self.tensor(value)
        for name in TENSOR_TUPLE_FIELDS:
            value = getattr(s, name)
            out[name] = None if value is None else tuple(self.tensor(t) for t in value)
        for name in TENSOR_DICT_FIELDS:
            value = getattr(s, name)
            out[name] = None if value is None else {k: self.tensor(t) for k, t in value.items()}
        out["prompt"] = prompt_index
        return out


def _pack(items: list[tuple[int, Sample]]) -> tuple[bytes, _Packer]:
    packer = _Packer()
    prompts: dict[int, int] = {}  # id(prompt) -> index: the samples of a prompt share one Prompt there too
    header_prompts, header_samples = [], []
    for pos, s in items:
        if id(s.prompt) not in prompts:
            prompts[id(s.prompt)] = len(header_prompts)
            header_prompts.append(packer.prompt(s.prompt))
        header_samples.append((pos, packer.sample(s, prompts[id(s.prompt)])))
    return pickle.dumps((header_prompts, header_samples), protocol=pickle.HIGHEST_PROTOCOL), packer


def _segment_size(header: bytes, packer: _Packer) -> int:
    return _data_start(len(header)) + packer.nbytes


def _data_start(header_len: int) -> int:
    return -(-(8 + header_len) // _ALIGN) * _ALIGN


def _write_segment(out: torch.Tensor, header: bytes, packer: _Packer) -> None:
    out[:8].view(torch.int64)[0] = len(header)
    out[8 : 8 + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    data = out[_data_start(len(header)) :]
    for (offset, nbytes, _, _), part in zip(packer.refs.values(), packer.parts, strict=True):
        data[offset : offset + nbytes] = part


def _unpack(segment: torch.Tensor) -> list[tuple[int, Sample]]:
    header_len = int(segment[:8].view(torch.int64)[0])
    header_prompts, header_samples = pickle.loads(segment[8 : 8 + header_len].numpy().tobytes())
    data = segment[_data_start(header_len) :]
    tensors: dict[int, torch.Tensor] = {}  # offset -> tensor: what was shared on the sender is shared here

    def tensor(ref: tuple) -> torch.Tensor:
        offset, nbytes, dtype, shape = ref
        if offset not in tensors:
            tensors[offset] = data[offset : offset + nbytes].view(dtype).reshape(shape)
        return tensors[offset]

    def image(ref: tuple) -> Image.Image:
        mode, size, palette, info, pixels = ref
        img = Image.frombytes(mode, size, tensor(pixels).numpy())
        if palette is not None:
            img.putpalette(palette)
        img.info.update(info)
        return img

    prompts = [
        Prompt(
            uid,
            tensor(ids).tolist(),
            [image(i) for i in images],
            ground_truth,
            extra,
            [Video(tensor(frames).numpy(), metadata) for frames, metadata in videos],
        )
        for uid, ids, images, ground_truth, extra, videos in header_prompts
    ]
    out = []
    for pos, fields in header_samples:
        kwargs = {name: fields[name] for name in SCALAR_FIELDS}
        kwargs.update({name: tensor(fields[name]).tolist() for name in LIST_FIELDS})
        for name in TENSOR_FIELDS:
            kwargs[name] = None if fields[name] is None else tensor(fields[name])
        for name in TENSOR_TUPLE_FIELDS:
            kwargs[name] = None if fields[name] is None else tuple(map(tensor, fields[name]))
        for name in TENSOR_DICT_FIELDS:
            kwargs[name] = None if fields[name] is None else {k: tensor(r) for k, r in fields[name].items()}
        out.append((pos, Sample(prompt=prompts[fields["prompt"]], **kwargs)))
    return out


def exchange_samples(
    per_destination: list[list[tuple[int, Sample]]], world: World
) -> list[tuple[int, Sample]]:
    """All-to-all of `(position, sample)` items: `per_destination[r]` goes to rank r; returns what this rank
    received (its own items are kept as they are, not copied).

    Every other destination gets one segment of one uint8 `all_to_all_single` (`collectives.exchange_bytes`):
    token ids, logprobs, pixel values, grids and images as raw bytes (bitwise exact for every dtype), each
    prompt's images and each shared tensor once per destination; a small pickled header with the structure,
    the strings and the scalars. Nothing large is pickled.
    """
    if world.world_size == 1:
        return list(per_destination[0])
    packed = [
        None if r == world.rank or not items else _pack(items) for r, items in enumerate(per_destination)
    ]
    sizes = [0 if p is None else _segment_size(*p) for p in packed]
    send = torch.empty(sum(sizes), dtype=torch.uint8)
    for p, chunk in zip(packed, send.split(sizes), strict=True):
        if p is not None:
            _write_segment(chunk, *p)
    received = list(per_destination[world.rank])
    for segment in exchange_bytes(send, sizes, world.device):
        if segment.numel():
            received += _unpack(segment)
    return received
