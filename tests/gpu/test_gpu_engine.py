"""The accelerator tier (`make test-gpu`): what only a CUDA device can show. Skipped here (CPU only).

* parity in bf16: after an update and a push, vLLM's per-token logprobs match the trainer's to bf16
  rounding, and are much closer to the new weights than to the old ones (the staleness control);
* sleep / wake: sleep level 2 gives back what vLLM reserved, and after wake + push the engine samples the
  same greedy tokens as before sleeping;
* weight sync bandwidth: one push of every weight, bytes / seconds, printed;
* the process group reduces host tensors (over gloo) as well as device tensors (over nccl);
* MoE routing replay from vLLM (`routing_replay=rollout`): vLLM returns every sample's routes and the trainer
  replays them (needs the tiny `qwen3_vl_moe` checkpoint; skipped where that family is not registered).
The vLLM tests have not run on a GPU (thresholds are first estimates); what has: docs/models.md, Devices.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import torchrun

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make test-gpu)")


def test_parity_in_bf16_after_update(tiny_untied, tmp_path):
    job = ["tests/jobs/engine_parity.py", str(tiny_untied), str(tmp_path / "out.json")]
    torchrun([*job, "--device", "cuda", "--dtype", "bfloat16"], nproc=1)
    r = json.loads((tmp_path / "out.rank0.json").read_text())
    print({k: v for k, v in r.items() if k != "group_outputs"})
    assert r["new_diff_mean"] < 0.05 and r["new_diff_mean"] * 5 < r["old_diff_mean"], r
    assert r["nosync_new_diff_max"] > r["nosync_old_diff_max"], r


def test_the_process_group_reduces_host_and_device_tensors():
    """An nccl-only group refuses CPU tensors; the trainer's bookkeeping collectives reduce CPU tensors. One
    rank per GPU (nccl refuses two ranks on one device); each adds rank + 1."""
    world = torch.cuda.device_count()
    out = torchrun(["tests/jobs/gpu_backends.py"], nproc=world).stdout
    print(out)
    total = float(world * (world + 1) // 2)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == world, out
    for r in lines:
        assert r["backend"] == "cpu:gloo,cuda:nccl" and r["world"] == world, r
        assert r["host"] == [total, total] and r["device"] == [total, total], r


def test_sleep_frees_memory_and_wake_restores_the_policy(tiny_untied, tmp_path):
    torchrun(["tests/jobs/gpu_sleep.py", str(tiny_untied), str(tmp_path / "sleep.json")], nproc=1)
    r = json.loads((tmp_path / "sleep.json").read_text())
    print(r)
    assert r["freed_gb"] > 0.8 * r["reserved_gb"], r
    assert r["tokens_after_wake"] == r["tokens_before_sleep"], r
    assert r["push_gb_per_s"] > 0.5, r  # the weight-sync bandwidth, printed above


def test_routing_replay_from_vllm(tmp_path):
    """worker.actor.moe.routing_replay=rollout on a tiny Qwen3-VL-MoE: vLLM returns every sample's routes
    ([tokens, layers, top-k], the last token possibly missing), the trainer disagrees with a small fraction
    of them, and replaying them brings the trainer's logprobs at least as close to vLLM's as its own
    routing. Needs the tiny `qwen3_vl_moe` checkpoint (hub expert layout) of the MoE families change."""
    from spmd_grpo.models.families import FAMILIES
    from tests.conftest import tiny_model

    if "qwen3_vl_moe" not in FAMILIES:
        pytest.skip("the qwen3_vl_moe family is not registered in this tree yet")
    model = tiny_model(family="qwen3_vl_moe")
    torchrun(["tests/jobs/routed_experts.py", str(model), str(tmp_path / "routes.json")], nproc=1)
    r = json.loads((tmp_path / "routes.json").read_text())
    print(r)
    for shape, length in r["route_shapes"]:
        assert shape is not None and shape[1:] == [r["num_layers"], r["top_k"]], r
        assert length - 1 <= shape[0] <= length, r
    assert r["route_diff_rollout"] < 0.3, r
    assert r["diff_replay_max"] <= r["diff_own_max"] + 1e-3, r
