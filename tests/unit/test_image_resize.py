"""Images are resized once, by the model's own rule: the data loader resizes to multiples of the processor's
patch x merge size (28 for Qwen2-VL and Qwen2.5-VL, 32 for Qwen3-VL), so the image processor that the trainer
and vLLM run afterwards leaves every image at the size it is given."""

from types import SimpleNamespace

import pytest
from PIL import Image
from transformers import Qwen2VLImageProcessor

from spmd_grpo.config.schema import DataConfig
from spmd_grpo.data.images import BadRow, resize_image
from spmd_grpo.data.prompts import image_factor
from spmd_grpo.models.families import FAMILIES

SIZES = [(56, 56), (57, 91), (300, 17 * 28), (1000, 700), (29, 1200), (640, 480)]


def _processor(family) -> Qwen2VLImageProcessor:
    """The image processor a checkpoint of `family` ships (as `tools/make_tiny_model.py` writes it)."""
    return Qwen2VLImageProcessor(
        min_pixels=3136, max_pixels=262144, patch_size=family.patch_size, merge_size=family.merge_size
    )


def _processed_size(processor: Qwen2VLImageProcessor, image: Image.Image) -> tuple[int, int]:
    ((t, h, w),) = processor(images=[image], return_tensors="pt")["image_grid_thw"].tolist()
    return w * processor.patch_size, h * processor.patch_size


@pytest.mark.parametrize("family", FAMILIES.values(), ids=lambda f: f.name)
def test_the_processor_leaves_our_resize_as_it_is(family):
    processor = _processor(family)
    factor = image_factor(SimpleNamespace(image_processor=processor))
    assert factor == family.image_factor
    cfg = DataConfig(min_pixels=3136, max_pixels=262144)
    for size in SIZES:
        resized = resize_image(Image.new("RGB", size, (10, 20, 30)), cfg, factor)
        assert resized.width % factor == 0 and resized.height % factor == 0, (size, resized.size)
        assert _processed_size(processor, resized) == resized.size, (family.name, size, resized.size)


def test_a_qwen2_5_vl_size_is_resized_again_by_the_qwen3_vl_processor():
    """The control: the rule of another family is not the identity under this processor."""
    qwen3 = _processor(FAMILIES["qwen3_vl"])
    cfg = DataConfig(min_pixels=3136, max_pixels=262144)
    resized = resize_image(Image.new("RGB", (57, 91)), cfg, 28)
    assert _processed_size(qwen3, resized) != resized.size


def test_an_image_with_no_size_between_close_bounds_is_a_bad_row():
    """Flooring under max_pixels may land below min_pixels (112x56 at Qwen3-VL's 32 in [3136, 6272] gives
    96x32 = 3072): the processor would scale that up to 128x64, past max_pixels and to more tokens than load
    counted. The row is refused at load instead."""
    family = FAMILIES["qwen3_vl"]
    processor = Qwen2VLImageProcessor(
        min_pixels=3136, max_pixels=6272, patch_size=family.patch_size, merge_size=family.merge_size
    )
    assert _processed_size(processor, Image.new("RGB", (96, 32))) == (128, 64)
    cfg = DataConfig(min_pixels=3136, max_pixels=6272)
    with pytest.raises(BadRow, match="112x56 has no 32-multiple size within data.min_pixels=3136"):
        resize_image(Image.new("RGB", (112, 56)), cfg, family.image_factor)
    assert resize_image(Image.new("RGB", (112, 56)), cfg, 28).size == (112, 56)  # 28 fits these bounds
