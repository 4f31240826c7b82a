"""Rollout: turn this rank's prompts into sampled responses with the in-process vLLM engine.

Each rank owns its prompts and all `n` samples of each (GRPO groups are local by default). With tensor
parallelism the ranks of a TP group (consecutive ranks) must submit identical requests: prompts are
all-gathered inside the group, the group generates all of them, and each rank keeps exactly the outputs of
its own prompts (`generate`); `generate_for_group` returns the whole group's outputs with their owners.

Every request carries its own seed, derived from (seed, step, generation batch, prompt uid, sample index):
the samples do not depend on how requests are batched or which rank generates them, and resuming a run
reproduces them. `n` samples are submitted as n single-sample requests (vLLM would give the n children of
one request the seeds seed, seed+1, ..., tied to the request rather than to the sample's coordinates).

What the n requests of a prompt share, measured on the vLLM 0.32 CPU engine (tiny random model, 8 prompts
x 8 samples, one 224 x 224 image each, chunked prefill off as here; `benchmarks/rollout_sharing.py`):
the vision encoder ran on 8 images for the 64 requests (vLLM's encoder cache keys images by content), so
the image is encoded once per prompt already (also with prefix caching off, and with SamplingParams(n)).
The prefill was NOT shared: 0 prefix-cache hits of 6,144 queried prompt tokens, the 96-token prompts being
shorter than one 128-token CPU KV block (only whole blocks are cached). Whether longer prompts whose n
requests are scheduled in the same step hit the cache was not measured. `SamplingParams(n)` would not change that in vLLM 0.32: its front end processes the
prompt once and then adds n child requests (child i seeded seed + i) to the scheduler, like ours.

Text: the requests ask vLLM for token ids only (`detokenize=False`, as verl and TRL do); each response's text
is then the tokenizer's decode of its whole sequence, special tokens dropped, in one batch. vLLM's
incremental detokenizer runs on the critical path of an in-process engine (4 % of a CPU rollout of 64-token
responses). The texts differ only where a response ends inside a multi-byte character: vLLM leaves the
incomplete bytes out, the decode writes U+FFFD for them.

A `Sample` is the one record of everything known about a response as the step goes on: the rollout fills
the tokens and vLLM's logprobs, the reward its `scores`, the trainer its `old_logprobs`, `ref_logprobs` and
`advantage`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from spmd_grpo.data.prompts import ProcessorSizes, with_video_metadata
from spmd_grpo.data.samples import Prompt, Sample
from spmd_grpo.parallel.collectives import all_gather_objects


@dataclass(frozen=True)
class SamplingConfig:
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    seed: int
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    """Generate `max_tokens` tokens whatever is sampled (no stop token applies)."""


def request_seed(seed: int, step: int, uid: int, sample_index: int, gen_batch: int = 0) -> int:
    """A per-request seed that is a pure function of its coordinates (fits in 63 bits)."""
    key = (((seed * 1_000_003 + step) * 1_000_033 + gen_batch) * 1_000_037 + uid) * 1_009 + sample_index
    return key % (2**63 - 1)


def _sampling_params(sampling: SamplingConfig, seed: int):
    from vllm import SamplingParams

    return SamplingParams(
        n=1,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_tokens=sampling.max_tokens,
        seed=seed,
        logprobs=0,
        stop_token_ids=[] if sampling.ignore_eos else list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        detokenize=False,  # the text comes from one batch decode afterwards (module docstring)
    )


def _sample(prompt: Prompt, sample_index: int, output, text: str, gen_batch: int) -> Sample:
    completion = output.outputs[0]
    ids = list(completion.token_ids)
    return Sample(
        prompt=prompt,
        sample_index=sample_index,
        prompt_ids=list(output.prompt_token_ids),
        response_ids=ids,
        rollout_logprobs=[lp[tok].logprob for lp, tok in zip(completion.logprobs, ids, strict=True)],
        response_text=text,
        finish_reason=completion.finish_reason or "length",
        gen_batch=gen_batch,
        group_index=prompt.uid,
        routes=_routes(getattr(completion, "routed_experts", None)),
    )


def _routes(routed_experts) -> torch.Tensor | None:
    """vLLM's routed experts of a sequence ([tokens, decoder layers, top-k], uint8 or uint16 numpy, with
    `enable_return_routed_experts`) as the trainer keeps them: int16 (expert ids stay below 2**15)."""
    if routed_experts is None:
        return None
    return torch.from_numpy(routed_experts.astype("int16"))


def generate_for_group(
    engine, prompts: list[Prompt], sampling: SamplingConfig, *, step: int, gen_batch: int = 0, tp_group=None
) -> list[tuple[int, Sample]]:
    """Sample `n` responses for every prompt of this rank's TP group (all of them, on every rank of it).

    Returns `(slot, sample)` in (slot, prompt, sample) order, `slot` being the rank within the TP group that
    owns the prompt.
    """
    from vllm.inputs import TokensPrompt

    group_prompts = [prompts] if tp_group is None else all_gather_objects(prompts, group=tp_group)
    requests, params, owners = [], [], []
    for slot, rank_prompts in enumerate(group_prompts):
        for p in rank_prompts:
            data = {"prompt_token_ids": p.prompt_token_ids}
            media = {"image": list(p.images), "video": [v.for_vllm() for v in p.videos]}
            if p.images or p.videos:  # frames with the metadata Qwen3-VL's timestamps and mrope read
                data["multi_modal_data"] = {kind: items for kind, items in media.items() if items}
            for k in range(sampling.n):
                requests.append(TokensPrompt(**data))
                params.append(
                    _sampling_params(sampling, request_seed(sampling.seed, step, p.uid, k, gen_batch))
                )
                owners.append((slot, p, k))
    # A rank's last validation batch may hold no prompts (validation.py): nothing to ask the engine.
    outputs = engine.generate(requests, params) if requests else []
    texts = engine.decode([list(out.outputs[0].token_ids) for out in outputs]) if outputs else []
    return [
        (slot, _sample(p, k, out, text, gen_batch))
        for (slot, p, k), out, text in zip(owners, outputs, texts, strict=True)
    ]


def generate(
    engine, prompts: list[Prompt], sampling: SamplingConfig, *, step: int, gen_batch: int = 0, tp_group=None
) -> list[Sample]:
    """Sample `n` responses for each of this rank's prompts; returns them in (prompt, sample) order."""
    my_slot = 0 if tp_group is None else dist.get_rank(tp_group)
    group = generate_for_group(engine, prompts, sampling, step=step, gen_batch=gen_batch, tp_group=tp_group)
    return [s for slot, s in group if slot == my_slot]


def attach_pixel_values(samples: list[Sample], image_processor, sizes: ProcessorSizes) -> None:
    """Trainer-side pixel values, computed once per prompt and shared by its n samples (keyed by the Prompt
    object: after DAPO rebalancing one uid can name prompts of several generation batches), with the run's
    image `sizes` (what vLLM's processor gets)."""
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for s in samples:
        if not s.prompt.images or s.prompt.videos:  # with videos: `attach_video_inputs` does both
            continue
        if id(s.prompt) not in cache:
            enc = image_processor(images=s.prompt.images, size=sizes.image_size(), return_tensors="pt")
            cache[id(s.prompt)] = (enc["pixel_values"], enc["image_grid_thw"])
        s.pixel_values, s.image_grid_thw = cache[id(s.prompt)]


def attach_video_inputs(
    samples: list[Sample], processor, sizes: ProcessorSizes, rollout_dtype: torch.dtype
) -> None:
    """Trainer-side inputs of prompts with videos, once per prompt and shared by its samples, from the
    processor vLLM runs with the same sizes (`sizes.processor_kwargs()`) and metadata: a prompt's
    images and videos go through one call, so `pixel_values`/`image_grid_thw` are replaced too, and the
    video's `pixel_values_videos`, `video_grid_thw` and (Qwen2.5-VL) `second_per_grid_ts` are kept. The
    call's text (one pad token per image and video) only places them; its ids are dropped (the samples'
    prompt ids are vLLM's).

    `second_per_grid_ts` is rounded to `rollout_dtype` (held in float32): vLLM casts every floating output
    of its processor to the engine's dtype and reads its video mrope time positions from that value, so a
    bf16 engine places a 30 fps clip sampled to 1.016667 s per temporal patch at 1.015625 s; the trainer's
    positions must come from the same number (with 4 tokens per second they differ by one from the 32nd
    temporal patch on)."""
    cache: dict[int, tuple] = {}
    for s in samples:
        p = s.prompt
        if not p.videos:
            continue
        if id(p) not in cache:
            text = processor.image_token * len(p.images) + processor.video_token * len(p.videos)
            enc = processor(
                text=[text],
                images=list(p.images) or None,
                videos=[v.frames for v in p.videos],
                return_tensors="pt",
                **with_video_metadata(sizes.processor_kwargs(), p.videos),
            )
            video = {k: enc[k] for k in VIDEO_INPUTS if k in enc}
            if "second_per_grid_ts" in video:
                seconds = torch.as_tensor(video["second_per_grid_ts"], dtype=torch.float32)
                video["second_per_grid_ts"] = seconds.to(rollout_dtype).float()
            cache[id(p)] = (enc.get("pixel_values"), enc.get("image_grid_thw"), video)
        s.pixel_values, s.image_grid_thw, s.video_inputs = cache[id(p)]


VIDEO_INPUTS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
"""The processor outputs of a prompt's videos the model's forward takes."""
