"""The trainer's passes on CUDA (`make test-gpu`), without vLLM: FSDP2 over nccl, the grouped experts' kernel,
the Gated DeltaNet layers with the kernels transformers picks there (flash-linear-attention when installed),
and shared prompts through flex attention. Skipped here (CPU only). Each test prints the errors it measured
before asserting, so a failing run on a new device still reports how far apart the two sides were.

* One mini-batch's gradient on 1 GPU (fp32 master weights, fp32 compute) does not depend on the micro-batch
  size, token budgets, packing, the FSDP gathering, parameter offload (shards in host memory) or image-feature
  reuse (`tests/jobs/grad_invariance.py
  --device cuda`: the CPU tier's tests/distributed/test_update_invariance.py on the accelerator; <= 1e-5
  relative), for the dense Qwen2.5-VL, whose shared-prompt cases (flex attention against the packed sdpa)
  and the hybrid Qwen3.5-MoE (flash-linear-attention's kernels compute fp32 in TF32) are held to 1e-3.
* Grouped experts (`F.grouped_mm` on CUDA) give transformers' eager experts' logprobs and gradients, fp32
  and bf16; the grouped kernel runs on CUDA in bf16 (the fallback loop is not what is measured).
What has run on a GPU so far: docs/models.md, Devices.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import tiny_model, torchrun
from tests.distributed.test_update_invariance import _max_rel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make test-gpu)")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5_moe"])
def test_the_gradient_does_not_depend_on_micro_batches_on_cuda(family, tmp_path):
    path = tmp_path / "grads.pt"
    job = ["tests/jobs/grad_invariance.py", str(tiny_model(family=family)), str(path), "--micro", "8,1"]
    torchrun([*job, "--budgets", "86", "--variants", "--device", "cuda"], nproc=1)
    g = torch.load(path)
    reference = g["token-mean", 8]
    assert len(reference) > 10 and any(t.abs().max() > 0 for t in reference.values())
    # every case against the 8-sample micro-batch; the frozen tower's two cases (no tower gradient) and the
    # shared-prompt cases (flex attention with the shared row's block mask, dense family) against each other
    same = ("token-mean", "packed", "other_gathering", "offload")
    pairs = {k: (reference, v) for k, v in g.items() if k[0] in same}
    pairs["reuse",] = (g["frozen",], g["reuse",])
    pairs.update({("shared", s): (g["shared", s, False], g["shared", s, True]) for s in ("micro2", "budget45")
                  if ("shared", s, True) in g})  # fmt: skip
    del pairs["token-mean", 8]
    errors = {"/".join(map(str, k)): _max_rel(*v) for k, v in pairs.items()}
    print(family, {k: f"{v:.2e}" for k, v in errors.items()})
    hybrid = family == "qwen3_5_moe"  # flash-linear-attention's chunked kernels compute in tf32
    assert len(errors) >= (6 if hybrid else 8)
    for case, err in errors.items():
        # flex attention against the dense-mask sdpa: two fp32 kernels reducing in different orders (1.0e-4
        # on an H200); how close each is to exact arithmetic is test_gpu_shared_prompt.py's measure
        assert err <= (1e-3 if hybrid or case.startswith("shared") else 1e-5), case


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_grouped_experts_equal_eager_on_cuda(family, dtype):
    from spmd_grpo.models.moe import experts
    from spmd_grpo.models.moe.install import install_moe
    from tests.jobs.common import logprobs, moe_tokens, tiny_moe_model

    eager = tiny_moe_model(family).to("cuda", dtype)
    ours = copy.deepcopy(eager)
    install_moe(ours)
    ids, mask = (t.cuda() for t in moe_tokens())
    weights = torch.randn(ids.shape[0], ids.shape[1] - 1, generator=torch.Generator().manual_seed(2)).cuda()
    for model in (eager, ours):
        (logprobs(model, ids, mask) * weights).sum().backward()
    lp_eager, lp_ours = logprobs(eager, ids, mask).detach(), logprobs(ours, ids, mask).detach()
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    grads = dict(eager.named_parameters())
    errors = {n: rel(p.grad, grads[n].grad) for n, p in ours.named_parameters() if p.grad is not None}
    kernel = experts._grouped_mm_runs("cuda", dtype)
    print(family, dtype, f"grouped_mm runs: {kernel}", f"logprobs {rel(lp_ours, lp_eager):.2e}",
          f"worst gradient {max(errors.values()):.2e} ({max(errors, key=errors.get)})")  # fmt: skip
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel(lp_ours, lp_eager) <= tolerance
    assert len(errors) >= 12 and max(errors.values()) <= tolerance * 10
    if dtype == torch.bfloat16:
        assert kernel  # the grouped kernel, not the per-expert loop, is what users' bf16 runs use
