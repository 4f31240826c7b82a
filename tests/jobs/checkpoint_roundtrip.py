"""torchrun job: train, checkpoint, resume in a fresh process (any world size), continue identically.

    torchrun --nproc_per_node W tests/jobs/checkpoint_roundtrip.py --phase save --case MODEL_DIR RUN_DIR OUT.pt R EP ...
    torchrun --nproc_per_node W tests/jobs/checkpoint_roundtrip.py --phase resume --case MODEL_DIR RUN_DIR OUT.pt R EP \
        [--verify MODEL_DIR RUN_DIR OUT.pt]

Each `--case` is one model with its own run directory, result file, LoRA rank (0: full fine-tuning) and
`worker.actor.fsdp.expert_parallel_size` (an MoE model: saved at one EP size, resumed at another); the
cases run one after the other in the same process group, each from the same seeds, so one launch serves all
the models a test session needs.

`save`: FSDP2 policy (fp32) + AdamW with a warmup schedule; steps 1 and 2 on a deterministic multimodal
log-likelihood loss, saving after each (save_limit=1, so step 1 is pruned); then the uninterrupted reference
continues with step 3. `resume`: a fresh policy/optimizer loads the newest checkpoint (`find_checkpoint(auto)`)
and takes the same step 3. Rank 0 writes OUT.pt with, at the checkpoint (`at_save`) and after step 3
(`params_after`): full parameters and Adam moments keyed by HF name, lr, scheduler step, the next global prompt
batch of the restored sampler and an RNG probe drawn right after the save / load. With a LoRA rank R > 0 the
policy trains LoRA adapters of rank R (the checkpoint then holds adapters only, and the config section that
export reads).

`--verify` (resume phase, before the cases): the start of `spmd_grpo.train` on RUN_DIR, whose newest checkpoint
has a corrupted file of the same size: every rank plans by sizes (`plan_start`), follows rank 0
(`agree_on_start`), and the ranks verify the checksums together (`verify_start`, each a share of the files).
Rank 0 writes OUT.pt with each rank's plan before and after the checksums and the warnings it logged.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from spmd_grpo.actor.optimizer import build_optimizer
from spmd_grpo.config.workers import ActorConfig, FSDPConfig, LoRAConfig, ModelConfig, OptimConfig
from spmd_grpo.data.sampler import PromptSampler
from spmd_grpo.models.build import build_policy
from spmd_grpo.models.inputs import collate
from spmd_grpo.models.weights import hf_name
from spmd_grpo.parallel.collectives import all_gather_objects, init_distributed
from spmd_grpo.parallel.devices import seed_everything
from spmd_grpo.run.checkpoint import load_checkpoint, save_checkpoint
from spmd_grpo.run.checkpoint_dirs import find_checkpoint
from tests.jobs.common import run_job

GLOBAL_BATCH = 2
TOTAL_STEPS = 10
SAVE_STEPS = (1, 2)


def make_batch(processor, step: int, rank: int, world_size: int):
    """This rank's share of a fixed global batch of GLOBAL_BATCH image+text sequences for `step`."""
    share = GLOBAL_BATCH // world_size
    prompts, responses, pixels, grids = [], [], [], []
    for i in range(rank * share, (rank + 1) * share):
        gen = torch.Generator().manual_seed(1000 * step + i)
        image = Image.new("RGB", (56, 56 + 28 * (i % 2)), ((60 * step + 90 * i) % 255, 120, 200))
        content = [{"type": "image"}, {"type": "text", "text": f"Which color? {step} {i}"}]
        text = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True
        )
        enc = processor(text=[text], images=[image], return_tensors="pt")
        prompts.append(enc["input_ids"][0].tolist())
        responses.append(torch.randint(0, 256, (3 + 4 * i,), generator=gen).tolist())
        pixels.append(enc["pixel_values"])
        grids.append(enc["image_grid_thw"])
    return collate(prompts, responses, pixels, grids, processor.tokenizer.pad_token_id)


def train_step(policy, optim, processor, step: int, world) -> None:
    """Mean over sequences of per-sequence mean log-likelihood (FSDP averages the ranks' shares)."""
    batch = make_batch(processor, step, world.rank, world.world_size)
    logprobs, _ = policy(batch)
    mask = batch.response_mask
    loss = -((logprobs * mask).sum(1) / mask.sum(1)).mean()
    loss.backward()
    optim.optimizer.step()
    optim.scheduler.step()
    optim.optimizer.zero_grad(set_to_none=True)


def snapshot(policy, optim) -> dict:
    """Full (unsharded) parameters and Adam state; collective."""
    params, exp_avg, exp_avg_sq, adam_step = {}, {}, {}, {}
    for name, p in policy.named_parameters():
        params[hf_name(name)] = p.full_tensor().detach().clone()
        state = optim.optimizer.state.get(p, {})
        if state:
            exp_avg[hf_name(name)] = state["exp_avg"].full_tensor().clone()
            exp_avg_sq[hf_name(name)] = state["exp_avg_sq"].full_tensor().clone()
            adam_step[hf_name(name)] = float(state["step"])
    return {
        "params": params,
        "exp_avg": exp_avg,
        "exp_avg_sq": exp_avg_sq,
        "adam_step": adam_step,
        "lr": optim.optimizer.param_groups[0]["lr"],
        "scheduler_last_epoch": optim.scheduler.last_epoch,
    }


def rng_probe() -> list[float]:
    return [random.random(), float(np.random.rand()), float(torch.rand(1))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["save", "resume"], required=True)
    ap.add_argument(
        "--case",
        nargs=5,
        action="append",
        required=True,
        metavar=("MODEL_DIR", "RUN_DIR", "OUT", "LORA_RANK", "EP"),
    )
    ap.add_argument("--verify", nargs=3, metavar=("MODEL_DIR", "RUN_DIR", "OUT"))
    args = ap.parse_args()
    world = init_distributed("cpu")
    if args.verify:
        verify_case(world, *args.verify)
    for model_dir, run_dir, out, lora_rank, ep in args.case:
        run_case(world, model_dir, Path(run_dir), out, args.phase, int(lora_rank), int(ep))


def verify_overrides(model_dir: str | Path, run_dir: Path) -> list[str]:
    """The config of `--verify`'s start (the test writes it into the checkpoints: no change to report)."""
    return [
        f"worker.actor.model.model_path={model_dir}",
        f"trainer.output_dir={run_dir.parent}",
        f"trainer.experiment_name={run_dir.name}",
    ]


def verify_case(world, model_dir: str, run_dir: str, out_path: str) -> None:
    import logging

    from spmd_grpo.config.loader import load_config
    from spmd_grpo.run.lineage import agree_on_start
    from spmd_grpo.run.start import plan_start
    from spmd_grpo.run.verify import verify_start

    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("spmd_grpo").addHandler(handler)
    cfg = load_config(None, verify_overrides(model_dir, Path(run_dir)))
    planned = plan_start(cfg, rank=world.rank)  # before the process group in spmd_grpo.train
    chosen = verify_start(agree_on_start(planned, world), cfg, world)
    logging.getLogger("spmd_grpo").removeHandler(handler)
    changes = [str(c) for c in chosen.changes]
    views = all_gather_objects((planned.checkpoint, chosen.checkpoint, chosen.abandoned, changes, said))
    if world.rank == 0:
        torch.save({"views": views, "world_size": world.world_size}, out_path)


def run_case(
    world, model_dir: str, run_dir: Path, out_path: str, phase: str, lora_rank: int, ep: int
) -> None:
    from transformers import AutoProcessor

    seed_everything(7 + world.rank)
    processor = AutoProcessor.from_pretrained(model_dir)
    actor = ActorConfig(
        model=ModelConfig(model_path=model_dir, lora=LoRAConfig(rank=lora_rank, alpha=8.0)),
        optim=OptimConfig(
            lr=5e-2 if lora_rank else 1e-3, lr_warmup_steps=4, lr_scheduler="cosine", min_lr_ratio=0.1
        ),
        fsdp=FSDPConfig(param_dtype="float32", expert_parallel_size=ep),
    )
    policy = build_policy(actor, world)
    optim = build_optimizer(policy, actor.optim, TOTAL_STEPS)
    sampler = PromptSampler(10, GLOBAL_BATCH, world.rank, world.world_size, seed=3, shuffle=True)
    out: dict = {"world_size": world.world_size}

    if phase == "save":
        for step in range(1, max(SAVE_STEPS) + 1):
            train_step(policy, optim, processor, step, world)
            sampler.next_batch()
            rng_probe()  # training consumes the RNG streams: the saved state is not the seed's
            if step in SAVE_STEPS:
                trainer_state = {"step": step, "policy_version": step, "sampler": sampler.state_dict()}
                save_checkpoint(
                    run_dir,
                    step,
                    policy=policy,
                    optim=optim,
                    trainer_state=trainer_state,
                    world=world,
                    save_limit=1,
                    model_path=model_dir,
                    config={"worker": {"actor": {"model": {"lora": dataclasses.asdict(actor.model.lora)}}}},
                )
        out["rng_probe"] = rng_probe()
    else:
        path = find_checkpoint(run_dir, "auto")
        assert path is not None, "no checkpoint found"
        out["trainer_state"] = load_checkpoint(path, policy=policy, optim=optim, world=world)
        out["rng_probe"] = rng_probe()
        sampler.load_state_dict(out["trainer_state"]["sampler"])

    out["at_save"] = snapshot(policy, optim)
    out["next_prompts"] = [pair for batch in all_gather_objects(sampler.next_batch()) for pair in batch]
    train_step(policy, optim, processor, max(SAVE_STEPS) + 1, world)
    out["params_after"] = snapshot(policy, optim)["params"]
    if world.rank == 0:
        torch.save(out, out_path)


if __name__ == "__main__":
    run_job(main)
