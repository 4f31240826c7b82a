"""Export a checkpoint written by the trainer (2 ranks, torchrun) to an HF directory; load it in transformers
and in vLLM (plain python subprocess) with an image prompt; the exported tensors are the trained parameters.

fp32 export, so the comparisons are exact; shards of 1 MB, so the tiny model spans several files + an index.
Every export of this file is made first (`exports`), and one vLLM process loads them one after the other: a
fresh process per export spent most of its time importing vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open

import spmd_grpo.run.export as export_mod
from spmd_grpo.run.checkpoint_dirs import saved_lora_rank
from spmd_grpo.run.export import export_hf
from tests.conftest import REPO, tiny_model

VLLM_SCRIPT = r"""
import gc, json, sys
from PIL import Image
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

jobs, result = json.load(open(sys.argv[1])), sys.argv[2]
image = Image.new("RGB", (56, 56), (200, 40, 40))
out = {}
for name, job in jobs.items():
    # vLLM collects the whole heap three times while it builds an engine; frozen after the previous engine
    # is collected, those passes skip the imports (vLLM's shutdown unfreezes it again).
    gc.collect()
    gc.freeze()
    adapter = job.get("adapter")
    lora = dict(enable_lora=True, max_lora_rank=8, max_loras=1) if adapter else {}
    llm = LLM(model=job["model"], enforce_eager=True, dtype="float32", max_model_len=512,
              limit_mm_per_prompt={"image": 1}, **lora)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], logprobs=5, ignore_eos=True)
    requests = {"base": None, **({"lora": LoRARequest("trained", 1, adapter)} if adapter else {})}
    out[name] = {}
    for key, request in requests.items():
        prompt = {"prompt": job["prompt"], "multi_modal_data": {"image": image}}
        o = llm.generate(prompt, params, lora_request=request)[0].outputs[0]
        first = {int(t): float(lp.logprob) for t, lp in o.logprobs[0].items()}
        out[name][key] = {"token_ids": list(o.token_ids), "first_logprobs": first}
    del llm
json.dump(out, open(result, "w"))
"""
CASES = {  # case -> (family, tied embeddings)
    "untied": ("qwen2_5_vl", False),
    "tied": ("qwen2_5_vl", True),
    "qwen2_vl": ("qwen2_vl", False),
    "qwen3_vl": ("qwen3_vl", False),
}
LORA_RANK = 4


def weight_names(model_dir) -> set[str]:
    names = set()
    for f in model_dir.glob("model*.safetensors"):
        with safe_open(f, "pt") as st:
            names.update(st.keys())
    return names


def run_vllm_script(script: str, args: list[str], result: Path) -> dict:
    """Run `script` (python -c) with `args` and `result` in a fresh process (vLLM sets process-wide state),
    one thread, vLLM's engine core in-process (no separate process: ~3x faster start here); its JSON."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    cmd = [sys.executable, "-c", script, *args, str(result)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return json.loads(result.read_text())


def image_prompt(model_dir: Path) -> str:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    content = [{"type": "image"}, {"type": "text", "text": "Which color?"}]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


@pytest.fixture(scope="module")
def exports(saved_checkpoints, tmp_path_factory) -> dict:
    """{case: the export of the checkpoints' step 2 (`out`), the bytes each DCP read held (`loads`), the base
    model, the saved run (`work`), the prompt and what vLLM generated from the export (`vllm`)}, and "lora":
    the LoRA checkpoint's adapter export (`out`) and merged model (`merged`), vLLM's `base` and `lora`
    generations. One vLLM process serves every export."""
    root = tmp_path_factory.mktemp("export")
    found, jobs = {}, {}
    for case, (family, tied) in CASES.items():
        model_dir = tiny_model(tie_word_embeddings=tied, family=family)
        work = saved_checkpoints(model_dir)  # the checkpoint tests' save, shared (one launch for all)
        loads = []  # streaming: every DCP read holds at most one shard's tensors
        real_load = export_mod.dcp.load

        def counting_load(sd, real_load=real_load, loads=loads, **kw):
            loads.append(sum(t.numel() * t.element_size() for t in sd.values()))
            return real_load(sd, **kw)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(export_mod.dcp, "load", counting_load)
            out = export_hf(
                work / "run" / "checkpoints" / "global_step_2", root / case, "float32", shard_size_mb=1
            )
        found[case] = {
            "model_dir": model_dir,
            "work": work,
            "out": out,
            "loads": loads,
            "prompt": image_prompt(out),
        }
        jobs[case] = {"model": str(out), "prompt": found[case]["prompt"], "max_tokens": 4}

    model_dir = tiny_model()
    work = saved_checkpoints(model_dir, lora_rank=LORA_RANK)
    ckpt = work / "run" / "checkpoints" / "global_step_2"
    out = export_hf(ckpt, root / "adapter", "float32", merged=root / "merged")
    found["lora"] = {"model_dir": model_dir, "work": work, "out": out, "merged": root / "merged"}
    found["lora"]["prompt"] = image_prompt(model_dir)
    jobs["lora"] = {
        "model": str(model_dir),
        "adapter": str(out),
        "prompt": found["lora"]["prompt"],
        "max_tokens": 1,
    }

    (root / "jobs.json").write_text(json.dumps(jobs))
    for case, got in run_vllm_script(VLLM_SCRIPT, [str(root / "jobs.json")], root / "vllm.json").items():
        found[case]["vllm"] = got
    return found


@pytest.mark.parametrize("case", CASES)
def test_export_loads_in_transformers_and_vllm(case, exports):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    found = exports[case]
    model_dir, out, loads, tied = found["model_dir"], found["out"], found["loads"], CASES[case][1]
    trained = torch.load(found["work"] / "save.pt", weights_only=False)["at_save"][
        "params"
    ]  # the checkpoint's
    assert (
        saved_lora_rank(found["work"] / "run" / "checkpoints" / "global_step_2") == 0
    )  # a LoRA resume is refused

    # Streaming: every DCP read held at most one shard's tensors.
    total = sum(
        t.numel() * t.element_size() for n, t in trained.items() if not (tied and n == "lm_head.weight")
    )
    assert len(loads) >= 2 and max(loads) <= 1 << 20 and sum(loads) == total

    files = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in files and "config.json" in files
    assert {
        "generation_config.json",
        "tokenizer.json",
        "processor_config.json",
        "chat_template.jinja",
    } <= set(files)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == weight_names(out)
    # Same tensor names as the base checkpoint (the family's on-disk names); lm_head only when untied.
    assert weight_names(out) == weight_names(model_dir)
    assert ("lm_head.weight" in weight_names(out)) == (not tied)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"

    # transformers: every parameter is the trained one (also proves no tensor was left at its init).
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    params = dict(model.named_parameters(remove_duplicate=False))
    assert set(trained) <= set(params)
    for name, t in trained.items():
        assert torch.equal(params[name].detach(), t), name
    if tied:
        assert (
            params["lm_head.weight"].data_ptr()
            == params["model.language_model.embed_tokens.weight"].data_ptr()
        )

    processor = AutoProcessor.from_pretrained(out)
    image = Image.new("RGB", (56, 56), (200, 40, 40))
    inputs = processor(text=[found["prompt"]], images=[image], return_tensors="pt")
    gen = model.generate(
        **inputs,
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    assert gen.sequences.shape[1] == inputs["input_ids"].shape[1] + 4
    hf_first = torch.log_softmax(gen.logits[0][0].float(), dim=-1)  # raw logits, as vLLM reports

    # vLLM loaded the same directory and agrees on the first token's distribution.
    got = found["vllm"]["base"]
    assert len(got["token_ids"]) == 4
    first = {int(t): lp for t, lp in got["first_logprobs"].items()}
    assert max(abs(lp - hf_first[t].item()) for t, lp in first.items()) < 1e-3, (first, hf_first.topk(5))


def test_lora_export_is_a_peft_adapter_that_peft_and_vllm_load_and_merges(exports):
    """A LoRA checkpoint (adapters only, trained 2 steps at world 2) exports as a PEFT adapter directory:
    `PeftModel.from_pretrained` finds every trained adapter tensor, vLLM (`enable_lora`, `LoRARequest`)
    serves it with the PEFT model's first-token logprobs, and `--merged` writes a plain HF model equal to
    base + adapters."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    found = exports["lora"]
    model_dir, out = found["model_dir"], found["out"]
    trained = torch.load(found["work"] / "save.pt", weights_only=False)["at_save"]["params"]
    adapters = {n: t for n, t in trained.items() if ".lora_" in n}
    # what a resume compares with worker.actor.model.lora.rank
    assert saved_lora_rank(found["work"] / "run" / "checkpoints" / "global_step_2") == LORA_RANK
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", LORA_RANK, 8.0)

    processor = AutoProcessor.from_pretrained(model_dir)
    image = Image.new("RGB", (56, 56), (200, 40, 40))
    inputs = processor(text=[found["prompt"]], images=[image], return_tensors="pt")

    def first_logprobs(model) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(**inputs).logits[0, -1].float(), dim=-1)

    base_lp = first_logprobs(AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32))
    peft_model = PeftModel.from_pretrained(
        AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32), out
    )
    loaded = {
        n.removeprefix("base_model.model."): p for n, p in peft_model.named_parameters() if ".lora_" in n
    }
    assert loaded.keys() == adapters.keys()
    for name, t in adapters.items():
        assert torch.equal(loaded[name].detach(), t), name
    peft_lp = first_logprobs(peft_model)
    assert (peft_lp - base_lp).abs().max() > 1e-2  # the adapters matter (negative control)
    merged_lp = first_logprobs(
        AutoModelForImageTextToText.from_pretrained(found["merged"], dtype=torch.float32)
    )
    assert (merged_lp - peft_lp).abs().max() < 1e-4

    for key, want in (("base", base_lp), ("lora", peft_lp)):
        got = found["vllm"][key]["first_logprobs"]
        assert max(abs(lp - want[int(t)].item()) for t, lp in got.items()) < 1e-3, (key, got)


def test_export_keeps_the_base_model_and_drops_a_stale_adapter(saved_checkpoints, tmp_path):
    """An export never writes into the base model's directory (it would overwrite the weights the run reads),
    nor the adapter and the merged model into one directory; an export over a previous one of the other kind
    (full over adapter, adapter over full) removes the other's weight files, which transformers would otherwise
    load together (the adapter applied on top of the weights)."""
    import shutil

    from transformers import AutoModelForImageTextToText

    model_dir = tiny_model()
    full = saved_checkpoints(model_dir) / "run" / "checkpoints" / "global_step_2"
    lora = saved_checkpoints(model_dir, lora_rank=LORA_RANK) / "run" / "checkpoints" / "global_step_2"
    base = shutil.copytree(model_dir, tmp_path / "base")
    before = {p.name: p.read_bytes() for p in base.iterdir()}
    with pytest.raises(ValueError, match="is the base model directory"):
        export_hf(full, base, "float32", model_path=str(base))
    with pytest.raises(ValueError, match="is the base model directory"):
        export_hf(lora, tmp_path / "adapter", "float32", model_path=str(base), merged=base)
    assert {p.name: p.read_bytes() for p in base.iterdir()} == before
    with pytest.raises(ValueError, match="is OUT_DIR"):
        export_hf(lora, tmp_path / "both", "float32", merged=tmp_path / "both")

    out = export_hf(lora, tmp_path / "out", "float32")  # an adapter export, then the full one over it
    export_hf(full, out, "float32")
    assert not (out / "adapter_config.json").exists() and not (out / "adapter_model.safetensors").exists()
    trained = torch.load(full.parents[2] / "save.pt", weights_only=False)["at_save"]["params"]
    params = dict(AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).named_parameters())
    assert all(torch.equal(params[n].detach(), t) for n, t in trained.items())
    export_hf(lora, out, "float32")
    assert not list(out.glob("model*.safetensors")) and (out / "adapter_model.safetensors").is_file()
