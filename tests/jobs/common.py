"""What the torchrun test jobs share: the teardown every job needs, the chat prompts, and the images and
videos they put in them."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from PIL import Image


def run_job(main: Callable[[], None]) -> None:
    """Run a job's `main` under torchrun and tear the process group down. A job without vLLM then leaves
    without the interpreter's teardown: gloo's threads race it ("terminate called without an active
    exception", exit -6), seen as a flaky test, last in a fresh-clone CI run of the checkpoint job after every
    rank had finished its work and destroyed the group. A job with a vLLM engine needs that teardown: vLLM's
    CPU engine unlinks its shared-memory segments there (skipping it left `/dev/shm/-tp:0-[0-1]-cpushm_*`
    behind, and the next tensor-parallel engine failed with EEXIST). An exception from `main` still
    propagates (non-zero exit)."""
    import os
    import sys

    from spmd_grpo.parallel.collectives import barrier, destroy

    main()
    barrier()
    destroy()
    if "vllm" not in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def split_at(argv: list[str], flag: str) -> list[list[str]]:
    """The arguments after each `flag`, up to the next one: the cases of a job that runs several in one
    launch. `argv` starts with `flag`."""
    assert argv[:1] == [flag], f"the arguments must start with {flag}, got {argv[:1]}"
    out: list[list[str]] = []
    for arg in argv:
        if arg == flag:
            out.append([])
        else:
            out[-1].append(arg)
    return out


def new_process_group(prefix: str) -> None:
    """Make the default gloo process group again, from torchrun's environment, after vLLM's teardown destroyed
    it (a job that builds several engines in turn). Its rendezvous keys go under `prefix` in torchrun's store:
    those of the first group are still there, and a group made under them again would read them."""
    import os

    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(prefix, store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )


def chat_text(processor, num_images: int, text: str, num_videos: int = 0) -> str:
    """The chat-templated user turn: `num_images` images, `num_videos` videos, then `text`, ready for the
    assistant's answer."""
    content = [{"type": "image"} for _ in range(num_images)] + [{"type": "video"} for _ in range(num_videos)]
    content.append({"type": "text", "text": text})
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


def encode(processor, images: list[Image.Image], text: str) -> dict:
    """HF processor output (input_ids with the images expanded, pixel_values, image_grid_thw) of one prompt."""
    return processor(text=[chat_text(processor, len(images), text)], images=images, return_tensors="pt")


def textured_image(
    seed: int, color: tuple[int, int, int], size: tuple[int, int] | None = None
) -> Image.Image:
    """`color` with per-pixel noise, `size` (width, height) as PIL takes it; by default 112 or 140 pixels wide
    and 168 high (multiples of 28: no resize). Every patch differs, so a patch or window order that differs
    between vLLM's tower and the trainer's changes the logprobs (a solid colour makes every patch the same and
    hides it); the default sizes span 2 or 4 of Qwen2.5-VL's 112-pixel attention windows."""
    rng = np.random.default_rng(seed)
    width, height = size or (112 + 28 * (seed % 2), 168)  # 8 or 10 x 12 patches of 14
    pixels = np.asarray(color, dtype=np.float64) + rng.normal(0, 60, (height, width, 3))
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))


VIDEO_DATA = {"video_min_pixels": 3136, "video_max_pixels": 12544, "video_max_frames": 4}
"""`data.video_*` of the test jobs' videos: 4 frames of 56 x 84 pixels stay a few tokens per temporal patch
(and vLLM profiles its start-up with a 4-frame video, not the largest 768-frame one)."""


def make_video(colors: list[tuple[int, int, int]], rules, seed: int | None = None):
    """A 2-fps video of one colour per frame, through the data layer's encode and decode (`rules`:
    `data.videos.VideoRules`); 56 x 84 frames, solid, or with `seed` textured (`textured_image`)."""
    from spmd_grpo.data.videos import decode_video, encode_video

    frames = [
        Image.new("RGB", (56, 84), c) if seed is None else textured_image(seed * 16 + k, c, (56, 84))
        for k, c in enumerate(colors)
    ]
    return decode_video(encode_video(frames), None, rules)


def video_setup(processor):
    """The `data.prompts.ProcessorSizes` of a run with videos allowed (`VIDEO_DATA`), for `processor`."""
    from spmd_grpo.config.schema import DataConfig
    from spmd_grpo.data.prompts import processor_sizes

    return processor_sizes(DataConfig(**VIDEO_DATA), processor, 1)


def encode_with_videos(processor, images: list[Image.Image], videos: list, text: str, sizes) -> dict:
    """HF processor output of one prompt with `videos` (`data.videos.Video`; at least one) and `images`,
    the run's `sizes` (`video_setup`) and the videos' metadata: the expanded input_ids vLLM returns too."""
    from spmd_grpo.data.prompts import with_video_metadata

    chat = chat_text(processor, len(images), text, num_videos=len(videos))
    call = with_video_metadata(sizes.processor_kwargs(), videos)
    frames = [v.frames for v in videos]
    return processor(text=[chat], images=images or None, videos=frames, return_tensors="pt", **call)


# ------------------------------------------------------------------ tiny MoE models built in memory
MOE_VISION = dict(
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
MOE_TEXT = dict(
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

    from spmd_grpo.models.moe.install import moe_blocks
    from spmd_grpo.tools.make_tiny_model import moderate_decays

    torch.manual_seed(0)
    if family == "qwen3_vl_moe":
        rope = {
            "rope_type": "default",
            "rope_theta": 1e4,
            "mrope_section": [4, 6, 6],
            "mrope_interleaved": True,
        }
        config = tf.Qwen3VLMoeConfig(
            text_config=dict(MOE_TEXT, rope_parameters=rope), vision_config=MOE_VISION
        )
        model = tf.Qwen3VLMoeForConditionalGeneration(config)
    else:
        rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3], "mrope_interleaved": True,
                "partial_rotary_factor": 0.5}  # fmt: skip
        text = dict(MOE_TEXT, rope_parameters=rope, layer_types=["linear_attention", "full_attention"],
                    linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32,
                    linear_value_head_dim=32, shared_expert_intermediate_size=32)  # fmt: skip
        config = tf.Qwen3_5MoeConfig(text_config=text, vision_config=MOE_VISION)
        model = tf.Qwen3_5MoeForConditionalGeneration(config)
    for _, block in moe_blocks(model):  # HF initialises the router at zero: every token would tie
        torch.nn.init.normal_(block.gate.weight, std=0.5)
    moderate_decays(model)  # Qwen3.5-MoE: a linear-attention state that lasts a few tokens
    return model.float()


def moe_tokens(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MOE_TEXT["vocab_size"], (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    return ids, mask


def logprobs(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token logprobs of the next token, [B, L-1], zero on padding."""
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return lp * mask[:, 1:]
