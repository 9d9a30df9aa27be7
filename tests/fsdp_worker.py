"""A tiny FSDP2 (fully_shard) job for the snapshot tests: DTensor shards in and out.

Usage: fsdp_worker.py STEPS [FAIL_AT_STEP]. Rank 1 exits in FAIL_AT_STEP once per job (a
marker in $FTRUN_JOB_DIR). Rank 0 prints ``fsdp: start=S hash=H optim=O world=W``: H over
the full (unsharded) weights, O over the full optimizer state, whatever the world size.
"""

from __future__ import annotations

import gc
import os
import sys

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard

import ftrun


def _xxh3(tensors: dict[str, torch.Tensor]) -> str:
    h = xxhash.xxh3_64()
    for key in sorted(tensors):
        h.update(key.encode())
        h.update(tensors[key].numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    steps = int(sys.argv[1])
    fail_at = int(sys.argv[2]) if len(sys.argv) > 2 else -1
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    snap = ftrun.Snapshotter(model, optimizer)
    start = snap.restore()
    marker = os.path.join(os.environ["FTRUN_JOB_DIR"], "fsdp-fault-fired")
    per_rank = 8 // world
    for step in range(start + 1, steps + 1):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        loss = model(x[rank * per_rank:(rank + 1) * per_rank]).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        if step == fail_at and rank == 1 and not os.path.exists(marker):
            open(marker, "w").close()  # noqa: SIM115
            os._exit(13)
        optimizer.step()
        snap.save(step)
    snap.close()
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    optim = get_optimizer_state_dict(model, optimizer)["state"]
    full_optim = {f"{fqn}/{k}": v.full_tensor() if hasattr(v, "full_tensor") else v
                  for fqn, state in optim.items() for k, v in state.items()}
    if rank == 0:
        print(f"fsdp: start={start} hash={_xxh3(full)} optim={_xxh3(full_optim)} "
              f"world={world}", flush=True)
    # As examples/train.py does: free everything that holds the process group (FSDP's
    # DTensors, the snapshotter's hooks) before the group is torn down, or gloo's teardown
    # can fail at exit.
    del model, optimizer, snap, full, optim, full_optim
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
