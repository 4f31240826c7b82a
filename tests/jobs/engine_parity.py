"""torchrun job: FSDP2 policy + in-process vLLM per rank; generate with images, update, push, compare.

    torchrun --nproc_per_node 2 tests/jobs/engine_parity.py MODEL_DIR OUT_JSON [--tp 2]
    torchrun --nproc_per_node 2 tests/jobs/engine_parity.py --case MODEL_DIR OUT_JSON [...] --case ...

With `--case`, one launch runs several cases in turn (each with its own options; the start-up of torch, vLLM and
transformers is paid once): after a case, vLLM's teardown destroys the process group, and the next case makes
a new one under its own prefix in torchrun's store.

Prompts alternate between 1 and 2 textured images (`textured_image`); with `--videos`
(worker.rollout.limit_videos=1) they cycle through 1-2 images, one video, and one image + one video (4-frame
MPEG-4 videos of textured frames, decoded by the data layer's rules), and the trainer's forwards run the tower
on video input (dummy where a batch has none). Writes one JSON per
rank (OUT_JSON with `.rank{r}` before the
suffix) holding:
  dummy_diff_max     the same before the first push (vLLM starts with dummy weights: large)
  pre_diff_max       max |vLLM - trainer| per response token before any update (both at the initial weights)
  new_diff_max       after an optimizer step + weight push: max |vLLM - trainer(new weights)|
  old_diff_max       on the same samples: max |vLLM - trainer(old weights)| (shows the engine's logprobs moved)
  lora_second_diff_max (--lora-rank only) a second optimizer step + push: the step after a sync that already
                       carried adapters (merged base + B A weights must be pushed again, not skipped as frozen)
  nosync_new_diff_max  after a further optimizer step WITHOUT a push: max |vLLM - trainer(new weights)|
                       (large: proves the parity check can fail)
  nosync_old_diff_max  ... and against the weights the engine still holds (small)
  group_outputs      token ids of every sample the TP group generated (identical within a group)
  unbucketed         sharded parameters the push would gather whole outside its buckets (none expected)
  expert_meshes      the mesh dimension names of the expert weights (("efsdp", "ep") under expert parallelism)
  own_uids           uids of the prompts whose samples this rank kept
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from spmd_grpo.actor.micro_batches import collate_samples
from spmd_grpo.config.loader import load_config
from spmd_grpo.data.prompts import processor_sizes
from spmd_grpo.data.samples import Prompt
from spmd_grpo.models.build import build_policy
from spmd_grpo.parallel.collectives import init_distributed, new_tp_groups
from spmd_grpo.rollout.engine import RolloutEngine
from spmd_grpo.rollout.generate import (
    SamplingConfig,
    attach_pixel_values,
    attach_video_inputs,
    generate,
    generate_for_group,
)
from spmd_grpo.rollout.weight_sync import is_row_sharded
from tests.jobs.common import (
    VIDEO_DATA,
    chat_text,
    make_video,
    new_process_group,
    run_job,
    split_at,
    textured_image,
)

COLORS = [(220, 30, 30), (30, 200, 40), (40, 60, 220), (230, 220, 30)]
CASE_MARK = "engine_parity: case"


def make_prompts(processor, rank: int, per_rank: int, video_rules=None) -> list[Prompt]:
    prompts = []
    for i in range(per_rank):
        uid = rank * per_rank + i
        # 0: 1-2 images, 1: a video, 2: image + video (2 prompts a rank: rank 0 images, video; rank 1
        # image + video, 2 images)
        kind = uid % 3 if video_rules is not None else 0
        num_images = (1 + i % 2) if kind == 0 else kind - 1
        images = [textured_image(uid * 2 + j, COLORS[(uid + j) % len(COLORS)]) for j in range(num_images)]
        videos = (
            [make_video([COLORS[(uid + k) % len(COLORS)] for k in range(4)], video_rules, seed=uid)]
            if kind
            else []
        )
        text = chat_text(processor, len(images), f"Which color? {uid}", num_videos=len(videos))
        ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        prompts.append(Prompt(uid=uid, prompt_token_ids=ids, images=images, videos=videos))
    return prompts


VIDEOS = {"video_in_forward": False}  # --videos: every trainer forward runs the tower on video input


def trainer_logprobs(policy, samples, pad_id: int) -> list[list[float]]:
    batch = collate_samples(samples, pad_id, next(policy.parameters()).device, **VIDEOS)
    with torch.no_grad():
        lp, _ = policy(batch)
    return [lp[i, : len(s.response_ids)].tolist() for i, s in enumerate(samples)]


def mean_diff(samples, trainer_lps) -> float:
    diffs = [
        abs(a - b)
        for s, t in zip(samples, trainer_lps, strict=True)
        for a, b in zip(s.rollout_logprobs, t, strict=True)
    ]
    return sum(diffs) / max(1, len(diffs))


def max_diff(samples, trainer_lps) -> float:
    return max(
        (
            abs(a - b)
            for s, t in zip(samples, trainer_lps, strict=True)
            for a, b in zip(s.rollout_logprobs, t, strict=True)
        ),
        default=0.0,
    )


def parse_cases(argv: list[str]) -> list[argparse.Namespace]:
    """One case per `--case` (its arguments up to the next `--case`); without it, `argv` is one case."""
    if "--case" not in argv:
        return [case_parser().parse_args(argv)]
    cases = [case_parser().parse_args(chunk) for chunk in split_at(argv, "--case")]
    assert len({c.device for c in cases}) == 1, "one launch runs cases of one device"
    return cases


TIMEOUT_S = 1800  # the default group's, which the TP groups take (trainer.collective_timeout_s's default)


def process_group(case_index: int, device: str):
    """The default process group for case `case_index`: the first is made from torchrun's environment; vLLM's
    teardown of the previous case destroyed it, so a later one is made again (`new_process_group`)."""
    import torch.distributed as dist

    if case_index > 0 and not dist.is_initialized():
        new_process_group(f"engine_parity_case{case_index}")
    return init_distributed(device, timeout_s=TIMEOUT_S)


def main() -> None:
    import gc

    for i, args in enumerate(parse_cases(sys.argv[1:])):
        for stream in (sys.stdout, sys.stderr):  # the test reads each case's own output
            print(f"{CASE_MARK} {i}", file=stream, flush=True)
        # vLLM collects the whole heap three times while it builds an engine (about 0.3 s each with torch,
        # transformers and vLLM imported); frozen, those passes skip what every case shares. The previous
        # case's policy, optimizer and engine are collected first, and vLLM's shutdown unfreezes the heap.
        gc.collect()
        gc.freeze()
        run_case(args, process_group(i, args.device))


def case_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out_json")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--prompts-per-rank", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu here; cuda/npu in the gpu tier (tests/gpu)")
    ap.add_argument("--dtype", default="float32", help="trainer compute and rollout dtype")
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument("--videos", action="store_true", help="video and image+video prompts too")
    ap.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (0: full)")
    ap.add_argument("--lora-targets", default="all-linear", help="worker.actor.model.lora.target_modules")
    ap.add_argument("--lora-sync", default="merged", help="worker.rollout.lora_sync")
    ap.add_argument("--lora-exclude", default=None, help="worker.actor.model.lora.exclude_modules")
    ap.add_argument("--expert-parallel", type=int, default=1, help="worker.actor.fsdp.expert_parallel_size")
    return ap


def run_case(args: argparse.Namespace, world) -> None:
    from transformers import AutoProcessor

    torch.manual_seed(0)
    tp_group = new_tp_groups(world, args.tp)
    processor = AutoProcessor.from_pretrained(args.model_dir)
    # The engine is built from a run config as the trainer builds it (`RolloutEngine.from_config`); 1 MiB
    # buckets so the tiny model's push spans several buckets.
    cfg = load_config(
        None,
        [
            f"worker.actor.model.model_path={args.model_dir}",
            f"worker.actor.model.trust_remote_code={args.trust_remote_code}",
            f"worker.actor.fsdp.param_dtype={args.dtype}",
            f"worker.rollout.tensor_parallel_size={args.tp}",
            f"worker.rollout.dtype={args.dtype}",
            "worker.rollout.limit_images=2",
            "worker.rollout.weight_sync_bucket_mb=1",
            "trainer.seed=0",
            *([f"worker.rollout.limit_videos={int(args.videos)}"] if args.videos else []),
            *([f"data.{k}={v}" for k, v in VIDEO_DATA.items()] if args.videos else []),
            f"worker.actor.model.lora.rank={args.lora_rank}",
            f"worker.actor.model.lora.target_modules={args.lora_targets}",
            f"worker.rollout.lora_sync={args.lora_sync}",
            *([f"worker.actor.model.lora.exclude_modules={args.lora_exclude}"] if args.lora_exclude else []),
            f"worker.actor.fsdp.expert_parallel_size={args.expert_parallel}",
        ],
    )
    VIDEOS["video_in_forward"] = args.videos
    sizes = processor_sizes(cfg.data, processor, cfg.worker.rollout.limit_videos)  # as the trainer makes them
    policy = build_policy(cfg.worker.actor, world)
    tie = bool(policy.config.tie_word_embeddings)
    engine = RolloutEngine.from_config(cfg, world, tie_word_embeddings=tie, sizes=sizes)
    pad_id = processor.tokenizer.pad_token_id
    eos = [processor.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    prompts = make_prompts(processor, world.rank, args.prompts_per_rank, sizes.video if args.videos else None)
    sampling = SamplingConfig(
        n=2, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=12, seed=0, stop_token_ids=tuple(eos)
    )

    def rollout(step: int):
        samples = generate(engine, prompts, sampling, step=step, tp_group=tp_group)
        attach_pixel_values(samples, processor.image_processor, sizes)
        attach_video_inputs(samples, processor, sizes, engine.dtype)
        return samples

    # 1. Before any update: the engine (dummy weights, then the first push) and the trainer agree.
    s0 = rollout(step=0)  # the engine still holds vLLM's dummy weights: far from the trainer
    dummy_diff = max_diff(s0, trainer_logprobs(policy, s0, pad_id))
    with engine.rollout_mode(policy, 0):  # the first push carries every weight
        s1 = rollout(step=0)
    pre_diff = max_diff(s1, trainer_logprobs(policy, s1, pad_id))

    # 2. A real optimizer step (large lr so every weight, tied head included, moves visibly), then a push.
    optim = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=5e-2)

    def update_and_compare(samples, step: int, push: bool) -> tuple[float, float]:
        batch = collate_samples(samples, pad_id, next(policy.parameters()).device, **VIDEOS)
        optim.zero_grad()
        lp, _ = policy(batch)
        (-(lp * batch.response_mask).sum() / batch.response_mask.sum()).backward()
        old_shards = [p.to_local().detach().clone() for p in policy.parameters()]
        optim.step()
        # 3. The engine must now sample from (and report logprobs of) the weights it was given: the
        # production path (rollout_mode pushes the policy when the engine holds another version).
        if push:
            with engine.rollout_mode(policy, step):
                after = rollout(step=step)
        else:
            after = rollout(step=step)
        new_lps = trainer_logprobs(policy, after, pad_id)
        new_shards = [p.to_local().detach().clone() for p in policy.parameters()]
        with torch.no_grad():
            for p, old in zip(policy.parameters(), old_shards, strict=True):
                p.to_local().copy_(old)
        old_lps = trainer_logprobs(policy, after, pad_id)
        with torch.no_grad():
            for p, new in zip(policy.parameters(), new_shards, strict=True):
                p.to_local().copy_(new)
        means.update(new=mean_diff(after, new_lps), old=mean_diff(after, old_lps))
        return max_diff(after, new_lps), max_diff(after, old_lps), after

    means: dict[str, float] = {}
    new_diff, old_diff, s2 = update_and_compare(s1, step=1, push=True)
    new_mean, old_mean = means["new"], means["old"]
    sync_seconds = engine.stats.last_sync_s
    lora_second = None
    if args.lora_rank:
        lora_second, _, s2 = update_and_compare(s2, step=2, push=True)
    nosync_new, nosync_old, _ = update_and_compare(s2, step=3, push=False)

    group = [s for _, s in generate_for_group(engine, prompts, sampling, step=4, tp_group=tp_group)]
    result = {
        "rank": world.rank,
        "tp": args.tp,
        "tied": tie,
        "dummy_diff_max": dummy_diff,
        "pre_diff_max": pre_diff,
        "new_diff_max": new_diff,
        "old_diff_max": old_diff,
        "lora_second_diff_max": lora_second,
        "nosync_new_diff_max": nosync_new,
        "nosync_old_diff_max": nosync_old,
        "new_diff_mean": new_mean,
        "old_diff_mean": old_mean,
        "sync_seconds": sync_seconds,
        "num_response_tokens": sum(len(s.response_ids) for s in s2),
        "own_uids": sorted({s.prompt.uid for s in s2}),
        "my_prompt_uids": [p.uid for p in prompts],
        "group_outputs": [[s.prompt.uid, s.sample_index, s.response_ids] for s in group],
        "media": [[len(p.images), len(p.videos)] for p in prompts],
        "sync_bytes": engine.stats.last_sync_bytes,
        "lora_ids": sorted(engine.llm.llm_engine.list_loras()) if engine.adapters else [],
        "engine": engine.settings(),
        # Sharded weights the push gathers whole, outside its buckets (none: every shard is a block of rows)
        "unbucketed": [
            n for n, t in policy.named_parameters() if isinstance(t, DTensor) and not is_row_sharded(t)
        ],
        "expert_meshes": sorted(
            {str(t.device_mesh.mesh_dim_names) for n, t in policy.named_parameters() if ".experts." in n}
        ),
    }
    out = Path(args.out_json)
    out.with_name(f"{out.stem}.rank{world.rank}{out.suffix}").write_text(json.dumps(result))
    print(json.dumps({k: v for k, v in result.items() if k != "group_outputs"}), file=sys.stderr)
    engine.shutdown()  # vLLM's teardown destroys the default group: do it now, not at interpreter exit


if __name__ == "__main__":
    run_job(main)
