"""GPU tier job: the default process group that `init_distributed("cuda")` creates reduces host tensors (the
bookkeeping collectives: counts, metric sums, timers) and device tensors (FSDP, the weight push). Prints one
JSON line; exits non-zero when either collective fails."""

import json

import torch
import torch.distributed as dist

from spmd_grpo import parallel as D

world = D.init_distributed("cuda")
host = torch.ones(2)
dist.all_reduce(host)
device = torch.ones(2, device=world.device)
dist.all_reduce(device)
print(json.dumps({"backend": str(dist.get_backend()), "host": host.tolist(), "device": device.tolist()}))
dist.destroy_process_group()
