"""Checkpoints that never lose work, end to end with the real entry point (2 ranks, torchrun, vLLM, FSDP2).

1. A run with save_freq=1 is killed with SIGKILL on rank 1 in the middle of saving step 2 (after its DCP
   shards are written, before the checkpoint is complete): torchrun brings the other rank down.
2. `trainer.resume=auto` resumes from step 1 (the newest COMPLETE checkpoint; the half-written one is
   ignored), now without periodic saves. SIGTERM to the torchrun agent mid-run (what Slurm sends on
   preemption) makes every rank finish its step, save it (this checkpoint comes from the signal) and exit
   with 143, before torchrun's shutdown timeout; the checkpoint is complete and undamaged, so it is what the
   next `resume=auto` picks (step 4 does).
3. Its metrics for the steps after the resume equal those of an uninterrupted run (fp32, same seed).
4. The checkpoint saved on 2 ranks resumes on 1 rank (DCP resharding) and training continues; its changed
   max_steps is reported. Then a resume of the step before by path sets the newer step's checkpoint aside as
   an abandoned branch (run/lineage.py) and redoes that step, logged once.
5. Then a new run (`trainer.resume=none`) into that directory, and a resume with another group size, are
   each refused in one line before anything loads, leaving the directory as it was. A copy of its
   checkpoint with a flipped byte, resumed by path with plain python (a world of one), passes the size
   checks before the process group and is refused by the checksums after it: one line naming the file.

The preemption in a stalled save is tests/engine/test_preemption.py. The measured times are printed (`pytest -s`).
"""

import json
import re
import shutil
import signal
import subprocess
import sys
import time

from spmd_grpo.config.loader import last_wins
from spmd_grpo.run.checkpoint_dirs import find_checkpoint
from tests.conftest import REPO, torchrun, torchrun_command

# Figures that depend on wall time or memory, not on the computation.
VOLATILE = ("timing_s/", "perf/")
MAX_STEPS = 20  # never reached: the runs are stopped by SIGTERM after step 4 (the LR schedule spans 20 steps)
STEP_GRACE_S = 120.0  # a step and its save fit, even on 2 busy cores
SHUTDOWN_TIMEOUT_S = "300"  # torchrun must not SIGKILL the ranks before STEP_GRACE_S ends


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


def _steps(run):
    metrics = run / "metrics.jsonl"
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.exists() else []


def _sigterm_after(args, run, last_step):
    """Launch `args` under torchrun, send the agent SIGTERM once `run` logged step `last_step`, and return
    (its output, the steps logged, seconds from the signal to its exit)."""
    cmd, env = torchrun_command(args, env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": SHUTDOWN_TIMEOUT_S})
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 600
    while last_step not in _steps(run):
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.monotonic() < deadline, f"training did not reach step {last_step}"
        time.sleep(0.5)
    signalled_at = time.time()
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 1, output[-3000:]  # torchrun's own exit code when it is signalled
    return output, _steps(run), time.time() - signalled_at


def test_kill_during_save_then_resume_exactly_and_on_fewer_ranks(tiny_untied, tmp_path):
    # 1. SIGKILL rank 1 while it saves step 2.
    killed = ("tests/jobs/train_killed_in_save.py", "1", "2")
    grace = f"trainer.preempt_grace_s={STEP_GRACE_S}"
    proc = torchrun(_args(tiny_untied, tmp_path, "crash", MAX_STEPS, grace, entry=killed), check=False)
    assert proc.returncode != 0, "the killed run must fail"
    ckpts = tmp_path / "crash" / "checkpoints"
    assert (ckpts / "global_step_1" / "trainer_state.json").exists()
    assert (ckpts / "global_step_2.tmp").exists() and not (ckpts / "global_step_2").exists()
    assert (ckpts / "latest").read_text().strip() == "global_step_1"

    # 2. Resume from step 1 without periodic saves; SIGTERM to the torchrun agent once step 4 is logged.
    resumed = _args(
        tiny_untied, tmp_path, "crash", MAX_STEPS, "trainer.resume=auto", "trainer.save_freq=-1", grace
    )
    log, steps, waited = _sigterm_after(resumed, tmp_path / "crash", 4)
    last = steps[-1]
    print(f"\nSIGTERM to torchrun mid-run: step {last} saved, torchrun exited {waited:.1f} s later")
    assert "resumed from" in log and "global_step_1 (step 1)" in log, log[-3000:]
    # The config saved with the checkpoint reads back equal to the same command's but for the one change.
    assert f"config compared with {ckpts / 'global_step_1' / 'config.yaml'}: 1 changes" in log, log[-3000:]
    assert "resume: trainer.save_freq 1 -> -1" in log
    assert f"stop requested by signal 15: checkpoint of step {last} saved" in log, log[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} exits with code 143" in log, log[-3000:]
    assert "Unable to shutdown process" not in log, log[-3000:]  # torchrun did not need SIGKILL
    assert f"preempt_grace_s={STEP_GRACE_S:.0f} is not below torchrun's shutdown timeout" not in log
    # One row per step (the crash died before step 2's row); the signal's checkpoint is the only new one.
    assert steps == list(range(1, last + 1)) and 4 <= last < MAX_STEPS, steps
    assert sorted(p.name for p in ckpts.glob("global_step_*")) == ["global_step_1", "global_step_2.tmp",
                                                                   f"global_step_{last}"]  # fmt: skip
    assert (ckpts / "latest").read_text().strip() == f"global_step_{last}"
    assert find_checkpoint(tmp_path / "crash", "auto") == ckpts / f"global_step_{last}"  # complete, undamaged
    got = _metrics(tmp_path / "crash")

    # 3. The uninterrupted run gives the same metrics for the steps after the resume.
    reference = _args(tiny_untied, tmp_path, "reference", MAX_STEPS, "trainer.save_freq=-1", grace)
    _sigterm_after(reference, tmp_path / "reference", last)
    want = _metrics(tmp_path / "reference")
    for step in range(2, last + 1):
        assert got[step] == want[step], step

    # 4. Resume the 2-rank checkpoint of the signal on ONE rank (what `resume=auto` picks) and train one more
    #    step.
    # Without the half-written step 2 (no periodic save replaced it here): a resume would name it on stderr
    # before the refusals' one line in 5.
    shutil.copytree(tmp_path / "crash", tmp_path / "one_rank", ignore=shutil.ignore_patterns("*.tmp"))
    nxt = last + 1
    one = torchrun(_args(tiny_untied, tmp_path, "one_rank", nxt, "trainer.resume=auto"), nproc=1)
    assert f"global_step_{last} (step {last})" in one.stdout + one.stderr
    assert f"resume: trainer.max_steps {MAX_STEPS} -> {nxt}" in one.stdout + one.stderr
    rows = _metrics(tmp_path / "one_rank")
    assert sorted(rows) == list(range(1, nxt + 1))
    # The resumed weights (not the base model's) reached the engine: vLLM and the trainer agree (fp32).
    assert rows[nxt]["rollout/logprob_diff_max"] < 1e-3
    # ...and the policy resumed the trained weights: a policy at the base weights would have KL 0 to the
    # reference at its first mini-batch (and about half the previous step's KL over the step).
    assert rows[nxt]["actor/kl_loss"] > 0.5 * rows[last]["actor/kl_loss"] > 0
    saved = json.loads(
        (tmp_path / "one_rank" / "checkpoints" / f"global_step_{nxt}" / "trainer_state.json").read_text()
    )
    assert saved["world_size"] == 1 and saved["version"] == nxt

    # 4b. Back to the signal's step by path: the next step's checkpoint is an abandoned branch, moved aside
    #     whole with its metrics row; the redone step is logged once and `latest` names the branch taken.
    run = tmp_path / "one_rank"
    back = torchrun(
        _args(
            tiny_untied,
            tmp_path,
            "one_rank",
            nxt,
            f"trainer.resume={run / 'checkpoints' / f'global_step_{last}'}",
        ),
        nproc=1,
    )
    assert f"global_step_{nxt} of the old branch are set aside" in back.stdout + back.stderr
    assert (run / "abandoned" / f"after_step_{last}" / f"global_step_{nxt}" / "trainer_state.json").is_file()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, nxt + 1))
    assert [json.loads(r)["step"] for r in (run / "metrics.rolledback.jsonl").read_text().splitlines()] == [
        nxt
    ]
    assert (run / "checkpoints" / "latest").read_text().strip() == f"global_step_{nxt}"  # the new step

    # 5. Refusals against this real run directory: one line, exit 2, before any process group or model, and
    #    nothing in the directory is written (rank logs included).
    before = _files(run)
    [line] = _refused(_args(tiny_untied, tmp_path, "one_rank", nxt, "trainer.resume=none"))
    assert line.startswith(f"config error: {run} already holds a run (config.yaml, metrics.jsonl")
    [line] = _refused(_args(tiny_untied, tmp_path, "one_rank", nxt + 1, "worker.rollout.n=8"))
    assert "worker.rollout.n 4 -> 8" in line and "trainer.allow_config_change=[worker.rollout.n]" in line
    assert "max_steps" not in line  # a free change: reported at start-up, never refused
    assert _files(run) == before
    corrupt = shutil.copytree(
        run / "checkpoints" / f"global_step_{last}", tmp_path / "copy" / "global_step_1"
    )
    shard = next(corrupt.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # the same size: only the checksums see it
    shard.write_bytes(bytes(data))
    lines = _refused(_args(tiny_untied, tmp_path, "from_copy", nxt, f"trainer.resume={corrupt}"))
    [said] = [line for line in lines if "is damaged" in line]  # once
    head = re.escape(f"config error: trainer.resume='{corrupt}' is damaged: {shard}: CRC-32 ")
    assert re.fullmatch(head + r"[0-9a-f]{8}, the manifest says [0-9a-f]{8} \(corrupted\)", said), lines


def _files(run):
    return {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}


def _refused(args):
    """`python -m spmd_grpo.train ARGS` (refusals come before any process group): its stderr lines."""
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    return proc.stderr.splitlines()
