"""Step throughput of the trainer with the throughput features off and on: tokens/s and the time of each phase.

    python benchmarks/step_throughput.py [--steps 4] [--prompts 16] [--max-response-length 256]
        [--configs off,on,on-dapo] [--out result.json] [--set KEY=VALUE ...]

Each configuration is a real run of `python -m spmd_grpo.train` (torchrun, 1 rank, CPU, 2 threads, bf16
policy and vLLM, in-process engine) on a generated ~29M-parameter Qwen2.5-VL (hidden 512, 8 layers; built
once into .cache/bench_tput_model, no download) and the built-in colour task: 16 prompts x 8 samples per
step (`--prompts`), one mini-batch per step. The workload is meant to be long-tailed: the random policy samples
nearly uniformly from a small vocabulary (`vocab_merges=10`) in which 2 tokens stop, so response lengths
should be roughly geometric (stop probability about 2 / vocabulary size per token) cut at
`--max-response-length`; the table's footer prints the measured mean and max lengths. A fixed-count
micro-batch is padded to its longest response.

Printed per configuration (mean over the steps after the first, which warms vLLM and the allocator):
tokens/s (`perf/throughput`), gen (includes the weight sync), sync (`timing_s/update_weights`), old, ref,
update, the trainer phases (old + ref + update), the loop overhead (step minus every timed phase), and the
update's cost against one forward-only pass over the same samples (`update / fwd`: fwd is `old` where
the separate pass runs, else `ref`, the same forward on the same samples in the same dtype). pg_loss and
kl_loss of the first step show that the features leave the losses unchanged (same seeds, same samples).

The features are a table (FEATURES below): each is a list of config overrides, applied only when the
config has the key (features another change adds, e.g. padding-free packing, are skipped until then).
`--set` adds overrides to every configuration.
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
    "dynamic_batching": [
        "worker.actor.dynamic_batching=true",
        "worker.actor.max_token_len_per_device_for_update=8192",
        "worker.actor.max_token_len_per_device_for_experience=16384",
    ],
    "old_logprobs_from_update": ["worker.actor.old_logprobs_from_update=true"],
    "padding_free": ["worker.actor.padding_free=true"],
    "image_feature_reuse": ["worker.actor.reuse_image_features=true"],
}
OFF: dict[str, list[str]] = {
    "dynamic_batching": ["worker.actor.dynamic_batching=false"],
    "old_logprobs_from_update": ["worker.actor.old_logprobs_from_update=false"],
    "padding_free": ["worker.actor.padding_free=false"],
    "image_feature_reuse": ["worker.actor.reuse_image_features=false"],
}
DAPO = [
    "algorithm.filter_groups.enable=true",
    "algorithm.filter_groups.metric=overall",
    "algorithm.filter_groups.max_num_gen_batches=0",
]

BASE = [
    "worker.rollout.n=8",
    "worker.actor.micro_batch_size_per_device_for_update=4",
    "worker.actor.micro_batch_size_per_device_for_experience=16",
    "worker.actor.fsdp.param_dtype=bfloat16",
    "worker.rollout.dtype=bfloat16",
    "worker.rollout.max_num_batched_tokens=16384",
    "trainer.val_before_train=false",
    "trainer.val_freq=0",
    "trainer.save_freq=0",
    "trainer.logger=[jsonl]",
    "trainer.resume=none",
]

PHASES = ["gen", "update_weights", "reward", "adv", "old_log_prob", "ref", "update_actor"]


def known_keys() -> set[str]:
    """Every dotted key of the config (to skip features that do not exist yet)."""
    from spmd_grpo.config import Config, _all_keys

    return set(_all_keys(Config))


def overrides(name: str, keys: set[str]) -> tuple[list[str], list[str]]:
    """(overrides of configuration `name`, features it turns on); a feature whose key is unknown is left out."""
    on = name.startswith("on")
    out, used = [], []
    for feature, items in FEATURES.items():
        chosen = items if on else OFF[feature]
        if all(item.split("=", 1)[0] in keys for item in chosen):
            out += chosen
            used += [feature] if on else []
    if name.endswith("dapo"):
        out += DAPO
    return out, used


def run(name: str, model_dir: Path, args: argparse.Namespace, work: Path) -> list[dict]:
    keys = known_keys()
    feature_overrides, used = overrides(name, keys)
    workload = [
        f"data.max_response_length={args.max_response_length}",
        f"data.rollout_batch_size={args.prompts}",
        f"worker.actor.global_batch_size={args.prompts * 8}",
    ]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
        "-m", "spmd_grpo.train", str(REPO / "configs" / "smoke.yaml"),
        f"worker.actor.model.model_path={model_dir}", f"trainer.max_steps={args.steps}",
        f"trainer.output_dir={work}", f"trainer.experiment_name=bench_{name}",
        *BASE, *workload, *feature_overrides, *args.set,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(REPO)}
    print(f"[benchmark] {name}: features on {used or '-'}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    rows = [json.loads(line) for line in (work / f"bench_{name}" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("step", 0) > 0]


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
    out["response_length_max"] = mean("response_length/max")
    out["pg_loss_step1"] = rows[0].get("actor/pg_loss", float("nan"))
    out["kl_loss_step1"] = rows[0].get("actor/kl_loss", float("nan"))
    return out


def print_table(results: dict[str, dict[str, float]]) -> None:
    cols = [
        "tokens_per_s",
        "gen",
        "update_weights",
        "old_log_prob",
        "ref",
        "update_actor",
        "trainer",
        "overhead",
        "step",
    ]
    heads = ["tok/s", "gen", "sync", "old", "ref", "update", "old+ref+upd", "overhead", "step"]
    print("| config | " + " | ".join(heads) + " | update / fwd | pg_loss (step 1) | kl_loss (step 1) |")
    print("| --- " * (len(heads) + 4) + "|")
    for name, r in results.items():
        fwd = r["old_log_prob"] if r["old_log_prob"] > 0.05 else r["ref"]
        cells = [f"{r[c]:.1f}" if c == "tokens_per_s" else f"{r[c]:.2f}" for c in cols]
        print(
            f"| {name} | "
            + " | ".join(cells)
            + f" | {r['update_actor'] / fwd:.2f} | {r['pg_loss_step1']:.6f} | "
            f"{r['kl_loss_step1']:.6f} |"
        )
    names = list(results)
    if "off" in results and "on" in results:
        off, on = results["off"], results["on"]
        print(f"trainer phases (old + ref + update): off {off['trainer']:.2f} s, on {on['trainer']:.2f} s, "
              f"speed-up {off['trainer'] / on['trainer']:.2f}x")  # fmt: skip
    for name in names:
        r = results[name]
        print(
            f"{name}: response length mean {r['response_length_mean']:.1f}, max {r['response_length_max']:.0f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step (8 samples each)")
    ap.add_argument("--max-response-length", type=int, default=256)
    ap.add_argument(
        "--configs", default="off,on,on-dapo", help="off | on | off-dapo | on-dapo, comma-separated"
    )
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--set", action="append", default=[], help="extra KEY=VALUE override for every run")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from spmd_grpo.tools.make_tiny_model import TinyModelSpec, cached_tiny_model

    model_dir = args.model_dir or cached_tiny_model(
        REPO / ".cache" / "bench_tput_model", TinyModelSpec(**MODEL_SPEC)
    )
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for name in args.configs.split(","):
            results[name] = summarise(run(name, model_dir, args, Path(work)))
    print_table(results)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
