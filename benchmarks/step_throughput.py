"""Step throughput of the trainer with the throughput features off and on: tokens/s and the time of each phase.

    python benchmarks/step_throughput.py [--steps 2] [--prompts 16] [--max-response-length 512]
        [--extra-stop-tokens 1] [--dtype bfloat16|float32] [--configs off,on,on-dapo] [--out result.json]
        [--set KEY=VALUE ...]
    python benchmarks/step_throughput.py --update-ratio [--dtype ...] [--ratio-prompts 16] [--rounds 3]
        [--profile N]

Each configuration is a real run of `python -m spmd_grpo.train` (torchrun, 1 rank, CPU, 2 threads, policy and
vLLM in `--dtype`, in-process engine) on a generated ~29M-parameter Qwen2.5-VL (hidden 512, 8 layers; built
once into .cache/bench_tput_model, no download) and the built-in colour task: `--prompts` prompts x 8
samples per step, one mini-batch per step, the vision tower frozen in every configuration (image-feature
reuse needs it; freezing is a training choice, not a throughput feature). The response lengths are set by
the workload: the random policy samples nearly uniformly from a 280-token vocabulary (`vocab_merges=10`) in
which <|im_end|>, <|endoftext|> and `--extra-stop-tokens` byte tokens stop (the benchmark lists them in a
copy of the model's generation_config.json, which vLLM reads), so the lengths are roughly geometric, long
tailed, cut at `--max-response-length`: with the defaults (1 extra, cap 512) about 150 tokens on average,
a few at the cap, as an RL run's responses spread from tens to thousands of tokens. With 0 extra the mean
is near 220 and a cap of 256 cuts over a third of the samples: lengths bunched at the cap, where no
batching scheme has padding to save. The footer prints the measured mean, p50, p90 and max
(`response_length/*` of the run). A fixed-count micro-batch is padded to its longest sequence; token-budget
micro-batches are packed into one row (`padding_free=auto`: on the CPU through the per-length sdpa of
`spmd_grpo/models/attention.py`) or, when not packed, runs of length-sorted samples within the budget.

The DAPO configurations (`*-dapo`: dynamic sampling on top) run on 2 ranks of 1 thread each (the same 2
cores), so that the kept groups really move between ranks; their rows add `rebalance` (the exchange) and
`pixel_values` (the image processor on the received prompts). They train on other samples than `off`/`on`
(groups with reward spread, regenerated until enough are kept) and on another layout, so compare their
phases with each other, not with the 1-rank rows.

bf16 is the fast path only on CPUs with AVX-512 BF16 / AMX (`torch.backends.cpu.get_cpu_capability()`); on
an AVX2-only CPU torch emulates it and a bf16 matmul is about 5x slower than fp32, so use `--dtype float32`
there to keep a run within minutes.

Printed per configuration (mean over the steps after the first, which warms vLLM and the allocator):
tokens/s (`perf/throughput`), gen (includes the weight sync), sync (`timing_s/update_weights`), old, ref,
update, the trainer phases (old + ref + update), the loop overhead (step minus every timed phase), and the
update's cost against one forward-only pass over the same samples (`update / fwd`: fwd is `old` where
the separate pass runs, else `ref`, the same forward on the same samples in the same dtype; neither without
a KL term: no ratio). pg_loss of the
first step (same seeds, same samples: equal up to rounding) and kl_loss of the second (the first is 0: the
reference is the initial policy) show that the features leave the losses unchanged.

`--update-ratio` times, in this process (gloo, `--threads` threads), the trainer's old-logprob pass
(image encoding + forward-only logprobs) and `update_policy` on a fixed workload: `--ratio-prompts` colour
prompts x 8 samples of exactly 64 random response tokens, one mini-batch, the separate old-logprob pass;
it prints update / forward-only; `--profile N` prints the top N ops by self CPU time of one more of each.

The features are a table (FEATURES below): each is a list of config overrides, applied only when the
config has the key. `--set` adds overrides to every configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL_SPEC = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    vision_hidden_size=256,
    vision_depth=4,
    vision_num_heads=4,
    vocab_merges=10,
)

# feature name -> overrides turning it on (the "off" run leaves every key at its "off" value below).
FEATURES: dict[str, list[str]] = {
    "dynamic_batching": [  # the budgets of 4 and 16 full-length sequences, as the fixed counts
        "worker.actor.dynamic_batching=true",
        "worker.actor.max_token_len_per_device_for_update={update_budget}",
        "worker.actor.max_token_len_per_device_for_experience={experience_budget}",
    ],
    "old_logprobs_from_update": ["worker.actor.old_logprobs_from_update=true"],
    "padding_free": ["worker.actor.padding_free=auto"],  # packs only where a varlen kernel exists
    "image_feature_reuse": ["worker.actor.reuse_image_features=true"],
    "shared_prompt": ["worker.actor.shared_prompt=auto"],  # with padding_free: each group's prompt once
}
OFF: dict[str, list[str]] = {
    "dynamic_batching": ["worker.actor.dynamic_batching=false"],
    "old_logprobs_from_update": ["worker.actor.old_logprobs_from_update=false"],
    "padding_free": ["worker.actor.padding_free=false"],
    "image_feature_reuse": ["worker.actor.reuse_image_features=false"],
    "shared_prompt": ["worker.actor.shared_prompt=false"],
}
CONFIGS = ("off", "on", "off-dapo", "on-dapo")
DAPO = [
    "algorithm.filter_groups.enable=true",
    "algorithm.filter_groups.metric=overall",
    "algorithm.filter_groups.max_num_gen_batches=0",
]

RUN_CONTROL = [  # a benchmark run: no validation, no checkpoints, metrics to metrics.jsonl only, a fresh start
    "worker.rollout.max_num_batched_tokens=16384",
    "trainer.val_before_train=false",
    "trainer.val_freq=-1",
    "trainer.save_freq=-1",
    "trainer.logger=[jsonl]",
    "trainer.resume=none",
]
BASE = [
    "worker.rollout.n=8",
    "worker.actor.micro_batch_size_per_device_for_update=4",
    "worker.actor.micro_batch_size_per_device_for_experience=16",
    "worker.actor.model.freeze_vision_tower=true",  # in every configuration: image-feature reuse needs it
    *RUN_CONTROL,
]

PHASES = [
    "gen",
    "update_weights",
    "reward",
    "rebalance",
    "pixel_values",
    "adv",
    "old_log_prob",
    "ref",
    "update_actor",
]


def with_stop_tokens(model_dir: Path, extra: int) -> Path:
    """A view of `model_dir` whose generation_config.json lists `extra` more stop tokens (the first byte
    tokens, ids 0..extra-1), which vLLM adds to every request's stop ids: a shorter mean response length
    from the same random policy, so that the cap only cuts the tail. Links to the other files."""
    out = model_dir.parent / f"{model_dir.name}-stop{extra}"
    out.mkdir(exist_ok=True)
    for f in model_dir.iterdir():
        if f.name != "generation_config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((model_dir / "generation_config.json").read_text())
    eos = config["eos_token_id"]
    config["eos_token_id"] = [*(eos if isinstance(eos, list) else [eos]), *range(extra)]
    (out / "generation_config.json").write_text(json.dumps(config, indent=1))
    return out


def dtype_overrides(dtype: str) -> list[str]:
    """The policy's compute dtype and vLLM's (the update keeps fp32 master weights either way)."""
    return [f"worker.actor.fsdp.param_dtype={dtype}", f"worker.rollout.dtype={dtype}"]


def known_keys() -> set[str]:
    """Every dotted key of the config (to skip features that do not exist yet)."""
    from spmd_grpo.config.loader import all_keys
    from spmd_grpo.config.schema import Config

    return set(all_keys(Config))


def overrides(name: str, keys: set[str]) -> tuple[list[str], list[str]]:
    """(overrides of configuration `name`, features it turns on); a feature whose key is unknown is left out."""
    on = name.startswith("on")
    out, used = [], []
    for feature, items in FEATURES.items():
        chosen = items if on else OFF[feature]
        if all(item.split("=", 1)[0] in keys for item in chosen):
            out += chosen
            used += [feature + ("=auto" if chosen[0].endswith("=auto") else "")] if on else []
    if name.endswith("dapo"):
        out += DAPO
    return out, used


def run_config(
    name: str, model_dir: Path, args: argparse.Namespace, work: Path
) -> tuple[int, list[str], list[str]]:
    """(ranks, config overrides, features on) of configuration `name`."""
    from spmd_grpo.config.loader import last_wins

    feature_overrides, used = overrides(name, known_keys())
    seq = 128 + args.max_response_length  # the smoke config's max_prompt_length + the response
    budgets = dict(update_budget=4 * seq, experience_budget=16 * seq)
    feature_overrides = [item.format(**budgets) for item in feature_overrides]
    ranks = 2 if name.endswith("dapo") else 1  # samples move between ranks only with more than one
    workload = [
        f"data.max_response_length={args.max_response_length}",
        f"data.rollout_batch_size={args.prompts}",
        f"worker.actor.global_batch_size={args.prompts * 8}",
    ]
    return ranks, last_wins([  # --set wins over the configuration's own values
        f"worker.actor.model.model_path={model_dir}", f"trainer.max_steps={args.steps}",
        f"trainer.output_dir={work}", f"trainer.experiment_name=bench_{name}",
        *BASE, *dtype_overrides(args.dtype), *workload, *feature_overrides, *args.set,
    ]), used  # fmt: skip


def check_configs(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every configuration's config for its rank count, before the first run starts: a later one that the
    arguments make invalid (e.g. an odd --prompts for the 2-rank DAPO runs) stops here in one line."""
    from spmd_grpo.config.checks import ConfigError
    from spmd_grpo.config.loader import load_config
    from spmd_grpo.config.validate import validate

    for name in args.configs.split(","):
        if name not in CONFIGS:
            ap.error(f"--configs: unknown configuration {name!r}; expected some of {', '.join(CONFIGS)}")
        ranks, run_overrides, _ = run_config(name, Path("unbuilt"), args, Path("unused"))
        try:
            validate(load_config(REPO / "configs" / "smoke.yaml", run_overrides), ranks)
        except (ConfigError, ValueError) as e:
            ap.error(f"configuration {name} ({ranks} rank(s)): {e}")


def forward_phase(run_overrides: list[str], ranks: int) -> str | None:
    """The timed phase that is one forward-only pass over the step's samples, as the trainer decides it: the
    separate old-logprob pass where it runs, else the reference pass where the KL term needs one, else none.
    (When the update takes the old logprobs, `old_log_prob` still times the image encoding and bookkeeping.)"""
    from spmd_grpo.actor.spec import UpdateSpec
    from spmd_grpo.config.loader import load_config

    cfg = load_config(REPO / "configs" / "smoke.yaml", run_overrides)
    spec = UpdateSpec.from_config(cfg, world_size=ranks, pad_token_id=0)
    if not spec.old_logprobs_in_update(cfg.data.rollout_batch_size * cfg.worker.rollout.n // ranks):
        return "old_log_prob"
    return "ref" if cfg.algorithm.use_kl_loss else None


def run(name: str, model_dir: Path, args: argparse.Namespace, work: Path) -> tuple[list[dict], str | None]:
    """The metrics of the training steps of configuration `name`, and its `forward_phase`."""
    ranks, run_overrides, used = run_config(name, model_dir, args, work)
    cmd = [sys.executable, "-m", "spmd_grpo.launch", "--standalone", "--nproc_per_node", str(ranks),
           "-m", "spmd_grpo.train", str(REPO / "configs" / "smoke.yaml"), *run_overrides]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(2 // ranks), "PYTHONPATH": str(REPO)}
    print(f"[benchmark] {name}: {ranks} rank(s), features on {used or '-'}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    rows = [json.loads(line) for line in (work / f"bench_{name}" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("step", 0) > 0], forward_phase(run_overrides, ranks)


def summarise(rows: list[dict]) -> dict[str, float]:
    """Means over the steps after the first; the first step's losses."""
    later = rows[1:] or rows
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in later)  # noqa: E731
    out = {p: mean(f"timing_s/{p}") for p in PHASES}
    out["step"] = mean("timing_s/step")
    out["tokens_per_s"] = mean("perf/throughput")
    out["trainer"] = out["old_log_prob"] + out["ref"] + out["update_actor"]
    out["overhead"] = out["step"] - sum(out[p] for p in PHASES if p != "update_weights")
    out["response_length_mean"] = mean("response_length/mean")
    out["response_length_max"] = max(r.get("response_length/max", 0.0) for r in rows)
    out["response_length_p50"] = mean("response_length/p50")
    out["response_length_p90"] = mean("response_length/p90")
    out["pg_loss_step1"] = rows[0].get("actor/pg_loss", float("nan"))
    out["kl_loss_step2"] = rows[1].get("actor/kl_loss", float("nan")) if len(rows) > 1 else float("nan")
    return out


def print_table(results: dict[str, dict[str, float]]) -> None:
    cols = [
        "tokens_per_s",
        "gen",
        "update_weights",
        "rebalance",
        "pixel_values",
        "old_log_prob",
        "ref",
        "update_actor",
        "trainer",
        "overhead",
        "step",
    ]
    heads = [
        "tok/s",
        "gen",
        "sync",
        "rebalance",
        "pixels",
        "old",
        "ref",
        "update",
        "old+ref+upd",
        "overhead",
        "step",
    ]
    print("| config | " + " | ".join(heads) + " | update / fwd | pg_loss (step 1) | kl_loss (step 2) |")
    print("| --- " * (len(heads) + 4) + "|")
    for name, r in results.items():
        phase = r["forward_phase"]
        ratio = f"{r['update_actor'] / r[phase]:.2f}" if phase else "- (no forward-only pass)"
        cells = [f"{r[c]:.1f}" if c == "tokens_per_s" else f"{r[c]:.2f}" for c in cols]
        print(
            f"| {name} | " + " | ".join(cells) + f" | {ratio} | {r['pg_loss_step1']:.9g} | "
            f"{r['kl_loss_step2']:.9g} |"
        )
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}")
    names = list(results)
    if "off" in results and "on" in results:
        off, on = results["off"], results["on"]
        print(f"trainer phases (old + ref + update): off {off['trainer']:.2f} s, on {on['trainer']:.2f} s, "
              f"speed-up {off['trainer'] / on['trainer']:.2f}x")  # fmt: skip
    for name in names:
        r = results[name]
        print(f"{name}: response length mean {r['response_length_mean']:.1f}, p50 {r['response_length_p50']:.0f}, "
              f"p90 {r['response_length_p90']:.0f}, max {r['response_length_max']:.0f} (per-step quantiles, "
              f"averaged over the timed steps)")  # fmt: skip


# ------------------------------------------------------------------------------------ --update-ratio mode
RATIO_WORKLOAD = [  # 16 prompts x 8 samples per step, one mini-batch, old logprobs from a separate pass
    "data.rollout_batch_size=16",
    "data.max_response_length=64",
    "worker.actor.global_batch_size=128",
    "worker.actor.old_logprobs_from_update=false",
    "algorithm.use_kl_loss=false",
]


def ratio_samples(processor, prompts: int, n: int, length: int) -> list:
    """`prompts` colour-task prompts (one 56 x 56 image each) x `n` samples of exactly `length` random
    response tokens (byte-level ids: never a special token), with random advantages."""
    import torch
    from PIL import Image

    from spmd_grpo.data.samples import Prompt, Sample

    gen = torch.Generator().manual_seed(0)
    content = [{"type": "image"}, {"type": "text", "text": "Which color? Answer with a digit."}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    samples = []
    for p in range(prompts):
        image = Image.new("RGB", (56, 56), ((60 * p) % 255, 120, 200))
        enc = processor(text=[text], images=[image], return_tensors="pt")
        # one record for the group, as rollout makes it: shared prompts key on it
        prompt = Prompt(p, [], [image])
        for i in range(n):
            response = torch.randint(0, 256, (length,), generator=gen).tolist()
            s = Sample(prompt, i, enc["input_ids"][0].tolist(), response, [0.0] * length)
            s.pixel_values, s.image_grid_thw = enc["pixel_values"], enc["image_grid_thw"]
            s.advantage = float(torch.randn((), generator=gen))
            samples.append(s)
    return samples


def _old_pass(policy, samples, spec) -> None:
    """The trainer's `timing_s/old_log_prob` phase: encode the images (when reused), forward-only logprobs."""
    from spmd_grpo.actor.image_features import encode_images
    from spmd_grpo.actor.logprob_pass import compute_logprobs

    for s in samples:
        s.image_features = None
    encode_images(policy, samples, spec)
    for s, lp in zip(samples, compute_logprobs(policy, samples, spec), strict=True):
        s.old_logprobs = lp


def _profile(fn, label: str, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof, record_function(label):
        fn()
    print(f"## {label}: top {rows} ops by self CPU time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=48))


def update_ratio(model_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    """Time the old-logprob forward and the update on the fixed workload, in this process (gloo,
    `torch.set_num_threads(args.threads)`); `args.rounds` rounds, the first one a warm-up. Returns the medians
    and the world size (under torchrun each rank runs the whole workload)."""
    import time

    import torch
    from transformers import AutoProcessor

    from spmd_grpo.actor.optimizer import build_optimizer
    from spmd_grpo.actor.spec import UpdateSpec
    from spmd_grpo.actor.update import update_policy
    from spmd_grpo.config.loader import last_wins, load_config
    from spmd_grpo.models.build import build_policy
    from spmd_grpo.models.families import family_of
    from spmd_grpo.parallel.collectives import init_distributed

    torch.set_num_threads(args.threads)
    overrides = [f"worker.actor.model.model_path={model_dir}", *BASE, *dtype_overrides(args.dtype)]
    overrides += [*RATIO_WORKLOAD, f"worker.actor.global_batch_size={8 * args.ratio_prompts}", *args.set]
    cfg = load_config(REPO / "configs" / "smoke.yaml", last_wins(overrides))
    world = init_distributed("cpu")
    torch.manual_seed(0)
    policy = build_policy(cfg.worker.actor, world)
    optim = build_optimizer(policy, cfg.worker.actor.optim, total_steps=100)
    processor = AutoProcessor.from_pretrained(model_dir)
    spec = UpdateSpec.from_config(
        cfg, world_size=1, pad_token_id=processor.tokenizer.pad_token_id, family=family_of(policy.config)
    )
    samples = ratio_samples(processor, args.ratio_prompts, 8, 64)
    fwd, upd, fwd_cpu, upd_cpu = [], [], [], []
    for _ in range(args.rounds):
        start, start_cpu = time.perf_counter(), time.process_time()
        _old_pass(policy, samples, spec)
        mid, mid_cpu = time.perf_counter(), time.process_time()
        update_policy(policy, optim, samples, spec, world)
        fwd.append(mid - start)
        upd.append(time.perf_counter() - mid)
        fwd_cpu.append(mid_cpu - start_cpu)
        upd_cpu.append(time.process_time() - mid_cpu)
        print(f"[update-ratio] old {fwd[-1]:.2f} s, update {upd[-1]:.2f} s, ratio {upd[-1] / fwd[-1]:.2f}; "
              f"CPU time ratio {upd_cpu[-1] / fwd_cpu[-1]:.2f}", file=sys.stderr, flush=True)  # fmt: skip
    if args.profile:
        _profile(lambda: _old_pass(policy, samples, spec), "old_log_prob", args.profile)
        _profile(lambda: update_policy(policy, optim, samples, spec, world), "update_actor", args.profile)
    later = lambda xs: statistics.median(xs[1:] or xs)  # noqa: E731
    n_params = sum(p.numel() for p in policy.parameters())
    return {
        "old_log_prob": later(fwd),
        "update_actor": later(upd),
        "old_log_prob_cpu": later(fwd_cpu),
        "update_actor_cpu": later(upd_cpu),
        "params_m": n_params / 1e6,
        "ranks": world.world_size,
    }


def later_rounds(count: int) -> str:
    """What the printed medians are taken over: the rounds after the first, or the only one."""
    return f"median of rounds 2..{count}" if count > 1 else "1 round, the warm-up (no later round)"


def print_ratio(r: dict[str, float], args: argparse.Namespace) -> None:
    print(f"update-ratio workload: {r['params_m']:.1f}M parameters, {args.ratio_prompts} prompts x 8 samples x "
          f"64 response tokens, {args.dtype}, {r['ranks']} rank(s) x {args.threads} threads; "
          f"{later_rounds(args.rounds)}")  # fmt: skip
    print("| | old_log_prob (s) | update_actor (s) | update / fwd |")
    print("| --- | --- | --- | --- |")
    for label, suffix in [("wall", ""), ("process CPU", "_cpu")]:
        old, upd = r["old_log_prob" + suffix], r["update_actor" + suffix]
        print(f"| {label} | {old:.2f} | {upd:.2f} | {upd / old:.2f} |")
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step (8 samples each)")
    ap.add_argument("--max-response-length", type=int, default=512)
    ap.add_argument("--extra-stop-tokens", type=int, default=1,
                    help="byte tokens added to the model's stop ids (0: only <|im_end|> and <|endoftext|>)")  # fmt: skip
    ap.add_argument(
        "--configs", default="off,on,on-dapo", help="off | on | off-dapo | on-dapo, comma-separated"
    )
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--set", action="append", default=[], help="extra KEY=VALUE override for every run")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="compute dtype of the policy and vLLM (bf16 is emulated, slow, on CPUs without "
                    "AVX-512 BF16 / AMX: torch.backends.cpu.get_cpu_capability() prints the ISA)")  # fmt: skip
    ap.add_argument(
        "--update-ratio", action="store_true", help="time update vs forward on the fixed workload"
    )
    ap.add_argument("--ratio-prompts", type=int, default=16, help="--update-ratio: prompts (8 samples each)")
    ap.add_argument("--rounds", type=int, default=3, help="--update-ratio: rounds (the first is a warm-up)")
    ap.add_argument("--threads", type=int, default=2, help="--update-ratio: torch threads")
    ap.add_argument("--profile", type=int, default=0, help="--update-ratio: print the top N ops by self CPU")
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    from spmd_grpo.tools.make_tiny_model import TinyModelSpec, cached_tiny_model

    if not args.update_ratio:
        check_configs(ap, args)
    model_dir = args.model_dir or cached_tiny_model(
        REPO / ".cache" / "bench_tput_model", TinyModelSpec(**MODEL_SPEC)
    )
    if args.extra_stop_tokens and not args.update_ratio:
        model_dir = with_stop_tokens(model_dir, args.extra_stop_tokens)
    if args.update_ratio:
        result = update_ratio(model_dir, args)
        print_ratio(result, args)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
        return
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for name in args.configs.split(","):
            rows, phase = run(name, model_dir, args, Path(work))
            results[name] = {**summarise(rows), "forward_phase": phase}
    print_table(results)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
