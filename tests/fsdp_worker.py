"""A tiny FSDP2 (fully_shard) job for the snapshot tests: DTensor shards in and out.

Usage: fsdp_worker.py STEPS [FAIL_AT_STEP] [--ddp] [--trace] [--sleep S]. Rank 1 exits in
FAIL_AT_STEP once per job (a marker in $FTRUN_JOB_DIR). ``--resilient``: the training runs
under ``@ftrun.resilient`` (the survivors restart in place). Rank 0 prints
``fsdp: start=S hash=H optim=O world=W``: H over the full (unsharded) weights, O over the full
optimizer state, whatever the world size. ``--ddp``: the same model under DDP instead of
FSDP2. ``--trace``: rank 0 also prints ``state: step=S hash=H optim=O world=W`` after every
step, and ``restored: ...`` after the restore (the state it resumes from), so a restore onto another world size
can be checked against the state the old ranks had at that step. ``--sleep``: seconds per step.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import ftrun


def _xxh3(tensors: dict[str, torch.Tensor]) -> str:
    h = xxhash.xxh3_64()
    for key in sorted(tensors):
        h.update(key.encode())
        h.update(tensors[key].numpy().tobytes())
    return h.hexdigest()


def _full(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[str, str]:
    """Hashes of the full weights and the full optimizer state (collective under FSDP2)."""
    full = {k.removeprefix("module."): v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in model.state_dict().items()}
    optim = get_optimizer_state_dict(model, optimizer)["state"]
    full_optim = {f"{fqn}/{k}": v.full_tensor() if hasattr(v, "full_tensor") else v
                  for fqn, state in optim.items() for k, v in state.items()}
    return _xxh3(full), _xxh3(full_optim)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("steps", type=int)
    p.add_argument("fail_at", type=int, nargs="?", default=-1)
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--trace", action="store_true")
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--resilient", action="store_true",
                   help="run the training under @ftrun.resilient (in-process restart)")
    args = p.parse_args()
    (ftrun.resilient(train) if args.resilient else train)(args)


def train(args: argparse.Namespace) -> None:
    steps, fail_at = args.steps, args.fail_at
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                                 torch.nn.Linear(32, 8))
    if args.ddp:
        model = DistributedDataParallel(model)
    else:
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    snap = ftrun.Snapshotter(model, optimizer)
    start = snap.restore()

    def trace(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              what: str = "state") -> None:
        if args.trace:
            weights, optim = _full(model, optimizer)
            if rank == 0:
                print(f"{what}: step={step} hash={weights} optim={optim} world={world}",
                      flush=True)

    if start:
        trace(start, model, optimizer, "restored")
        if rank == 0:
            print(f"source: {snap.source}", flush=True)
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
        trace(step, model, optimizer)
        time.sleep(args.sleep)
    snap.close()
    weights, optim = _full(model, optimizer)
    if rank == 0:
        print(f"fsdp: start={start} hash={weights} optim={optim} world={world}", flush=True)
    # As examples/train.py does: free everything that holds the process group (FSDP's
    # DTensors, the snapshotter's hooks) before the group is torn down, or gloo's teardown
    # can fail at exit.
    del model, optimizer, snap
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
