"""Config mistakes a new user makes, through the real entry point (`spmd_grpo.train.main`), in-process: each
must stop before any process group or model exists, with exit code 2 and one stderr line naming the key.

The trainer module is replaced by one whose `run` fails the test: reaching it means the mistake got past
validation (on a cluster: to a traceback after the model and vLLM had loaded). `test_the_base_config_reaches_
the_trainer` shows the base config itself is valid, so each row fails for its own override only.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import types
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import save_file

from spmd_grpo import train
from spmd_grpo.config.checks import ConfigError
from spmd_grpo.config.loader import load_config
from spmd_grpo.config.validate import validate

NUM_TRAIN_ROWS = 8
REPO = Path(__file__).resolve().parents[2]
USER_CODE_THAT_EXITS = {  # reward files whose import raises a BaseException that is not an Exception
    "exits_at_import": "import sys\nsys.exit(0)",
    "argparse_at_import": "import argparse\nargparse.ArgumentParser().parse_args()",
    "interrupts_at_import": "raise KeyboardInterrupt",
}


class ReachedTrainer(Exception):
    """Raised by the stand-in `spmd_grpo.trainer.run`: validation let the config through."""


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """A valid world-2 config (`base.yaml`) and the real files its overrides point at."""
    root = tmp_path_factory.mktemp("config_errors")
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    (root / "model" / "tokenizer.json").write_text("{}")
    (root / "model" / "chat_template.jinja").write_text("{{ messages }}")
    save_file({"weight": torch.zeros(1)}, root / "model" / "model.safetensors")
    broken = ("no_weights", "bad_index", "no_template", "truncated_weights", "not_safetensors", "bad_config")
    for name in broken:  # the model directory with one thing missing or broken
        shutil.copytree(root / "model", root / name)
    weights = (root / "model" / "model.safetensors").read_bytes()
    (root / "truncated_weights" / "model.safetensors").write_bytes(weights[:-2])  # an interrupted download
    (root / "not_safetensors" / "model.safetensors").write_bytes(b"<html>rate limited</html>")
    (root / "bad_config" / "config.json").write_text('{"model_type": "qwen2_5_vl",}')
    shutil.copytree(root / "model", root / "cut_tokenizer")
    (root / "cut_tokenizer" / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vo')
    (root / "no_weights" / "model.safetensors").unlink()
    (root / "bad_index" / "model.safetensors.index.json").write_text(
        '{"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}'
    )
    (root / "no_template" / "chat_template.jinja").unlink()
    (root / "no_template" / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    (root / "no_tokenizer").mkdir()  # a checkpoint whose tokenizer.json was deleted
    (root / "no_tokenizer" / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    (root / "empty").mkdir()
    table = pa.table({"problem": ["1+1?"] * NUM_TRAIN_ROWS, "answer": ["2"] * NUM_TRAIN_ROWS})  # text only
    (root / "llava").mkdir()
    (root / "llava" / "config.json").write_text('{"model_type": "llava"}')
    for name, config in [  # the new families' config.json as the checks read them (no weights needed)
        ("qwen3_5", '{"model_type": "qwen3_5"}'),
        ("qwen3_5_moe", '{"model_type": "qwen3_5_moe"}'),
        ("qwen3_vl_moe", '{"model_type": "qwen3_vl_moe", "text_config": {"norm_topk_prob": true}}'),
        ("moe_no_renorm", '{"model_type": "qwen3_vl_moe", "text_config": {"norm_topk_prob": false}}'),
        (
            "moe_3_experts",
            '{"model_type": "qwen3_vl_moe", "text_config": {"norm_topk_prob": true, "num_experts": 3}}',
        ),
    ]:
        (root / name).mkdir()
        (root / name / "config.json").write_text(config)
        (root / name / "tokenizer.json").write_text("{}")
    shutil.copytree(root / "model", root / "qwen3_5_moe_model")  # the stand-in's files, a Qwen3.5-MoE config
    (root / "qwen3_5_moe_model" / "config.json").write_text('{"model_type": "qwen3_5_moe"}')
    (root / "moe_8_experts").mkdir()  # a checkpoint whose fused experts hold 8 where its config says 4
    (root / "moe_8_experts" / "config.json").write_text(
        '{"model_type": "qwen3_vl_moe", "text_config": {"norm_topk_prob": true, "num_experts": 4}}'
    )
    (root / "moe_8_experts" / "tokenizer.json").write_text("{}")
    fused = {"model.language_model.layers.0.mlp.experts.gate_up_proj": torch.zeros(8, 4, 6)}
    save_file(fused, root / "moe_8_experts" / "model.safetensors")
    pq.write_table(table, root / "train.parquet")
    pq.write_table(table.slice(0, 0), root / "no_rows.parquet")
    (root / "mixed").mkdir()  # a file without the columns beside a good one: skipped by the loader, named
    pq.write_table(table, root / "mixed" / "a.parquet")
    pq.write_table(table.rename_columns(["question", "answer"]), root / "mixed" / "b.parquet")
    n = NUM_TRAIN_ROWS
    for name, columns in [  # columns none of whose rows the loader could read
        ("question_column", {"question": ["<image>1+1?"] * n, "answer": ["2"] * n}),
        ("number_problems", {"problem": list(range(n)), "answer": ["2"] * n}),
        ("flag_answers", {"problem": ["1+1?"] * n, "answer": [True] * n}),
        ("number_images", {"problem": ["<image>1+1?"] * n, "answer": ["2"] * n, "images": list(range(n))}),
        ("image_column", {"problem": ["<image>1+1?"] * n, "answer": ["2"] * n, "image": [b"png"] * n}),
    ]:
        pq.write_table(pa.table(columns), root / f"{name}.parquet")
    (root / "not_parquet.parquet").write_bytes(b"not a parquet file")
    (root / "jsonl").mkdir()
    for file in (root / "rows.jsonl", root / "jsonl" / "rows.jsonl"):
        file.write_text('{"problem": "1+1?", "answer": "2"}\n' * NUM_TRAIN_ROWS)
    (root / "reward.py").write_text(
        "def my_reward(samples):\n    return [{'overall': 0.0} for _ in samples]\n"
    )
    (root / "broken_import.py").write_text("import no_such_module_xyz\n\ndef fn(samples):\n    return []\n")
    (root / "not_callable.py").write_text("fn = 3\n")
    (root / "per_sample.py").write_text(  # verl's per-sample shape
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
    )
    (root / "syntax_error.py").write_text("def fn(:\n")
    for name, statement in USER_CODE_THAT_EXITS.items():
        (root / f"{name}.py").write_text(f"{statement}\n\ndef fn(samples):\n    return []\n")
    (root / "syntax.jinja").write_text("{{ content | trim }}\nThink, then answer in {{ \\boxed{} }}.\n")
    (root / "no_content.jinja").write_text("Think step by step, then put the answer in \\boxed{}.\n")
    (root / "method.jinja").write_text("{{ content.strip().capitalise() }}\n")
    (root / "latin1.yaml").write_bytes("data:\n  system_prompt: caf\xe9\n".encode("latin-1"))
    (root / "run" / "checkpoints").mkdir(parents=True)
    for step in (2, 4):
        (root / "other_run" / "checkpoints" / f"global_step_{step}").mkdir(parents=True)
    (root / "a_file").write_text("a file where a run directory should be\n")
    (root / "base.yaml").write_text(
        f"data:\n  train_files: {root / 'train.parquet'}\n  val_files: builtin:color\n"
        "  rollout_batch_size: 4\n"
        "worker:\n  actor:\n    model:\n      model_path: " + str(root / "model") + "\n"
        "    global_batch_size: 8\n    micro_batch_size_per_device_for_update: 2\n"
        "  rollout:\n    n: 2\n"
    )
    return root


@pytest.fixture
def cli(files, monkeypatch, capsys):
    """`cli(overrides)` -> (exit code, stderr lines) of `train.main([base.yaml, *overrides])` at world 2."""
    stand_in = types.ModuleType("spmd_grpo.trainer")

    def run(cfg, plan=None):
        raise ReachedTrainer

    stand_in.run = run
    monkeypatch.setitem(sys.modules, "spmd_grpo.trainer", stand_in)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.chdir(files)

    def call(overrides: list[str]) -> tuple[int, list[str]]:
        with pytest.raises(SystemExit) as e:
            train.main([str(files / "base.yaml"), *(o.replace("ROOT", str(files)) for o in overrides)])
        return e.value.code, capsys.readouterr().err.strip().splitlines()

    return call


A = "worker.actor."
R = "worker.rollout."
T = "trainer."
# (overrides, the key the one-line message must name); ROOT is the fixture's directory.
FILE_ROWS = [  # what must exist on the machine that trains (a `--dry-run` does not look)
    (["data.train_files=ROOT/missing.parquet"], "data.train_files"),
    (["data.train_files=data/train.parquet"], "got 'data/train.parquet': no such file"),  # no data/ here
    (["data.train_files=ROOT/empty"], "data.train_files"),
    (["data.train_files=ROOT/not_parquet.parquet"], "data.train_files"),
    # JSON lines (which EasyR1 reads): said as such, where pyarrow said "Parquet magic bytes not found"
    (["data.train_files=ROOT/rows.jsonl"], "data.train_files: ROOT/rows.jsonl is a .jsonl file, not parquet"),
    (
        ["data.train_files=ROOT/jsonl"],
        "data.train_files: directory 'ROOT/jsonl' holds no *.parquet file (it holds *.jsonl files: only parquet is read",
    ),
    # LoRA targets are matched against the model's layers (its config.json, built on the meta device)
    (
        [f"{A}model.lora.rank=8", f"{A}model.lora.target_modules=[q_proj,qkv_proj]"],
        f"{A}model.lora.target_modules",
    ),
    ([f"{A}model.lora.rank=8", f"{A}model.lora.exclude_modules=[model]"], f"{A}model.lora"),
    # a rank wider than every adapted layer (the widest here: the 8192 -> 8192 q_proj of the default config)
    ([f"{A}model.lora.rank=8193"], f"{A}model.lora.rank (8193) is wider than every adapted layer"),
    ([f"{A}model.lora.rank=100000000"], "q_proj (8192 -> 8192 features)"),
    (["data.val_files=./val_missing"], "data.val_files"),
    # columns (the loader found them after the process group formed, a wrong type after reading every row)
    (
        ["data.train_files=ROOT/question_column.parquet"],
        "data.train_files: ROOT/question_column.parquet has no column 'problem'",
    ),
    (
        ["data.train_files=ROOT/number_problems.parquet"],
        "column 'problem' (data.prompt_key) is int64, not text",
    ),
    (
        ["data.val_files=ROOT/flag_answers.parquet"],
        "data.val_files: ROOT/flag_answers.parquet: column 'answer' (data.answer_key) is bool",
    ),
    (
        ["data.train_files=ROOT/number_images.parquet"],
        "column 'images' (data.image_key) is int64, not a list of images",
    ),
    # the images under another name: every row was skipped for "<image> markers do not match images"
    (
        ["data.train_files=ROOT/image_column.parquet"],
        "ROOT/image_column.parquet has no column 'images' (data.image_key; columns: ['problem', 'answer', 'image'])",
    ),
    # read only after the process group formed; an empty one said "no usable examples in FILE (...): "
    (
        ["data.val_files=ROOT/not_parquet.parquet"],
        "data.val_files: ROOT/not_parquet.parquet is not a readable",
    ),
    (["data.val_files=ROOT/no_rows.parquet"], "data.val_files: ROOT/no_rows.parquet holds no rows"),
    (["data.rollout_batch_size=16"], "data.rollout_batch_size"),  # > the 8 rows of train.parquet
    (["data.format_prompt=ROOT/missing.jinja"], "data.format_prompt"),
    # a template that does not parse, drops the problem, or fails on text (the load failed naming no file)
    (
        ["data.format_prompt=ROOT/syntax.jinja"],
        "data.format_prompt: ROOT/syntax.jinja line 2: unexpected char",
    ),
    (["data.format_prompt=ROOT/no_content.jinja"], "data.format_prompt: ROOT/no_content.jinja never uses"),
    (
        ["data.format_prompt=ROOT/method.jinja"],
        "ROOT/method.jinja: rendering a problem raised UndefinedError",
    ),
    (["worker.actor.model.model_path=ROOT/missing_model"], "worker.actor.model.model_path"),
    (["worker.actor.model.model_path=ROOT/empty"], "worker.actor.model.model_path"),  # no config.json
    (["worker.actor.model.model_path=ROOT/llava"], "worker.actor.model.model_path"),  # unsupported family
    (["worker.actor.model.tokenizer_path=./tokenizer_missing"], "worker.actor.model.tokenizer_path"),
    (["worker.reward.reward_function=ROOT/missing.py:fn"], "worker.reward.reward_function"),
    (["worker.reward.reward_function=ROOT/reward.py:nope"], "worker.reward.reward_function"),
    (["worker.reward.reward_function=ROOT/broken_import.py:fn"], "worker.reward.reward_function"),
    (["worker.reward.reward_function=ROOT/not_callable.py:fn"], "worker.reward.reward_function"),
    (["worker.reward.reward_function=ROOT/syntax_error.py:fn"], "worker.reward.reward_function"),
    (
        ["worker.reward.reward_function=ROOT/per_sample.py:compute_score"],
        "worker.reward.reward_function: reward function spec",
    ),
    (["trainer.resume=ROOT/run/checkpoints/global_step_7"], "trainer.resume"),
    (["trainer.resume=ROOT/model"], "trainer.resume='ROOT/model' is not a complete checkpoint: missing DCP"),
    (  # a run directory where one checkpoint is wanted
        ["trainer.resume=ROOT/other_run"],
        "it holds global_step_2, global_step_4: name one of them (trainer.resume takes a global_step_N",
    ),
    (["worker.actor.model.model_path=ROOT/no_tokenizer"], "worker.actor.model.model_path"),
    # weights and chat template (the job stopped at model load, or at data load naming no file)
    (
        ["worker.actor.model.model_path=ROOT/no_weights"],
        f"{A}model.model_path: no *.safetensors in ROOT/no_weights",
    ),
    (
        ["worker.actor.model.model_path=ROOT/bad_index"],
        f"{A}model.model_path: ROOT/bad_index/model.safetensors.index.json names files that are not in",
    ),
    (
        ["worker.actor.model.model_path=ROOT/truncated_weights"],
        f"{A}model.model_path: ROOT/truncated_weights/model.safetensors: not a readable safetensors file (Error while deserializing header: incomplete metadata",
    ),
    (
        ["worker.actor.model.model_path=ROOT/not_safetensors"],
        f"{A}model.model_path: ROOT/not_safetensors/model.safetensors: not a readable safetensors file (Error while deserializing header: ",
    ),
    (
        ["worker.actor.model.model_path=ROOT/bad_config"],
        "ROOT/bad_config/config.json is not JSON (Expecting property name enclosed in double quotes: line 1",
    ),
    (
        ["worker.actor.model.model_path=ROOT/cut_tokenizer"],
        f"{A}model.model_path: ROOT/cut_tokenizer/tokenizer.json is not JSON (Unterminated string",
    ),
    (
        ["worker.actor.model.model_path=ROOT/no_template"],
        f"{A}model.model_path: 'ROOT/no_template' has no chat template for its processor",
    ),
    # the new families: vLLM CPU serves Qwen3.5 in bf16 only;
    # an MoE checkpoint whose top-k normalisation vLLM would apply differently from transformers
    (["worker.actor.model.model_path=ROOT/qwen3_5"], "worker.rollout.dtype"),
    (["worker.actor.model.model_path=ROOT/moe_no_renorm"], "norm_topk_prob"),
    (
        ["worker.actor.model.model_path=ROOT/moe_8_experts"],
        "gate_up_proj holds 8 experts, config.json names 4",
    ),
    # expert parallelism: a dense model has no experts to shard; EP must divide the experts (and the world)
    ([f"{A}fsdp.expert_parallel_size=2"], f"{A}fsdp.expert_parallel_size=2: Qwen2.5-VL is a dense model"),
    (
        ["worker.actor.model.model_path=ROOT/moe_3_experts", f"{A}fsdp.expert_parallel_size=2"],
        f"{A}fsdp.expert_parallel_size=2 must divide the model's 3 experts",
    ),
    ([f"{A}fsdp.expert_parallel_size=4"], f"{A}fsdp.expert_parallel_size (4) must divide the world size (2)"),
    ([f"{A}fsdp.expert_parallel_size=0"], f"{A}fsdp.expert_parallel_size"),
    # the installed vLLM build (here the CPU one) cannot return routed experts
    ([f"{A}moe.routing_replay=rollout"], f"{A}moe.routing_replay=rollout needs vLLM's routed experts"),
    # the run directory: a file in the way of it or of a parent (no traceback, before any process group)
    (["trainer.output_dir=ROOT", "trainer.experiment_name=a_file"], "the run directory ROOT/a_file cannot"),
    (["trainer.output_dir=ROOT/a_file/runs"], "ROOT/a_file is a file, not a directory"),
    *(
        ([f"worker.reward.reward_function=ROOT/{name}.py:fn"], "worker.reward.reward_function")
        for name in USER_CODE_THAT_EXITS
    ),
]
VALUE_ROWS = [
    # routes from vLLM come from the first rank of a TP group only
    (
        [f"{A}moe.routing_replay=rollout", "worker.rollout.tensor_parallel_size=2"],
        f"{A}moe.routing_replay=rollout needs worker.rollout.tensor_parallel_size=1",
    ),
    # data
    (["data.train_files=builtin:colour"], "data.train_files"),
    (["data.train_files="], "data.train_files"),
    (["data.val_files=builtin:nope"], "data.val_files"),
    (["data.max_prompt_length=0"], "data.max_prompt_length"),
    (["data.max_response_length=-1"], "data.max_response_length"),
    (["data.rollout_batch_size=0"], "data.rollout_batch_size"),
    (["data.min_pixels=0"], "data.min_pixels"),
    (["data.max_pixels=100"], "data.max_pixels"),
    (["data.max_bad_fraction=1.5"], "data.max_bad_fraction"),
    (["data.max_bad_fraction=.nan"], "data.max_bad_fraction"),
    (["data.val_max_samples=0"], "data.val_max_samples"),
    (["data.seed=-1"], "data.seed"),
    (["data.num_builtin_examples=0"], "data.num_builtin_examples"),
    (["data.video_fps=0"], "data.video_fps"),
    (["data.video_max_pixels=-1"], "data.video_max_pixels"),
    (["data.video_min_frames=8", "data.video_max_frames=4"], "data.video_max_frames"),
    (["data.video_key="], "data.video_key"),
    (["data.prompt_key="], "data.prompt_key"),
    (["data.val_batch_size=0"], "data.val_batch_size"),
    # algorithm
    (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator"),
    (["algorithm.adv_eps=0"], "algorithm.adv_eps"),
    (["algorithm.kl_coef=-0.01"], "algorithm.kl_coef"),
    (["algorithm.kl_coef=.inf"], "algorithm.kl_coef"),
    (["algorithm.kl_penalty=k4"], "algorithm.kl_penalty"),
    (
        ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"],
        "algorithm.filter_groups.metric",
    ),
    (["algorithm.filter_groups.train_batch_size=0"], "algorithm.filter_groups.train_batch_size"),
    (["algorithm.overlong_buffer.penalty_factor=-1"], "algorithm.overlong_buffer.penalty_factor"),
    (
        ["algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.length=0"],
        "algorithm.overlong_buffer.length",
    ),
    (["algorithm.rollout_correction.rollout_is=seq"], "algorithm.rollout_correction.rollout_is"),
    (
        ["algorithm.rollout_correction.rollout_rs_threshold_lower=1.5"],
        "algorithm.rollout_correction.rollout_rs_threshold_lower",
    ),
    # worker.actor: the model, the optimizer, the update
    ([f"{A}model.model_path="], f"{A}model.model_path"),
    ([f"{A}model.lora.rank=-1"], f"{A}model.lora.rank"),
    ([f"{A}model.lora.rank=8.5"], f"{A}model.lora.rank"),
    ([f"{A}model.lora.alpha=0"], f"{A}model.lora.alpha"),
    ([f"{A}model.lora.dropout=1"], f"{A}model.lora.dropout"),
    ([f"{A}model.lora.target_modules=all_linear"], f"{A}model.lora.target_modules"),
    ([f"{A}model.lora.target_modules=[]"], f"{A}model.lora.target_modules"),
    ([f"{A}model.lora.target_modules=[q_proj,'v proj']"], f"{A}model.lora.target_modules"),
    ([f"{A}model.lora.exclude_modules=model.visual"], f"{A}model.lora.exclude_modules"),
    ([f"{A}model.lora.exclude_modules=['']"], f"{A}model.lora.exclude_modules"),
    ([f"{A}model.lora.rnak=8"], f"{A}model.lora.rnak"),
    ([f"{A}optim.lr=-1e-6"], f"{A}optim.lr"),
    ([f"{A}optim.lr=0"], f"{A}optim.lr"),
    ([f"{A}optim.lr=nan"], f"{A}optim.lr"),
    ([f"{A}optim.betas=[0.9,1.5]"], f"{A}optim.betas"),
    ([f"{A}optim.betas=[0.9]"], f"{A}optim.betas"),
    ([f"{A}optim.weight_decay=-0.1"], f"{A}optim.weight_decay"),
    ([f"{A}optim.lr_warmup_steps=-1"], f"{A}optim.lr_warmup_steps"),
    ([f"{A}optim.min_lr_ratio=2"], f"{A}optim.min_lr_ratio"),
    ([f"{A}optim.lr_scheduler=linear"], f"{A}optim.lr_scheduler"),
    ([f"{A}max_grad_norm=-1"], f"{A}max_grad_norm"),
    ([f"{A}max_grad_norm=0"], f"{A}max_grad_norm"),
    ([f"{A}entropy_coef=-0.1"], f"{A}entropy_coef"),
    ([f"{A}clip_ratio_low=1.0"], f"{A}clip_ratio_low"),
    ([f"{A}clip_ratio_high=-0.1"], f"{A}clip_ratio_high"),
    ([f"{A}clip_ratio_dual=1.0"], f"{A}clip_ratio_dual"),
    ([f"{A}moe.routing_replay=vllm"], f"{A}moe.routing_replay"),
    ([f"{A}moe.router_aux_loss_coef=-0.01"], f"{A}moe.router_aux_loss_coef"),
    ([f"{A}shared_prompt=sometimes"], f"{A}shared_prompt"),
    ([f"{A}shared_prompt=true", f"{A}padding_free=false"], f"{A}shared_prompt=true needs padding_free"),
    ([f"{A}reuse_image_features=true", f"{R}limit_videos=1"], f"{A}reuse_image_features=true"),
    ([f"{A}old_logprobs_from_update=true", f"{A}ppo_epochs=2"], f"{A}old_logprobs_from_update=true"),
    ([f"{A}fsdp.param_dtype=float16"], f"{A}fsdp.param_dtype=float16"),  # fp16 training, no loss scaling
    ([f"{A}ppo_epochs=0"], f"{A}ppo_epochs"),
    ([f"{A}global_batch_size=6"], f"{A}global_batch_size"),
    ([f"{A}micro_batch_size_per_device_for_update=3"], f"{A}micro_batch_size_per_device_for_update"),
    ([f"{A}micro_batch_size_per_device_for_experience=0"], f"{A}micro_batch_size_per_device_for_experience"),
    ([f"{A}logprob_chunk_size=0"], f"{A}logprob_chunk_size"),
    ([f"{A}loss_agg_mode=sum"], f"{A}loss_agg_mode"),
    ([f"{A}fsdp.param_dtype=fp8"], f"{A}fsdp.param_dtype"),
    # worker.rollout
    ([f"{R}top_k=-5"], f"{R}top_k"),
    ([f"{R}top_k=-2"], f"{R}top_k"),
    ([f"{R}max_num_seqs=0"], f"{R}max_num_seqs"),
    ([f"{R}n=0"], f"{R}n"),
    ([f"{R}temperature=0"], f"{R}temperature"),
    ([f"{R}top_p=1.5"], f"{R}top_p"),
    ([f"{R}gpu_memory_utilization=1.2"], f"{R}gpu_memory_utilization"),
    ([f"{R}tensor_parallel_size=3"], f"{R}tensor_parallel_size"),
    ([f"{R}sleep_level=3"], f"{R}sleep_level"),
    ([f"{R}kv_cache_memory_gb=0"], f"{R}kv_cache_memory_gb"),
    ([f"{R}limit_images=0"], f"{R}limit_images"),
    ([f"{R}limit_videos=-1"], f"{R}limit_videos"),
    ([f"{R}weight_sync_bucket_mb=0"], f"{R}weight_sync_bucket_mb"),
    ([f"{R}temprature=0.7"], f"{R}temprature"),
    ([f"{R}val_override.top_k=-5"], f"{R}val_override.top_k"),
    ([f"{R}val_override.n=0"], f"{R}val_override.n"),
    ([f"{R}val_override.temperature=-1"], f"{R}val_override.temperature"),
    ([f"{R}val_override.temperature=0", f"{R}val_override.n=4"], f"{R}val_override.n"),
    ([f"{R}val_override.top_p=0"], f"{R}val_override.top_p"),
    # worker.reward
    (["worker.reward.reward_function=maths"], "worker.reward.reward_function"),
    (["worker.reward.format_weight=1.5"], "worker.reward.format_weight"),
    (["worker.reward.format_weight=-0.1"], "worker.reward.format_weight"),
    # trainer
    ([f"{T}max_steps=0"], f"{T}max_steps"),
    ([f"{T}max_steps=-1"], f"{T}max_steps"),
    ([f"{T}log_every=0"], f"{T}log_every"),
    ([f"{T}collective_timeout_s=0"], f"{T}collective_timeout_s"),
    ([f"{T}preempt_grace_s=0"], f"{T}preempt_grace_s"),
    ([f"{T}total_epochs=0"], f"{T}total_epochs"),
    ([f"{T}val_freq=0"], f"{T}val_freq"),
    ([f"{T}save_freq=0"], f"{T}save_freq"),
    ([f"{T}save_limit=0"], f"{T}save_limit"),
    ([f"{T}logger=[console,console]"], f"{T}logger"),
    ([f"{T}device=tpu"], f"{T}device"),
    ([f"{T}seed=-3"], f"{T}seed"),
    ([f"{T}experiment_name="], f"{T}experiment_name"),
    ([f"{T}val_generations_to_log=-1"], f"{T}val_generations_to_log"),
    ([f"{T}val_freq=5", "data.val_files=null"], f"{T}val_freq"),  # validation without a validation set
    # the command line as strict as YAML
    ([f"{A}optim.lr=1e-5", f"{A}optim.lr=2e-5"], f"{A}optim.lr"),
    ([f"{A}optim=null"], f"{A}optim"),
    # numbers beyond where they go (see test_every_number_key_has_a_range for all of them)
    (["data.seed=100000000000000000000000"], "data.seed"),
    ([f"{T}seed=4294967296"], f"{T}seed"),
    ([f"{T}collective_timeout_s=100000000000000000000"], f"{T}collective_timeout_s"),
    ([f"{T}preempt_grace_s=1e10"], f"{T}preempt_grace_s"),
    ([f"{R}max_num_seqs=2147483648"], f"{R}max_num_seqs"),
    ([f"{A}optim.lr=1e39"], f"{A}optim.lr"),
    (["algorithm.overlong_buffer.length=-1"], "algorithm.overlong_buffer.length"),  # even while disabled
    (["data.max_prompt_length=2147483600"], "data.max_prompt_length"),  # + the response: vLLM's max_model_len
]


BAD = FILE_ROWS + VALUE_ROWS


def test_the_table_is_large_enough():
    assert len(BAD) >= 60


def test_the_base_config_reaches_the_trainer(cli, files):
    """The control: without a bad override the stand-in trainer is reached (rows fail for their own key)."""
    with pytest.raises(ReachedTrainer):
        train.main([str(files / "base.yaml")])
    with pytest.raises(ReachedTrainer):  # a user reward file that imports and defines its function
        train.main(
            [str(files / "base.yaml"), f"worker.reward.reward_function={files / 'reward.py'}:my_reward"]
        )
    example = Path(__file__).resolve().parents[2] / "examples" / "reward_length_penalty.py"
    with pytest.raises(
        ReachedTrainer
    ):  # the README's reward example, with DAPO filtering on a key of its own
        train.main(
            [
                str(files / "base.yaml"),
                f"worker.reward.reward_function={example}:reward",
                "algorithm.filter_groups.enable=true",
                "algorithm.filter_groups.metric=accuracy",
            ]
        )
    for name, content in [  # the processor's other chat template places (as transformers 5.19 reads them)
        ("chat_template.json", '{"chat_template": "{{ messages }}"}'),
        ("processor_config.json", '{"chat_template": "{{ messages }}"}'),
    ]:
        other = files / f"template_in_{name}"
        shutil.copytree(files / "no_template", other, dirs_exist_ok=True)
        (other / name).write_text(content)
        with pytest.raises(ReachedTrainer):
            train.main([str(files / "base.yaml"), f"worker.actor.model.model_path={other}"])
    with pytest.raises(ReachedTrainer):  # a directory with one file the loader can read
        train.main([str(files / "base.yaml"), f"data.train_files={files / 'mixed'}"])
    with pytest.raises(ReachedTrainer):  # number answers
        train.main([str(files / "base.yaml"), f"data.train_files={files / 'number_problems.parquet'}",
                    "data.prompt_key=answer", "data.answer_key=problem"])  # fmt: skip
    with pytest.raises(ReachedTrainer):  # a column of the wrong type where bad rows may all be skipped
        train.main([str(files / "base.yaml"), f"data.train_files={files / 'number_images.parquet'}",
                    "data.max_bad_fraction=1.0"])  # fmt: skip
    with pytest.raises(ReachedTrainer):  # the shipped prompt template
        train.main(
            [str(files / "base.yaml"), f"data.format_prompt={REPO / 'configs/format_prompt/math.jinja'}"]
        )
    with pytest.raises(ReachedTrainer):  # LoRA targets the model has
        train.main(
            [str(files / "base.yaml"), f"{A}model.lora.rank=8", f"{A}model.lora.target_modules=[q_proj]"]
        )
    with pytest.raises(ReachedTrainer):  # the default targets of Qwen3.5-MoE hold its shared-expert gate,
        # hidden -> 1, in every layer: any rank above 1 is wider than it
        train.main([str(files / "base.yaml"), f"{A}model.model_path={files / 'qwen3_5_moe_model'}",
                    "worker.rollout.dtype=bfloat16", f"{A}model.lora.rank=8"])  # fmt: skip
    with pytest.raises(ReachedTrainer):  # a rank wider than some adapted layers (k_proj: 1024), not all
        train.main([str(files / "base.yaml"), f"{A}model.lora.rank=8192"])


@pytest.mark.parametrize("overrides, key", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_config_exits_2_with_one_line_naming_the_key(cli, files, overrides, key):
    code, lines = cli(overrides)  # the stand-in trainer raises ReachedTrainer if validation let it through
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("config error: "), lines
    assert key.replace("ROOT", str(files)) in lines[0], lines[0]


@pytest.mark.parametrize("overrides, key", VALUE_ROWS, ids=[" ".join(o) for o, _ in VALUE_ROWS])
def test_value_mistakes_are_caught_without_the_files(files, overrides, key):
    """A `--dry-run` plans for another machine and skips the file checks; every other rule still holds."""
    base = [
        f"worker.actor.model.model_path={files / 'absent_here'}",
        f"data.train_files={files / 'absent.parquet'}",
    ]
    cfg_path = files / "base.yaml"
    with pytest.raises(ConfigError) as e:
        validate(load_config(cfg_path, [*base, *overrides]), 2)
    assert key in str(e.value) and "\n" not in str(e.value)
    validate(load_config(cfg_path, base), 2)  # the control: the base passes without its files


def test_routes_from_vllm_are_refused_for_a_model_with_linear_attention(files):
    """vLLM returns routed experts only with prefix caching, which the engine keeps off for Qwen3.5's hybrid
    layers: refused before the build (whatever vLLM build is installed); Qwen3-VL-MoE gets past that rule."""
    from spmd_grpo.run.preflight import check_routing_replay

    def check(model: str) -> str:
        overrides = [f"{A}model.model_path={files / model}", f"{A}moe.routing_replay=rollout"]
        with pytest.raises(ConfigError) as e:
            check_routing_replay(load_config(files / "base.yaml", overrides))
        return str(e.value)

    assert "prefix caching" in check("qwen3_5_moe")
    assert "prefix caching" not in check("qwen3_vl_moe")  # here: the CPU build's refusal


def test_a_config_path_that_is_not_a_utf8_file_is_named(cli, files, capsys):
    """A directory given as the config, and a YAML saved in Latin-1: one line naming the path."""
    for path, says in [
        (files, "Is a directory"),
        (files / "latin1.yaml", "can't decode byte 0xe9"),
    ]:
        with pytest.raises(SystemExit) as e:
            train.main([str(path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and str(path) in err[0] and says in err[0], err


@pytest.mark.parametrize("name", USER_CODE_THAT_EXITS)
def test_a_reward_file_that_exits_at_import_is_named(cli, files, name):
    """sys.exit(0) at import once ended the job with exit code 0 and nothing trained; argparse printed its
    usage and exited 2 with nothing naming the file."""
    code, lines = cli([f"worker.reward.reward_function=ROOT/{name}.py:fn"])
    assert code == 2 and len(lines) == 1, lines
    assert f"{files / name}.py" in lines[0] and "raised" in lines[0], lines[0]
    if name == "argparse_at_import":  # what argparse printed, in the same line
        assert "unrecognized arguments" in lines[0] or "error:" in lines[0], lines[0]


def _number_keys() -> list[tuple[str, str]]:
    """(dotted key, 'int' | 'float') of every integer and float key of the schema, optional ones included."""
    import typing

    from spmd_grpo.config.loader import all_keys
    from spmd_grpo.config.schema import Config

    out = []
    for key in all_keys(Config):
        *sections, name = key.split(".")
        section = Config
        for part in sections:
            section = section.__pydantic_fields__[part].annotation
        tp = section.__pydantic_fields__[name].annotation
        optional = typing.get_origin(tp) in (typing.Union, types.UnionType)
        kinds = {_bare(t) for t in (typing.get_args(tp) if optional else (tp,))} - {type(None)}
        if kinds in ({int}, {float}):
            out.append((key, kinds.pop().__name__))
    return out


def _bare(tp):
    """`Annotated[int, Field(...)]` -> int: the type a field's constraints apply to."""
    import typing

    return _bare(typing.get_args(tp)[0]) if typing.get_origin(tp) is typing.Annotated else tp


NUMBER_KEYS = _number_keys()


def test_every_number_key_has_a_range(files):
    """Each integer key refuses 10**23 and -10**23 (a C int holds neither) and each float key 1e39 (beyond
    float32) at load, with one line naming the key: none reaches the code that would overflow on it."""
    assert len(NUMBER_KEYS) > 40, NUMBER_KEYS  # the walk found the schema's numbers
    cfg_path = files / "base.yaml"
    for key, kind in NUMBER_KEYS:
        for huge in ("100000000000000000000000", "-100000000000000000000000") if kind == "int" else ("1e39",):
            with pytest.raises(ConfigError) as e:
                validate(load_config(cfg_path, [f"{key}={huge}"]), 2)
            assert key in str(e.value) and "\n" not in str(e.value), (key, str(e.value))


def test_an_unreachable_hub_fails_in_seconds_naming_the_key(cli, files, monkeypatch):
    """A hub id that is not cached, with the hub unreachable (here: a closed local port as HF_ENDPOINT),
    stops at the config checks instead of huggingface_hub retrying for minutes; the same id cached passes."""
    import time

    from spmd_grpo.parallel.collectives import free_port

    port = free_port()  # a port nobody listens on: the connection is refused at once
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HOME", str(files / "hf_home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    hub_id = "Qwen/Qwen2.5-VL-3B-Instruct"  # a published id: its family is known without a download
    start = time.monotonic()
    code, lines = cli([f"worker.actor.model.model_path={hub_id}"])
    assert time.monotonic() - start < 10
    assert code == 2 and len(lines) == 1, lines
    assert "worker.actor.model.model_path" in lines[0] and hub_id in lines[0], lines[0]
    assert f"the hub is unreachable (127.0.0.1:{port}" in lines[0], lines[0]
    # The advice names huggingface_hub's installed CLI (`huggingface-cli` is gone since huggingface_hub 1.0).
    assert f"(`hf download {hub_id}`), or give a local directory" in lines[0], lines[0]
    assert (Path(sys.executable).parent / "hf").exists()
    snapshot = files / "hf_home" / "hub" / "models--Qwen--Qwen2.5-VL-3B-Instruct" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    with pytest.raises(ReachedTrainer):  # the control: cached, nothing to download
        train.main([str(files / "base.yaml"), f"worker.actor.model.model_path={hub_id}"])
    # a data set likewise (`datasets` retried for 24 s with no DNS, after the process group had formed)
    for key in ("data.train_files", "data.val_files"):
        start = time.monotonic()
        code, lines = cli([f"{key}=hiyouga/geometry3k@test"])
        assert time.monotonic() - start < 10
        assert code == 2 and len(lines) == 1, lines
        assert lines[0].startswith(f"config error: {key}: 'hiyouga/geometry3k@test' is not in the local"), (
            lines
        )
        advice = "(`hf download --repo-type dataset hiyouga/geometry3k`), or give a local parquet file or directory"
        assert lines[0].endswith(advice), lines[0]
    prepared = files / "hf_home" / "datasets" / "hiyouga___geometry3k"
    prepared.mkdir(parents=True)
    with pytest.raises(ReachedTrainer):  # the control: prepared by `datasets` before, nothing to download
        train.main([str(files / "base.yaml"), "data.val_files=hiyouga/geometry3k@test"])


# ------------------------------------------------------------------------------ the run directory, the launcher
@pytest.fixture
def tiny_fs(tmp_path):
    """`tiny_fs(options)` -> a fresh 64 KiB tmpfs mounted with `options` (unmounted at the end); None where
    this process may not mount (not root): the callers then make the same errno at the write."""
    mounted = []

    def mount(options: str) -> Path | None:
        import subprocess

        where = tmp_path / f"fs{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=64k,{options}", "tmpfs", str(where)],
                              capture_output=True)  # fmt: skip
        if done.returncode != 0:
            return None
        mounted.append(where)
        return where

    yield mount
    import subprocess

    for where in mounted:
        subprocess.run(["umount", str(where)], check=True)


def _fill(where: Path) -> None:
    """Write into `where` until its file system is full."""
    try:
        with open(where / "filler", "wb") as f:
            while True:
                f.write(b"x" * 4096)
                f.flush()
    except OSError as e:
        assert e.errno == errno.ENOSPC, e


@pytest.mark.parametrize("problem", ["read-only file system", "no space left on device"])
def test_an_unwritable_run_directory_is_one_line_naming_it(cli, files, tiny_fs, monkeypatch, problem):
    """A read-only file system and a full one (real 64 KiB tmpfs mounts where this process may mount; else
    the same errno raised at the first write) stop the start with one line naming the run directory, exit 2,
    before any process group: the first write is checked before the job starts."""
    fs = tiny_fs("ro" if problem.startswith("read-only") else "rw")
    if fs is None:
        code = errno.EROFS if problem.startswith("read-only") else errno.ENOSPC

        def failing_fsync(fd: int) -> None:
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(os, "fsync", failing_fsync)
        fs = files / "fs"
    elif problem.startswith("no space"):
        _fill(fs)
    code, lines = cli([f"trainer.output_dir={fs}"])
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"config error: the run directory {fs / 'run'} cannot be used: "), lines[0]
    assert problem in lines[0].lower(), lines[0]


def test_a_run_directory_without_write_permission_is_one_line_naming_it():
    """No permission to write: the check every rank runs before the start, as an unprivileged user (root
    may write anywhere: a root test process drops to `nobody` for the call), in a directory it may enter
    but not write (pytest's own temporary directories are closed to other users)."""
    import shutil
    import tempfile

    from spmd_grpo.run.lock import check_writable

    base = Path(tempfile.mkdtemp(prefix="spmd_grpo_no_write_"))
    parent = base / "read_only_parent"
    parent.mkdir()
    base.chmod(0o755)
    parent.chmod(0o555)
    euid = os.geteuid()
    try:
        if euid == 0:
            os.seteuid(65534)
        with pytest.raises(ConfigError) as e:
            check_writable(parent / "run")
    finally:
        os.seteuid(euid)
        shutil.rmtree(base)
    assert str(e.value) == (
        f"the run directory {parent / 'run'} cannot be used: {parent / 'run'}: Permission denied "
        "(trainer.output_dir / trainer.experiment_name name it)"
    )


def test_the_launcher_says_a_config_error_once_before_starting_any_rank(files, monkeypatch, capsys):
    """`python -m spmd_grpo.launch --nnodes 2 --nproc_per_node 2 -m spmd_grpo.train ...`: the config is
    checked for a world of 4 in the launcher itself; a mistake is one line, exit 2, and torchrun never starts a rank (it
    is replaced here by a stand-in that fails the test). A valid config passes the check, and torchrun (and the
    ranks it starts) find the shutdown timeout it will use in TORCH_ELASTIC_SHUTDOWN_TIMEOUT: the flag's, else
    the config's grace period plus a margin, never below torchrun's own 30 s."""
    from spmd_grpo import launch

    shutdown_s: list[str | None] = []

    def torchrun(argv):
        shutdown_s.append(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"))
        raise ReachedTrainer

    monkeypatch.setattr("torch.distributed.run.main", torchrun)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(files)
    head = ["--nnodes", "2", "--nproc_per_node", "2", "-m", "spmd_grpo.train", str(files / "base.yaml")]
    for bad, says in [
        (["worker.rollout.temprature=0.7"], "unknown config key worker.rollout.temprature"),
        (["data.rollout_batch_size=6"], "must be divisible by the world size (4)"),  # 2 nodes x 2
        (["trainer.output_dir=ROOT/a_file"], "is a file, not a directory"),
    ]:
        with pytest.raises(SystemExit) as e:
            launch.main([*head, *(o.replace("ROOT", str(files)) for o in bad)])
        lines = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith("config error: "), lines
        assert says in lines[0], lines[0]
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "")
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")  # unset now and after the test
    assert not shutdown_s  # torchrun never started
    with pytest.raises(ReachedTrainer):  # the control: the valid config goes on to torchrun
        launch.main(head)
    assert capsys.readouterr().err == ""
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    with pytest.raises(ReachedTrainer):
        launch.main([*head, "trainer.preempt_grace_s=100"])
    with pytest.raises(ReachedTrainer):
        launch.main(["--shutdown_timeout", "200", *head, "trainer.preempt_grace_s=100"])
    assert shutdown_s == ["30", "105", "200"]  # grace 25 s (the default) + 5; 100 + 5; the flag
