"""Does vLLM share a prompt's image encoding and prefill across its n single-sample requests?

    VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 python benchmarks/rollout_sharing.py --mode MODE

The rollout (spmd_grpo/rollout/generate.py) submits each prompt as n requests of one sample with their own seeds.
This runs one rollout-shaped batch (P prompts, each with its own image, n samples, the engine's settings:
seeded requests, chunked prefill off) on the real vLLM CPU engine and a tiny random Qwen2.5-VL, and prints
how many images the vision encoder ran on, vLLM's prefix-cache counters and the generate time. MODE:
  separate        n single-sample requests per prompt (what the rollout does), prefix caching on (default)
  separate-nocache  the same with prefix caching off (what would happen if nothing were shared)
  n               one request per prompt with SamplingParams(n=n)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _count_encoder_images(worker) -> None:
    """Installed in the engine's worker: count images through the vision tower's forward."""
    visual = worker.model_runner.model.visual
    visual._images = 0

    def hook(module, args, kwargs, out):
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        module._images += len(grid)

    visual.register_forward_hook(hook, with_kwargs=True)


def _encoded_images(worker) -> int:
    return worker.model_runner.model.visual._images


def _requests(processor, args):
    prompts, n, mode, max_tokens, side = args.prompts, args.n, args.mode, args.max_tokens, args.image_size
    from PIL import Image
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from spmd_grpo.rollout.generate import request_seed

    requests, params = [], []
    for uid in range(prompts):
        content = [{"type": "image"}, {"type": "text", "text": f"Which color? {uid}"}]
        text = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True
        )
        ids = processor.tokenizer(text)["input_ids"]
        image = Image.new("RGB", (side, side), (30 * uid % 255, 120, 200))
        prompt = TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": [image]})
        samples = 1 if mode == "n" else n
        for k in range(samples):
            requests.append(prompt)
            params.append(
                SamplingParams(
                    n=n if mode == "n" else 1,
                    seed=request_seed(0, 1, uid, k),
                    max_tokens=max_tokens,
                    ignore_eos=True,
                    logprobs=0,
                )
            )
    return requests, params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["separate", "separate-nocache", "n"], required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=224, help="square image side in pixels")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, as the engine sets it on CPU
    from transformers import AutoProcessor
    from vllm import LLM

    from spmd_grpo.tools.make_tiny_model import TinyModelSpec, cached_tiny_model

    model = cached_tiny_model(REPO / ".cache", TinyModelSpec())
    processor = AutoProcessor.from_pretrained(model)
    llm = LLM(
        model=str(model),
        seed=0,
        dtype="float32",
        enforce_eager=True,
        enable_chunked_prefill=False,
        max_model_len=1024,
        max_num_batched_tokens=16384,
        enable_prefix_caching=args.mode != "separate-nocache",
        limit_mm_per_prompt={"image": 1, "video": 0},
        gpu_memory_utilization=0.3,
        disable_log_stats=False,
    )
    llm.collective_rpc(_count_encoder_images)
    requests, params = _requests(processor, args)
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    samples = sum(len(o.outputs) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) * len(o.outputs) for o in outputs)
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    print(
        f"mode={args.mode} prompts={args.prompts} n={args.n} requests={len(requests)} samples={samples} "
        f"prompt_tokens={prompt_tokens} images_encoded={llm.collective_rpc(_encoded_images)[0]} "
        f"prefix_cache_queries={metrics.get('vllm:prefix_cache_queries')} "
        f"prefix_cache_hits={metrics.get('vllm:prefix_cache_hits')} generate_s={elapsed:.2f} "
        f"block_size={llm.llm_engine.vllm_config.cache_config.block_size}"
    )


if __name__ == "__main__":
    main()
