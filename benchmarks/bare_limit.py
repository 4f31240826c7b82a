"""Our step against this machine's bare limit: each phase of a GRPO step timed beside the plainest code that
does the same work, in one run, so that ours / bare says what the framework costs.

    python benchmarks/bare_limit.py [--dtypes float32,bfloat16] [--ranks 1,2] [--steps 5] [--prompts 16]
        [--response-length 64] [--threads 2] [--set KEY=VALUE ...] [--out result.json]

The workload (the 'small' one): a generated ~29M-parameter Qwen2.5-VL (hidden 512, 8 layers; the model of
benchmarks/step_throughput.py, built once into .cache/bench_tput_model, no download), the built-in colour
task, `--prompts` prompts x 8 samples of exactly `--response-length` tokens (`worker.rollout.ignore_eos`:
the same token count in every run and every step, so that the bare runs do the same work), no KL term, one
mini-batch per step (so no separate old-logprob pass: the update's own forward gives them), 4 sequences per
update micro-batch, the vision tower frozen.

For each dtype (the policy's compute dtype and vLLM's):
- bare, each phase in a process of its own with `--threads` threads and no torch.distributed:
  (a) gen: `vllm.LLM` built with the engine settings our config gives (`rollout.vllm_args.llm_kwargs`, the one
      place our engine's arguments come from; real weights from disk, the uniproc executor with the engine
      core in this process instead of `external_launcher`), generating the same requests (same prompts and image, 8 seeded requests per
      prompt, `logprobs=0`, `ignore_eos`).
  (b) update: the HF model in that dtype, no FSDP, no code of ours: per micro-batch of 4 sequences one
      forward (pixels in), log-softmax of the response tokens, loss -(A * logp).sum() / tokens, backward;
      then `AdamW(foreach=True)` over the language model's parameters. This is the plain-dtype limit: in
      bf16 its parameters and optimizer state are bf16 (ours keeps fp32 master weights and fp32 gradient
      accumulation, as every mixed-precision trainer does), so it is a lower bound, not an equal.
- ours: `python -m spmd_grpo.train` under torchrun at each of `--ranks` ranks (the same `--threads` cores
  split between them: 1 rank x 2 threads, 2 ranks x 1 thread), the medians of its `timing_s/*` over the
  steps after the first.

Printed per dtype and rank count: the phases (gen includes our weight sync, also shown alone), ours / bare
per phase and for the whole step (bare total = gen + update), the wait before the advantage collective
(`adv`: on this uniform workload any wait there is the other rank's slower generation or ours), and the
update's bf16 speed-up over fp32, ours and bare. The medians are over steps (ours) and rounds (bare) after
the first, which warms vLLM and the allocators.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.step_throughput import MODEL_SPEC, RUN_CONTROL  # noqa: E402

MICRO_BATCH = 4
QUESTION = "Which color? Answer with a digit."


def workload(args: argparse.Namespace, model_dir: Path, dtype: str) -> list[str]:
    """The config overrides of the workload (ours runs them; the bare runs read the config they give)."""
    return [
        f"worker.actor.model.model_path={model_dir}",
        f"worker.actor.fsdp.param_dtype={dtype}",
        f"worker.rollout.dtype={dtype}",
        f"data.rollout_batch_size={args.prompts}",
        f"data.max_response_length={args.response_length}",
        "worker.rollout.n=8",
        "worker.rollout.ignore_eos=true",
        f"worker.actor.global_batch_size={8 * args.prompts}",
        f"worker.actor.micro_batch_size_per_device_for_update={MICRO_BATCH}",
        "worker.actor.model.freeze_vision_tower=true",
        "algorithm.use_kl_loss=false",
        *RUN_CONTROL,
    ]


def later_median(xs: list[float]) -> float:
    return statistics.median(xs[1:] or xs)


def later_steps(steps: int) -> str:
    """What `later_median` takes the figures over, for the report's header."""
    return f"medians of steps/rounds 2..{steps}" if steps > 1 else "1 step/round, the warm-up (no later one)"


# ------------------------------------------------------------------------------------------------ ours
OURS_PHASES = ["gen", "update_weights", "reward", "adv", "old_log_prob", "update_actor", "step"]


def run_ours(args: argparse.Namespace, model_dir: Path, dtype: str, ranks: int, work: Path) -> dict:
    name = f"ours_{dtype}_{ranks}"
    cmd = [
        sys.executable, "-m", "spmd_grpo.launch", "--standalone", "--nproc_per_node", str(ranks),
        "-m", "spmd_grpo.train", str(REPO / "configs" / "smoke.yaml"), f"trainer.max_steps={args.steps}",
        f"trainer.output_dir={work}", f"trainer.experiment_name={name}", *workload(args, model_dir, dtype),
        *args.set,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // ranks)), "PYTHONPATH": str(REPO)}
    print(f"[bare-limit] ours: {dtype}, {ranks} rank(s)", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    lines = (work / name / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if r.get("step", 0) > 0]
    lengths = {(r["response_length/min"], r["response_length/max"]) for r in rows}
    if lengths != {(args.response_length, args.response_length)}:
        raise SystemExit(
            f"{name}: response lengths {lengths}, expected all {args.response_length} (ignore_eos)"
        )
    return {p: later_median([r.get(f"timing_s/{p}", 0.0) for r in rows]) for p in OURS_PHASES}


# ------------------------------------------------------------------------------------------------ bare
def _prompts(processor, count: int) -> tuple[str, list]:
    """The colour task's chat text and `count` solid-colour 56 x 56 images (one per prompt)."""
    from PIL import Image

    content = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return text, [Image.new("RGB", (56, 56), ((60 * p) % 255, 120, 200)) for p in range(count)]


def bare_gen(cfg, dtype: str, text: str, images: list, rounds: int, sizes) -> list[float]:
    """(a): plain vLLM, the same engine settings (`sizes`: the run's `data.prompts.processor_sizes`) and
    requests; seconds per round."""
    from vllm import LLM, SamplingParams

    from spmd_grpo.rollout.vllm_args import llm_kwargs

    rollout = cfg.worker.rollout
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(rollout.kv_cache_memory_gb))))
    kwargs = llm_kwargs(
        cfg.worker.actor.model.model_path,
        rollout,
        trust_remote_code=False,
        max_model_len=cfg.max_model_len,
        mm_processor_kwargs=sizes.processor_kwargs(),
    )
    for key in ("distributed_executor_backend", "load_format"):
        kwargs.pop(key)
    llm = LLM(**kwargs, dtype=dtype, seed=cfg.trainer.seed)
    max_tokens = cfg.data.max_response_length
    requests = [
        {"prompt": text, "multi_modal_data": {"image": [image]}} for image in images for _ in range(8)
    ]
    seconds = []
    for r in range(rounds):
        params = [
            SamplingParams(
                temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, seed=r * 10_000 + i
            )
            for i in range(len(requests))
        ]
        start = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        assert {len(o.outputs[0].token_ids) for o in outputs} == {max_tokens}
    return seconds


def bare_update(
    model_dir: Path, dtype: str, text: str, images: list, length: int, rounds: int
) -> list[float]:
    """(b): plain transformers + torch: forward, backward and AdamW over the same tokens; seconds per round."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    torch_dtype = getattr(torch, dtype)
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch_dtype)
    model.model.visual.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-6, foreach=True)
    gen = torch.Generator().manual_seed(0)
    sequences = []  # (input_ids [1, L], pixel_values, image_grid_thw, advantage)
    for image in images:
        enc = processor(text=[text], images=[image], return_tensors="pt")
        for _ in range(8):
            response = torch.randint(0, 256, (1, length), generator=gen)
            ids = torch.cat([enc["input_ids"], response], dim=1)
            adv = torch.randn((), generator=gen)
            sequences.append((ids, enc["pixel_values"], enc["image_grid_thw"], adv))
    num_tokens = len(sequences) * length
    seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        for i in range(0, len(sequences), MICRO_BATCH):
            part = sequences[i : i + MICRO_BATCH]
            ids = torch.cat([s[0] for s in part])
            mm_types = torch.zeros_like(ids)
            mm_types[ids == model.config.image_token_id] = 1
            logits = model(
                input_ids=ids,
                pixel_values=torch.cat([s[1] for s in part]).to(torch_dtype),
                image_grid_thw=torch.cat([s[2] for s in part]),
                mm_token_type_ids=mm_types,
                use_cache=False,
            ).logits[:, -length - 1 : -1]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -length:, None]).squeeze(-1)
            adv = torch.stack([s[3] for s in part])[:, None]
            (-(adv * logp).sum() / num_tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
    return seconds


def bare_worker(args: argparse.Namespace, model_dir: Path, phase: str, dtype: str) -> float:
    """One bare phase in this process: a process of its own for each, since vLLM changes process-wide
    settings (after an in-process uniproc vLLM engine, a bf16 update here ran about 10x slower)."""
    import torch
    from transformers import AutoProcessor

    from spmd_grpo.config.loader import load_config
    from spmd_grpo.data.prompts import processor_sizes

    torch.set_num_threads(args.threads)
    cfg = load_config(REPO / "configs" / "smoke.yaml", workload(args, model_dir, dtype))
    processor = AutoProcessor.from_pretrained(model_dir)
    text, images = _prompts(processor, args.prompts)
    if phase == "gen":
        sizes = processor_sizes(cfg.data, processor, cfg.worker.rollout.limit_videos)
        return later_median(bare_gen(cfg, dtype, text, images, args.steps, sizes))
    return later_median(bare_update(model_dir, dtype, text, images, args.response_length, args.steps))


def run_bare(args: argparse.Namespace, model_dir: Path, dtype: str, work: Path) -> dict:
    out = {}
    for phase in ("gen", "update_actor"):
        result = work / f"bare_{phase}_{dtype}.json"
        cmd = [sys.executable, __file__, "--bare-worker", f"{phase}:{dtype}", "--model-dir", str(model_dir)]
        cmd += ["--out", str(result), "--steps", str(args.steps), "--prompts", str(args.prompts)]
        cmd += ["--response-length", str(args.response_length), "--threads", str(args.threads)]
        # In-process engine core, as ours (vLLM turns its engine-core process off under external_launcher).
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        print(f"[bare-limit] bare {phase}: {dtype}", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(
                f"bare {phase} {dtype} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}"
            )
        out[phase] = json.loads(result.read_text())
    return out


# ------------------------------------------------------------------------------------------------ report
def cpu_flags() -> str:
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return " ".join(shown) or "none of avx2/avx512f/avx512_bf16/amx_bf16"


def print_report(results: dict, args: argparse.Namespace) -> None:
    print(f"workload: {args.prompts} prompts x 8 samples x {args.response_length} tokens, no KL, "
          f"{args.threads} cores; CPU flags: {cpu_flags()}; {later_steps(args.steps)}")  # fmt: skip
    print("| dtype | ranks | gen ours / bare (s) | sync (s) | adv wait (s) | update ours / bare (s) | "
          "step ours / bare (s) | gen x | update x | total x |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for dtype, per_dtype in results.items():
        bare = per_dtype["bare"]
        bare_total = bare["gen"] + bare["update_actor"]
        for ranks, ours in per_dtype["ours"].items():
            print(
                f"| {dtype} | {ranks} | {ours['gen']:.2f} / {bare['gen']:.2f} | {ours['update_weights']:.2f} | "
                f"{ours['adv']:.2f} | {ours['update_actor']:.2f} / {bare['update_actor']:.2f} | "
                f"{ours['step']:.2f} / {bare_total:.2f} | {ours['gen'] / bare['gen']:.2f} | "
                f"{ours['update_actor'] / bare['update_actor']:.2f} | {ours['step'] / bare_total:.2f} |"
            )
    if {"float32", "bfloat16"} <= results.keys():
        fp32, bf16 = results["float32"], results["bfloat16"]
        for ranks in fp32["ours"]:
            if ranks in bf16["ours"]:
                speedup = fp32["ours"][ranks]["update_actor"] / bf16["ours"][ranks]["update_actor"]
                print(f"update bf16 speed-up over fp32, ours at {ranks} rank(s): {speedup:.2f}x")
        speedup = fp32["bare"]["update_actor"] / bf16["bare"]["update_actor"]
        print(f"update bf16 speed-up over fp32, bare: {speedup:.2f}x")
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}")


def check_configs(ap: argparse.ArgumentParser, args: argparse.Namespace, model_dir: Path) -> None:
    """Our config at every dtype and rank count, before the bare runs: arguments that one of our runs
    refuses (e.g. an odd --prompts with --ranks 2) stop here in one line, not after minutes of bare runs."""
    from spmd_grpo.config.checks import ConfigError
    from spmd_grpo.config.loader import load_config
    from spmd_grpo.config.validate import validate

    for dtype in args.dtypes.split(","):
        for ranks in map(int, args.ranks.split(",")):
            try:
                cfg = load_config(
                    REPO / "configs" / "smoke.yaml", [*workload(args, model_dir, dtype), *args.set]
                )
                validate(cfg, ranks)
            except (ConfigError, ValueError) as e:
                ap.error(f"{dtype} at {ranks} rank(s): {e}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument(
        "--steps", type=int, default=5, help="steps of ours and rounds of bare (the first: warm-up)"
    )
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--response-length", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="cores for each run (split between ranks)")
    ap.add_argument("--set", action="append", default=[], help="extra KEY=VALUE override for our runs")
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--bare-worker", default=None, help=argparse.SUPPRESS)
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    from spmd_grpo.tools.make_tiny_model import TinyModelSpec, cached_tiny_model

    if not args.bare_worker:
        check_configs(ap, args, args.model_dir or Path("unbuilt"))
    model_dir = args.model_dir or cached_tiny_model(
        REPO / ".cache" / "bench_tput_model", TinyModelSpec(**MODEL_SPEC)
    )
    if args.bare_worker:
        phase, dtype = args.bare_worker.split(":")
        args.out.write_text(json.dumps(bare_worker(args, model_dir, phase, dtype)))
        return
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for dtype in args.dtypes.split(","):
            results[dtype] = {"bare": run_bare(args, model_dir, dtype, work), "ours": {}}
            for ranks in map(int, args.ranks.split(",")):
                results[dtype]["ours"][ranks] = run_ours(args, model_dir, dtype, ranks, work)
    print_report(results, args)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
