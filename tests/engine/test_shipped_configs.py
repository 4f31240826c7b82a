"""Every shipped config runs: each `configs/*.yaml` (found by glob, so a new file is covered without a
change here) trains 2 steps under real torchrun with 2 ranks, FSDP2 and the real vLLM CPU engine, through the
real entry point. The runs share one launch with the session's other training runs (the `trained` fixture:
tests/jobs/train_in_turn.py), so torch, transformers and vLLM start once for all of them.

Only what cannot exist on this machine is swapped, and only what would take hours is scaled down, all in
one place (`SCALE_DOWN`, `FIXED`, `_swapped`); everything else runs as the file says: the algorithm, DAPO's
dynamic sampling and overlong shaping, the rollout correction, the KL loss, `loss_agg_mode`, clipping,
activation checkpointing, the offload options, the dtypes, validation and checkpoint settings, the prompt
template and the reward function.

  * The model: a tiny random model of the same family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL dense or MoE, Qwen3.5
    dense or MoE), with tied
    embeddings where the published model ties them (3B ties; 7B and 32B do not), built locally. For the geometry3k configs it is first nudged by
    a few supervised steps to answer `<think> ... </think> \\boxed{d}` with a random digit d: a random model
    never writes `\\boxed{}`, so the math reward would be 0 for every sample, and DAPO's dynamic sampling
    (`max_num_gen_batches: -1`, no limit) would generate forever looking for a group with accuracy spread.
    Primed, about 1 answer in 9 is right, so groups have spread, advantages and gradients are non-zero.
  * The data: hub data sets cannot be downloaded here; a generated geometry3k-schema parquet (drawn
    rectangles, "Find x." with a one-digit numeric answer) goes through the same loading, the same prompt
    template (`data.format_prompt`) and the real mathruler reward; for a config that allows videos
    (`worker.rollout.limit_videos`), the rectangle is a 4-frame MPEG-4 video in the `videos` column behind
    a `<video>` marker. `builtin:` data sets are kept.
"""

from __future__ import annotations

import io
import json
import math
import random
import shutil
from functools import partial, reduce
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from benchmarks.moe_step_throughput import summarise
from spmd_grpo.config.loader import load_config
from spmd_grpo.config.schema import Config
from spmd_grpo.config.validate import validate
from spmd_grpo.data.synthetic import write_parquet
from spmd_grpo.models.families import PUBLISHED
from spmd_grpo.tools.make_tiny_model import save_model
from tests.conftest import CACHE, REPO, tiny_model, trainer_run

RUN_ELSEWHERE = {
    "smoke": "trained by tests/engine/test_launch.py (3 steps on 4 ranks, every metric) and test_families_grpo.py "
    "(60 steps per family), and until it has learned the task by make smoke-test",
    "smoke_dapo": "trained by tests/engine/test_dynamic_sampling.py (2 steps, ranks keeping different group "
    "counts); the DAPO path also runs here with qwen2_5_vl_7b_geo3k_dapo",
    "smoke_video": "smoke.yaml on builtin:video_color: the video path runs here with qwen2_5_vl_7b_video_grpo, "
    "and this config's own run is its learning run (python -m spmd_grpo.smoke --config configs/smoke_video.yaml)",
    "smoke_qwen3_vl_moe": "smoke.yaml on a tiny Qwen3-VL-MoE: its learning run is make smoke-test-moe; the family "
    "trains here with qwen3_vl_30b_a3b_geo3k_grpo",
    "smoke_qwen3_5": "smoke.yaml on a tiny Qwen3.5 with a bf16 engine: its learning run is make smoke-test-qwen3_5; "
    "the family trains here with qwen3_5_9b_geo3k_grpo and in test_families_grpo.py",
}
"""Configs validated (tests/unit/test_config.py) but not trained here, each with why and where it is trained
(each run here costs the tier about 6 s in the shared launch, and 15-20 s in a launch of its own)."""
SAME_RUN_AS = {"qwen2_5_vl_32b_geo3k_grpo": "qwen2_5_vl_7b_geo3k_grpo"}
"""Configs whose run here would repeat another config's run: scaled down and with the tiny model swapped in,
every key is the same (the sizes and the tensor-parallel degree are what tells them apart, and those are
replaced here). `test_a_config_not_trained_here_resolves_to_its_twin` checks it key by key, so a change that
makes the run differ fails there until the config is trained again."""
CONFIGS = sorted(
    c for c in (REPO / "configs").glob("*.yaml") if c.stem not in RUN_ELSEWHERE and c.stem not in SAME_RUN_AS
)
WORLD_SIZE = 2

# Sizes scaled down: key -> (cap, why). A config value above the cap, or negative ("all" / "the default"),
# becomes the cap; smaller values (the smoke configs') stay. `validate` checks the result before the launch.
SCALE_DOWN = {
    "data.rollout_batch_size": (
        4,
        "2 prompts per rank (512 x 5 samples per step would take hours on 2 cores)",
    ),
    "data.val_batch_size": (2, "2 prompts per validation batch: the 4 validation prompts take 2 batches"),
    "data.val_max_samples": (4, "4 validation prompts are enough to run validation end to end"),
    "data.num_builtin_examples": (16, "builtin data sets are generated and checked at load: keep them small"),
    "data.max_prompt_length": (256, "the generated prompts are ~140 tokens with the template and the image"),
    "data.max_response_length": (16, "long enough for `<think> ... </think> \\boxed{d}`"),
    "data.min_pixels": (
        3136,
        "4 image tokens instead of 334: the vision tower is tiny, images need not be big",
    ),
    "data.max_pixels": (12544, "at most 16 image tokens per image"),
    "algorithm.overlong_buffer.length": (4, "a length: must stay within the scaled max_response_length"),
    "algorithm.filter_groups.train_batch_size": (
        2,
        "groups trained per step, at most the scaled prompt batch",
    ),
    "worker.actor.global_batch_size": (4, "samples per optimizer step: several mini-batches per step remain"),
    "worker.actor.micro_batch_size_per_device_for_update": (2, "a divisor of the scaled mini-batch per rank"),
    "worker.actor.micro_batch_size_per_device_for_experience": (4, "scaled with the batch"),
}
# Set regardless of the file: key -> (value, why).
FIXED = {
    "worker.rollout.tensor_parallel_size": (1, "2 ranks here; TP 2 is covered by test_engine_parity.py"),
    # Measured: with `enforce_eager: false` (the GPU configs' CUDA graphs) vLLM CPU compiles the model with
    # torch.compile at start-up: 7.5 minutes of a 10.5-minute launch on this 2-core machine.
    "worker.rollout.enforce_eager": (True, "vLLM CPU's torch.compile takes minutes here"),
    "trainer.device": ("cpu", "no accelerator here"),
    "trainer.max_steps": (2, "two steps: the second runs on weights the first pushed into vLLM"),
    "data.video_min_pixels": (
        3136,
        "4 tokens a video frame: the vision tower is tiny, frames need not be big",
    ),
    "data.video_max_pixels": (12544, "at most 16 tokens a video frame"),
    "data.video_max_frames": (4, "2 temporal patches a video"),
}
# Not overridden: the dtypes. The configs' bfloat16 (FSDP2 param_dtype, rollout, reference) runs on this CPU
# (AMX-bf16 is vLLM CPU's fast path; FSDP2 mixed precision works with gloo), so the bf16 paths stay covered.


def _get(cfg: Config, key: str):
    return reduce(getattr, key.split("."), cfg)


def _scaled(cfg: Config) -> list[str]:
    overrides = [f"{key}={value}" for key, (value, _) in FIXED.items()]
    for key, (cap, _) in SCALE_DOWN.items():
        value = _get(cfg, key)
        if value < 0 or value > cap:
            overrides.append(f"{key}={cap}")
    return overrides


# ---------------------------------------------------------------------------------------------- data
def _rectangle(width: int, x: int) -> bytes:
    image = Image.new("RGB", (224, 168), "white")
    draw = ImageDraw.Draw(image)
    draw.rectangle((30, 30, 30 + 16 * width, 30 + 10 * x), outline="black", width=2)
    draw.text((32, 14), f"area {width * x}", fill="black")
    draw.text((34 + 8 * width, 34 + 10 * x), str(width), fill="black")
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def digit_rows(n: int, seed: int, *, video: bool = False) -> list[dict]:
    """geometry3k-schema rows: a drawn rectangle, "Find x." from its area and width, answer one digit; with
    `video`, the rectangle is a 4-frame video instead of an image."""
    from spmd_grpo.data.videos import encode_video

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        width, x = rng.randint(2, 9), rng.randint(1, 9)
        problem = f"<image>Find x. The rectangle has area {width * x} and width {width}; x is its height."
        rows.append({"problem": problem, "answer": str(x), "images": [{"bytes": _rectangle(width, x)}]})
        if video:
            frame = Image.open(io.BytesIO(_rectangle(width, x))).convert("RGB")
            rows[-1] = {"problem": problem.replace("<image>", "<video>"), "answer": str(x),
                        "videos": [encode_video([frame] * 4)]}  # fmt: skip
    return rows


# --------------------------------------------------------------------------------------------- model
PRIME_STEPS = 150
PRIME_VERSION = "1"  # bump when the priming recipe changes (the cache key)


def primed_tiny_model(tie_word_embeddings: bool, family: str) -> Path:
    """The tiny model after `PRIME_STEPS` supervised steps on geometry3k-style prompts (the real template,
    one image each) answered `<think> the answer is </think> \\boxed{d}`, d a random digit; cached."""
    base = tiny_model(tie_word_embeddings=tie_word_embeddings, family=family)
    out = CACHE / "primed_models" / f"{base.name}-v{PRIME_VERSION}-{PRIME_STEPS}"
    if not out.is_dir():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(base, tmp)  # tokenizer, processor, chat template
        _prime(tmp)
        tmp.rename(out)
    return out


def _prime(path: Path) -> None:
    import jinja2
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    torch.manual_seed(0)
    rng = random.Random(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # measured: 0.3 s per step; threads spinning against the shared cores were slower
    size = {
        "shortest_edge": SCALE_DOWN["data.min_pixels"][0],
        "longest_edge": SCALE_DOWN["data.max_pixels"][0],
    }
    processor = AutoProcessor.from_pretrained(path, size=size)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    template = jinja2.Template((REPO / "configs" / "format_prompt" / "math.jinja").read_text())
    rows = digit_rows(32, seed=100)
    for step in range(PRIME_STEPS):
        row = rows[step % len(rows)]
        text = template.render(content=row["problem"].replace("<image>", ""))
        content = [{"type": "image"}, {"type": "text", "text": text}]
        prompt = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True
        )
        answer = f"<think> the answer is </think> \\boxed{{{rng.randint(1, 9)}}}<|im_end|>"
        image = [Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB")]
        batch = processor(text=[prompt + answer], images=image, return_tensors="pt")
        num_prompt = processor(text=[prompt], images=image, return_tensors="pt")["input_ids"].shape[1]
        labels = batch["input_ids"].clone()
        labels[:, :num_prompt] = -100
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.set_num_threads(threads)
    save_model(model, path)  # in the published expert layout (what vLLM reads)


def _swapped(cfg: Config, tmp_path: Path) -> list[str]:
    """The model and data overrides: what cannot exist on this machine (hub checkpoints and data sets)."""
    model_path = cfg.worker.actor.model.model_path
    if model_path == "":  # the smoke configs: `spmd_grpo.smoke` fills in its wider SMOKE_MODEL
        model = tiny_model()
    else:
        assert model_path in PUBLISHED, (
            f"{model_path}: add its architecture to spmd_grpo/models/families.py (the family's published list) so "
            "--dry-run and this test know its family and whether it ties its embeddings"
        )
        family = PUBLISHED[model_path]
        (published,) = [p for p in family.published if p.model_id == model_path]
        model = primed_tiny_model(published.tie_word_embeddings, family.model_type)
    overrides = [f"worker.actor.model.model_path={model}", f"trainer.output_dir={tmp_path}"]
    video = cfg.worker.rollout.limit_videos > 0
    if not cfg.data.train_files.startswith("builtin:"):
        train = write_parquet(digit_rows(32, seed=1, video=video), tmp_path / "data" / "train.parquet")
        overrides.append(f"data.train_files={train}")
    if cfg.data.val_files and not cfg.data.val_files.startswith("builtin:"):
        val = write_parquet(digit_rows(4, seed=2, video=video), tmp_path / "data" / "val.parquet")
        overrides.append(f"data.val_files={val}")
    return overrides


# ---------------------------------------------------------------------------------------------- test
def _arguments(config: Path, work: Path) -> list[str]:
    original = load_config(config)
    overrides = _swapped(original, work) + _scaled(original)
    # A scaled size that breaks a divisibility rule fails here, naming the key, before the launch.
    validate(load_config(config, overrides), WORLD_SIZE)
    return [str(config.relative_to(REPO)), *overrides]


RUNS = {c: trainer_run(c.stem, __file__, partial(_arguments, c)) for c in CONFIGS}


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_shipped_config_trains_two_steps(config: Path, trained):
    work, _ = trained(RUNS[config])
    original = load_config(config)
    cfg = load_config(config, _swapped(original, work) + _scaled(original))
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == ([0] if cfg.trainer.val_before_train else []) + [1, 2]
    if cfg.trainer.val_before_train:
        assert any(k.startswith("val-core/") for k in rows[0]), rows[0]
    for r in rows:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
    train = [r for r in rows if r["step"] > 0]
    _check_config_shows(original, train)
    summary = summarise(rows)  # what benchmarks/moe_step_throughput.py reports of the MoE config on 8 GPUs
    assert summary["tokens_per_s_per_gpu"] > 0 and summary["step_s"] > summary["update_actor_s"] > 0, summary
    if cfg.trainer.save_freq > 0:  # saved at the last step whatever the frequency
        assert (cfg.run_dir / "checkpoints" / "global_step_2" / "trainer_state.json").is_file()
    if cfg.worker.reward.reward_function == "math":
        # The primed model writes the format the math reward grades, and the update has a gradient.
        assert max(r["reward/format"] for r in train) > 0
        assert all(r["actor/grad_norm"] > 0 for r in train)


@pytest.mark.parametrize("config, twin", SAME_RUN_AS.items())
def test_a_config_not_trained_here_resolves_to_its_twin(config: str, twin: str, tmp_path: Path):
    from spmd_grpo.run.saved_config import plain_config

    def resolved(stem: str) -> dict:
        original = load_config(REPO / "configs" / f"{stem}.yaml")
        cfg = load_config(REPO / "configs" / f"{stem}.yaml", _swapped(original, tmp_path) + _scaled(original))
        return _flat(plain_config(cfg))

    ours, theirs = resolved(config), resolved(twin)
    names = {"trainer.project_name", "trainer.experiment_name"}  # they only name the run
    differ = sorted(k for k in ours.keys() | theirs.keys() if k not in names and ours.get(k) != theirs.get(k))
    assert not differ, f"{config} no longer runs as {twin} does here ({differ}): train it (SAME_RUN_AS)"


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def _check_config_shows(cfg: Config, train: list[dict]) -> None:
    """The config's switches show up in the metrics: the code ran the configured algorithm."""
    alg = cfg.algorithm
    for r in train:
        assert ("actor/kl_loss" in r) == alg.use_kl_loss
        correction = alg.rollout_correction.rollout_is or alg.rollout_correction.rollout_rs
        assert any(k.startswith("rollout_corr/") for k in r) == bool(correction)
        assert ("train/num_gen_batches" in r) == alg.filter_groups.enable
        assert ("reward/overlong_penalty" in r) == alg.overlong_buffer.enable
