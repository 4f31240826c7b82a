"""Images of a row: decode (bytes, path, PIL), convert to RGB, resize the way the model's processor will, so the
processor's own resize is the identity. A row whose image cannot be decoded or resized raises `BadRow`, the
exception every row check raises: the row is skipped and named at load, not a crash at step N.
"""

from __future__ import annotations

import io
import re
import warnings
from pathlib import Path
from typing import Any

from PIL import Image

from spmd_grpo.config.schema import DataConfig

DEFAULT_IMAGE_FACTOR = 28
"""Pixels per image-token side when no processor says otherwise: patch 14 x spatial merge 2 (Qwen2-VL,
Qwen2.5-VL). Qwen3-VL's processor says 32 (patch 16 x merge 2): the factor comes from the processor."""


_BYTESIO_REPR = re.compile(r" <_io\.BytesIO object at 0x[0-9a-fA-F]+>")


# ------------------------------------------------------------------------------------------ images
class BadRow(Exception):
    """A row that is skipped. `kind` groups rows in the skip log (at most `MAX_NAMED_PER_REASON` named per
    kind); the message is `kind (detail)`."""

    def __init__(self, kind: str, detail: str | None = None) -> None:
        super().__init__(f"{kind} ({detail})" if detail else kind)
        self.kind = kind


def reason_kind(reason: str) -> str:
    return reason.partition(" (")[0]


def image_list(images: Any) -> list:
    """A row's image cell as a list of image entries (None: no images; a single entry: one image)."""
    if images is None:
        return []
    if isinstance(images, Image.Image | bytes | dict | str):
        return [images]
    try:
        return list(images)
    except TypeError:  # a number column named as the image column: the row is bad, not the load
        raise BadRow("images is not a list of images", type(images).__name__) from None


def _open_image(image: Any, base_dir: Path | None) -> Image.Image:
    if isinstance(image, Image.Image):
        return image
    data, path = image, None
    if isinstance(image, dict):
        data, path = image.get("bytes"), image.get("path")
    if isinstance(data, bytes | bytearray):
        return Image.open(io.BytesIO(data))
    if isinstance(data or path, str):
        file = Path(data or path)
        if not file.is_absolute() and base_dir is not None and not file.exists():
            file = base_dir / file
        return Image.open(file)
    raise BadRow("undecodable image", f"no bytes or path in a {type(image).__name__}")


def decode_image(image: Any, base_dir: Path | None) -> Image.Image:
    """The image fully decoded (truncated data fails here, not later) and converted to RGB (`_to_rgb`).
    Images above PIL's decompression-bomb limit (`Image.MAX_IMAGE_PIXELS`, 89.5M pixels) are refused from
    their header, before any pixel is decoded, where PIL alone would warn and decode up to twice that."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            decoded = _open_image(image, base_dir)
            decoded.load()
        return _to_rgb(decoded)
    except BadRow:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise BadRow("image too large", str(e).partition(", could")[0]) from e
    except Exception as e:
        raise BadRow("undecodable image", _BYTESIO_REPR.sub("", str(e)) or type(e).__name__) from e


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB as the model should see the image. PIL's `convert("RGB")` is right for 1, L, P, CMYK, YCbCr, but:
    transparency is composited on white (qwen_vl_utils does so for RGBA; a dropped alpha turns a transparent
    diagram background black); 16-bit grey (I;16*, and I, which 16-bit PNGs open as) is scaled from
    0..65535 (PIL clips at 255: a 16-bit scan turns white); float grey (F) is read as 0..1 when all its
    values lie there, else as 0..255 (clipped; NaN -> 0)."""
    import numpy as np

    mode = image.mode
    if mode == "RGB":
        return image
    if mode in ("RGBA", "LA", "La", "RGBa", "PA") or (mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        rgb = Image.new("RGB", rgba.size, (255, 255, 255))
        rgb.paste(rgba, mask=rgba.getchannel("A"))
        return rgb
    if mode.startswith("I") or mode == "F":
        values = np.nan_to_num(np.asarray(image, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
        if mode != "F":
            values = values / 257.0
        elif values.size and values.min() >= 0.0 and values.max() <= 1.0:
            values = values * 255.0
        grey = np.clip(np.rint(values), 0, 255).astype(np.uint8)
        return Image.fromarray(grey).convert("RGB")
    return image.convert("RGB")


def resized_size(image: Image.Image, cfg: DataConfig, factor: int) -> tuple[int, int]:
    """(width, height) of `image` after qwen_vl_utils.smart_resize into [min_pixels, max_pixels] to multiples
    of `factor` (the processor's patch x merge size): what the processor itself computes, so its own resize
    of the result is the identity and each image is resized once."""
    from qwen_vl_utils import smart_resize

    try:
        height, width = smart_resize(
            image.height, image.width, factor=factor, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels
        )
    except ValueError as e:  # extreme aspect ratio
        raise BadRow("image cannot be resized", str(e)) from e
    if min(width, height) < factor or not cfg.min_pixels <= width * height <= cfg.max_pixels:
        # A thin image under a small max_pixels: smart_resize floors one side to 0 (PIL's resize then fails
        # in the middle of training), and the processor's own rule would exceed max_pixels. Bounds close
        # together: flooring under max_pixels can also land below min_pixels (112x56 at factor 32 in
        # [3136, 6272] -> 96x32), and the processor would scale that up again, to more tokens than load
        # counted and past max_pixels.
        raise BadRow(
            "image cannot be resized",
            f"{image.width}x{image.height} has no {factor}-multiple size within data.min_pixels="
            f"{cfg.min_pixels}, data.max_pixels={cfg.max_pixels} at its aspect ratio",
        )
    return width, height


def resize_image(image: Image.Image, cfg: DataConfig, factor: int) -> Image.Image:
    size = resized_size(image, cfg, factor)
    return image if size == image.size else image.resize(size, Image.Resampling.BICUBIC)
