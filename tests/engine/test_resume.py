"""Checkpoints that never lose work, end to end with the real entry point (2 ranks, torchrun, vLLM, FSDP2).

1. A run with save_freq=1 is killed with SIGKILL on rank 1 in the middle of saving step 2 (after its DCP
   shards are written, before the checkpoint is complete): torchrun brings the other rank down.
2. `trainer.resume=auto` resumes from step 1 (the newest COMPLETE checkpoint; the half-written one is
   ignored) and finishes.
3. Its metrics for the steps after the resume equal those of an uninterrupted run (fp32, same seed).
4. The checkpoint saved on 2 ranks resumes on 1 rank (DCP resharding) and training continues; its changed
   max_steps is reported. Then a resume of its step 4 by path sets step 5's checkpoint aside as an abandoned
   branch (run/lineage.py) and redoes step 5, logged once.
5. Then a new run (`trainer.resume=none`) into that directory, and a resume with another group size, are
   each refused in one line before anything loads, leaving the directory as it was.
"""

import json
import shutil
import subprocess
import sys

from spmd_grpo.config.loader import last_wins
from tests.conftest import REPO, torchrun

# Figures that depend on wall time or memory, not on the computation.
VOLATILE = ("timing_s/", "perf/")


def _args(model, out, name, max_steps, *extra, entry=("-m", "spmd_grpo.train")):
    return [*entry, "configs/smoke.yaml", *last_wins([  # `extra` may change a key set here
        f"worker.actor.model.model_path={model}",
        f"trainer.output_dir={out}", f"trainer.experiment_name={name}", f"trainer.max_steps={max_steps}",
        "trainer.save_freq=1", "trainer.val_before_train=false", "trainer.val_freq=-1",
        "data.rollout_batch_size=4", "worker.rollout.n=4", "worker.actor.global_batch_size=8",
        "worker.actor.micro_batch_size_per_device_for_update=2", *extra,
    ])]  # fmt: skip


def _metrics(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows}


def test_kill_during_save_then_resume_exactly_and_on_fewer_ranks(tiny_untied, tmp_path):
    # 1. SIGKILL rank 1 while it saves step 2.
    killed = ("tests/jobs/train_killed_in_save.py", "1", "2")
    proc = torchrun(_args(tiny_untied, tmp_path, "crash", 4, entry=killed), check=False)
    assert proc.returncode != 0, "the killed run must fail"
    ckpts = tmp_path / "crash" / "checkpoints"
    assert (ckpts / "global_step_1" / "trainer_state.json").exists()
    assert (ckpts / "global_step_2.tmp").exists() and not (ckpts / "global_step_2").exists()
    assert (ckpts / "latest").read_text().strip() == "global_step_1"

    # 2. Resume: from step 1, finishes step 4.
    resumed = torchrun(_args(tiny_untied, tmp_path, "crash", 4, "trainer.resume=auto"))
    log = resumed.stdout + resumed.stderr
    assert "resumed from" in log and "global_step_1 (step 1)" in log
    # The config saved with the checkpoint reads back equal to the same command's: nothing to report.
    assert f"config compared with {ckpts / 'global_step_1' / 'config.yaml'}: 0 changes" in log
    got = _metrics(tmp_path / "crash")
    assert sorted(got) == [1, 2, 3, 4]  # one row per step: the crash died before step 2's row

    # 3. The uninterrupted run gives the same metrics for the steps after the resume.
    torchrun(_args(tiny_untied, tmp_path, "reference", 4))
    want = _metrics(tmp_path / "reference")
    for step in (2, 3, 4):
        assert got[step] == want[step], step

    # 4. Resume the 2-rank checkpoint of step 4 on ONE rank and train one more step.
    shutil.copytree(tmp_path / "crash", tmp_path / "one_rank")
    one = torchrun(_args(tiny_untied, tmp_path, "one_rank", 5, "trainer.resume=auto"), nproc=1)
    assert "global_step_4 (step 4)" in one.stdout + one.stderr
    assert "resume: trainer.max_steps 4 -> 5" in one.stdout + one.stderr
    rows = _metrics(tmp_path / "one_rank")
    assert sorted(rows) == [1, 2, 3, 4, 5]
    # The resumed weights (not the base model's) reached the engine: vLLM and the trainer agree (fp32).
    assert rows[5]["rollout/logprob_diff_max"] < 1e-3
    # ...and the policy resumed the trained weights: a policy at the base weights would have KL 0 to the
    # reference at its first mini-batch (and about half the step-4 KL over the step).
    assert rows[5]["actor/kl_loss"] > 0.5 * rows[4]["actor/kl_loss"] > 0
    saved = json.loads(
        (tmp_path / "one_rank" / "checkpoints" / "global_step_5" / "trainer_state.json").read_text()
    )
    assert saved["world_size"] == 1 and saved["version"] == 5

    # 4b. Back to step 4 by path: step 5's checkpoint is an abandoned branch, moved aside whole with its metrics
    #     row; the redone step 5 is logged once and `latest` names the branch taken.
    run = tmp_path / "one_rank"
    back = torchrun(
        _args(
            tiny_untied, tmp_path, "one_rank", 5, f"trainer.resume={run / 'checkpoints' / 'global_step_4'}"
        ),
        nproc=1,
    )
    assert "global_step_5 of the old branch are set aside" in back.stdout + back.stderr
    assert (run / "abandoned" / "after_step_4" / "global_step_5" / "trainer_state.json").is_file()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]
    assert [json.loads(r)["step"] for r in (run / "metrics.rolledback.jsonl").read_text().splitlines()] == [5]
    assert (run / "checkpoints" / "latest").read_text().strip() == "global_step_5"  # the new step 5

    # 5. Refusals against this real run directory: one line, exit 2, before any process group or model, and
    #    nothing in the directory is written (rank logs included).
    before = _files(run)
    [line] = _refused(_args(tiny_untied, tmp_path, "one_rank", 5, "trainer.resume=none"))
    assert line.startswith(f"config error: {run} already holds a run (config.yaml, metrics.jsonl")
    [line] = _refused(_args(tiny_untied, tmp_path, "one_rank", 6, "worker.rollout.n=8"))
    assert "worker.rollout.n 4 -> 8" in line and "trainer.allow_config_change=[worker.rollout.n]" in line
    assert "max_steps" not in line  # a free change: reported at start-up, never refused
    assert _files(run) == before


def _files(run):
    return {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}


def _refused(args):
    """`python -m spmd_grpo.train ARGS` (refusals come before any process group): its stderr lines."""
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    return proc.stderr.splitlines()
