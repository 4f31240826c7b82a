"""How far a frozen output head lets the layers below it move an answer: why the smoke model is 256 wide.

    .venv/bin/python benchmarks/head_reach.py [--steps 200] [--lr 1e-3]

For the tests' tiny model (64 wide, transformers' init) and `spmd_grpo.smoke.SMOKE_MODEL`, printed per model:
- `reach`: the largest logit gain any hidden state can give a token, |head row| * sqrt(hidden size) (a hidden
  state has that norm after the final RMSNorm), as the median over the answer digits' tokens, and the spread
  of the logits at init it is to be compared with;
- `entropy`: of the first answer token at init on colour-task prompts (a uniform choice is ln(vocab));
- `lora fit` / `full fit`: the probability of a right first digit after `--steps` supervised Adam steps on
  the first answer token (32 colour prompts a step), with PEFT LoRA (rank 16, alpha 32, `all-linear`, the
  tower excluded: the head stays frozen) and with every weight trained. GRPO cannot do better than the
  supervised fit of the same parameters; when the LoRA fit stalls near zero, no learning rate helps it.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from spmd_grpo.data.synthetic import COLOR_PROBLEM, COLORS, color_task_examples  # noqa: E402
from spmd_grpo.smoke import SMOKE_MODEL  # noqa: E402
from spmd_grpo.tools.make_tiny_model import TinyModelSpec, cached_tiny_model  # noqa: E402


def colour_batch(processor, n: int, seed: int):
    """`n` prompts of the colour task (`builtin:color`'s own rows) and their answers."""
    import io

    from PIL import Image

    rows = color_task_examples(n, seed)
    images = [Image.open(io.BytesIO(row["images"][0]["bytes"])) for row in rows]
    text = COLOR_PROBLEM.replace("<image>", "")
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    prompt = processor.apply_chat_template(chat, add_generation_prompt=True)
    inputs = processor(
        text=[prompt] * n, images=images, return_tensors="pt", min_pixels=3136, max_pixels=12544
    )
    return inputs, [int(row["answer"]) for row in rows]


def digit_tokens(tokenizer) -> dict[int, list[int]]:
    """Token ids whose text starts with each answer digit (the colour reward reads the first digit)."""
    texts = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    return {d: [i for i, t in enumerate(texts) if t.strip()[:1] == str(d)] for d in range(len(COLORS))}


def fit(model_dir: Path, lora: bool, steps: int, lr: float, seed: int = 0) -> tuple[float, float]:
    """(entropy of the first answer token at init, p(right first digit) after `steps` supervised steps)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    torch.manual_seed(seed)
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        cfg = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", exclude_modules=r".*visual.*")
        model = get_peft_model(model, cfg)
    answers_of = digit_tokens(processor.tokenizer)
    optim = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    entropy = right = float("nan")
    for step in range(steps + 1):
        inputs, answers = colour_batch(processor, 32, seed=1000 * seed + step)
        logp = torch.log_softmax(model(**inputs).logits[:, -1].float(), -1)
        p_right = torch.stack([torch.logsumexp(logp[i, answers_of[a]], 0) for i, a in enumerate(answers)])
        if step == 0:
            entropy = float(-(logp.exp() * logp).sum(-1).mean().detach())
        right = float(p_right.exp().mean().detach())
        if step < steps:
            optim.zero_grad()
            (-p_right.mean()).backward()
            optim.step()
    return entropy, right


def reach(model_dir: Path) -> tuple[float, float, int]:
    """(median reach over answer tokens, spread of logits at init, vocabulary size) of the saved head."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    weights = load_file(str(model_dir / "model.safetensors"))
    head = weights.get("lm_head.weight", weights.get("model.language_model.embed_tokens.weight"))
    width = head.shape[1]
    answers = sorted(
        i for ids in digit_tokens(AutoTokenizer.from_pretrained(model_dir)).values() for i in ids
    )
    norms = head[answers].norm(dim=1) * math.sqrt(width)
    return float(norms.median()), float(head.std() * math.sqrt(width)), head.shape[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    specs = {"tests' tiny model": TinyModelSpec(), "smoke model (SMOKE_MODEL)": SMOKE_MODEL}
    print(f"supervised fits: {args.steps} Adam steps at lr {args.lr}, 32 prompts a step")
    print(
        "| model | hidden | head_logit_std | reach (nats) | logit spread at init | entropy at init "
        "(uniform) | lora fit | full fit |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, spec in specs.items():
        model_dir = cached_tiny_model(REPO / ".cache", spec)
        gain, spread, vocab = reach(model_dir)
        entropy, lora_right = fit(model_dir, True, args.steps, args.lr)
        _, full_right = fit(model_dir, False, args.steps, args.lr)
        print(
            f"| {name} | {spec.hidden_size} | {spec.head_logit_std} | {gain:.2f} | {spread:.2f} | "
            f"{entropy:.2f} ({math.log(vocab):.2f}) | {lora_right:.3f} | {full_right:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
