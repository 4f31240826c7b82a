"""Trainer (transformers) vs vLLM CPU on one tiny model of a family: logprobs of vLLM's own samples, the same
sequences fed back teacher-forced (prompt_logprobs), a float64 transformers reference (fp32 runs), and for MoE
models the router's top-k agreement per token and layer between the two.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/moe_router_parity.py [--family F] [--dtype float32]
        [--norm-topk-prob-false] [--reload [N]] [--no-repack]

`--reload` first pushes the checkpoint's own tensors back into the running engine (N times, default 1) with
`reload_weights(is_checkpoint_format=True)`, the trainer's weight-sync call: the same numbers, so any change
in the comparison is vLLM's reload path, not the weights. The engine gets the trainer's fused-MoE re-pack
(`spmd_grpo.rollout.moe_reload`) unless `--no-repack` (vLLM's reload as it is).

`--norm-topk-prob-false` serves a copy whose config.json says `text_config.norm_topk_prob: false` (which the
trainer refuses): transformers' router renormalises the top-k anyway, vLLM does not, and the difference
shows what a checkpoint with that flag gives.

Prints one `RESULT {json}` line:
  sampled_diff                 max |transformers - vLLM| over the sampled tokens' logprobs (sampling pass)
  tf_diff                      the same against vLLM's teacher-forced pass over prompt + response
  hf_vs_fp64, vllm_vs_fp64     each side against transformers in float64 (fp32 runs): which side is off
  route_total, route_disagree  (token, layer) pairs compared, and those whose top-k expert SETS differ
  margins_at_disagreement      there, the gap between the k-th and (k+1)-th router probability
  median_margin                that gap's median over one layer's tokens (how decisive the router is)
vLLM runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so forward hooks on its `mlp.gate` layers see
the router logits; prefix caching is off so the teacher-forced pass computes every token. The model is built
with `spmd_grpo.tools.make_tiny_model` into `.cache/`.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from PIL import Image

from spmd_grpo.models.families import family_of
from spmd_grpo.rollout.moe_reload import repack_on_worker
from spmd_grpo.tools.make_tiny_model import TinyModelSpec, cached_tiny_model

COLORS = [(220, 30, 30), (30, 200, 40), (40, 60, 220)]


def hf_logprobs(model, family, full: list[int], enc, dtype) -> torch.Tensor:
    """[T, vocab] float64 log-softmax of transformers' logits over the whole sequence (mrope over all)."""
    input_ids = torch.tensor([full])
    mask = torch.ones_like(input_ids)
    positions = family.position_ids(model, input_ids, mask, enc["image_grid_thw"])
    with torch.no_grad():
        logits = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            pixel_values=enc["pixel_values"].to(dtype),
            image_grid_thw=enc["image_grid_thw"],
        ).logits
    return torch.log_softmax(logits[0].double(), -1)


def capture(modules, into: list) -> None:
    """Append each module's router logits [tokens, E] (first output) to `into` at every forward."""
    for m in modules:
        m.register_forward_hook(lambda m, i, o: into.append((o[0] if isinstance(o, tuple) else o).float()))


def route_agreement(hf_layers, vllm_layers, top_k: int, res: dict) -> None:
    for h, v in zip(hf_layers, vllm_layers, strict=False):
        n = min(h.shape[0], v.shape[0])
        h, v = h[-n:], v[-n:]  # the trailing tokens: the ones both passes computed
        h_set = torch.topk(h, top_k, -1).indices.sort(-1).values
        v_set = torch.topk(v, top_k, -1).indices.sort(-1).values
        differs = (h_set != v_set).any(-1)
        res["route_total"] += n
        res["route_disagree"] += int(differs.sum())
        probs = torch.sort(torch.softmax(h, -1), -1, descending=True).values
        margin = probs[:, top_k - 1] - probs[:, top_k]
        res["margins_at_disagreement"] += margin[differs].tolist()[:5]
        res.setdefault("median_margin", margin.median().item())


def _with_norm_topk_prob_false(model_dir: str) -> str:
    import shutil
    import tempfile

    out = Path(tempfile.mkdtemp()) / "model"
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["text_config"]["norm_topk_prob"] = False
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--family", default="qwen3_vl_moe")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--norm-topk-prob-false", action="store_true")
    ap.add_argument("--reload", type=int, nargs="?", const=1, default=0)
    ap.add_argument("--no-repack", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; unset, vLLM CPU takes most of the host
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir = str(cached_tiny_model(Path(".cache"), TinyModelSpec(family=args.family)))
    if args.norm_topk_prob_false:
        model_dir = _with_norm_topk_prob_false(model_dir)
    dtype = getattr(torch, args.dtype)
    processor = AutoProcessor.from_pretrained(model_dir)
    content = [{"type": "image"}, {"type": "text", "text": "Which color?"}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    images = [Image.new("RGB", (64, 64), c) for c in COLORS]
    llm = LLM(
        model=model_dir,
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=1024,
        limit_mm_per_prompt={"image": 1},
        logprobs_mode="processed_logprobs",
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        max_num_batched_tokens=4096,
        seed=0,
        mm_processor_kwargs={"size": {"shortest_edge": 3136, "longest_edge": 262144}},
    )
    if not args.no_repack:
        llm.collective_rpc(repack_on_worker)
    if args.reload:
        from safetensors.torch import load_file

        tensors = load_file(str(Path(model_dir) / "model.safetensors"))
    for _ in range(args.reload):
        llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": iter(tensors.items()), "is_checkpoint_format": True}
        )
        llm.reset_prefix_cache()
        llm.reset_mm_cache()
        llm.llm_engine.reset_encoder_cache()
    prompts = [TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": im}) for im in images]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=1.0, logprobs=0, seed=1))
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).eval()
    family = family_of(hf.config)
    top_k = getattr(hf.config.text_config, "num_experts_per_tok", 0)
    hf_routes, vllm_routes = [], []
    if family.moe:
        capture([layer.get_submodule(family.moe.router) for layer in family.decoder_layers(hf)], hf_routes)
        vllm_model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        capture([m for n, m in vllm_model.named_modules() if n.endswith("mlp.gate")], vllm_routes)
    ref = None
    if dtype == torch.float32:
        # the experts' per-expert loop: torch's grouped_mm (transformers' default) has no float64
        ref = AutoModelForImageTextToText.from_pretrained(
            model_dir, dtype=torch.float64, experts_implementation="eager"
        ).eval()
    res = {"sampled_diff": 0.0, "tf_diff": 0.0}
    res.update(hf_vs_fp64=0.0 if ref is not None else None, vllm_vs_fp64=0.0 if ref is not None else None)
    res.update(route_total=0, route_disagree=0, margins_at_disagreement=[])
    for out, image in zip(outs, images, strict=True):
        enc = processor(text=[text], images=[image], return_tensors="pt")
        assert enc["input_ids"][0].tolist() == list(out.prompt_token_ids), "prompt expansion differs"
        num_prompt, response = len(out.prompt_token_ids), list(out.outputs[0].token_ids)
        full = list(out.prompt_token_ids) + response
        hf_routes.clear()
        lp = hf_logprobs(hf, family, full, enc, dtype)
        ours = torch.tensor([lp[num_prompt - 1 + j, t].item() for j, t in enumerate(response)])
        sampled = torch.tensor([d[t].logprob for d, t in zip(out.outputs[0].logprobs, response, strict=True)])
        res["sampled_diff"] = max(res["sampled_diff"], (ours - sampled).abs().max().item())
        vllm_routes.clear()
        forced = llm.generate(
            # the unexpanded prompt (one image pad) + the response: vLLM expands the image as before
            [TokensPrompt(prompt_token_ids=ids + response, multi_modal_data={"image": image})],
            SamplingParams(max_tokens=1, prompt_logprobs=0),
            use_tqdm=False,
        )[0]
        assert list(forced.prompt_token_ids) == full, "teacher-forced sequence differs"
        theirs = torch.tensor(
            [forced.prompt_logprobs[num_prompt + j][t].logprob for j, t in enumerate(response)]
        )
        res["tf_diff"] = max(res["tf_diff"], (ours - theirs).abs().max().item())
        if ref is not None:
            lp64 = hf_logprobs(ref, family, full, enc, torch.float64)
            exact = torch.tensor([lp64[num_prompt - 1 + j, t].item() for j, t in enumerate(response)])
            res["hf_vs_fp64"] = max(res["hf_vs_fp64"], (ours - exact).abs().max().item())
            res["vllm_vs_fp64"] = max(res["vllm_vs_fp64"], (theirs - exact).abs().max().item())
        if family.moe:
            route_agreement(list(hf_routes), list(vllm_routes), top_k, res)
    flag = {
        "norm_topk_prob": not args.norm_topk_prob_false,
        "reload": args.reload,
        "repack": not args.no_repack,
    }
    print("RESULT", json.dumps({"family": args.family, "dtype": args.dtype, **flag, **res}))


if __name__ == "__main__":
    main()
