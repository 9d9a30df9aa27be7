"""Load a step ftrun persisted with torch's own tools, nothing of ftrun: the tests' check that
a persisted step is a standard DCP checkpoint.

Usage: dcp_loader.py STEP_DIR, as one process or under ``torch.distributed.run`` (then the
model is sharded with FSDP2 over the ranks). It builds tests/fsdp_worker.py's model and AdamW
afresh, loads ``{"model": ..., "optim": ...}`` with ``dcp.load`` and applies it with
``set_state_dict``, and prints ``loaded: hash=H optim=O world=W lr=LR`` (rank 0; H and O as
fsdp_worker.py computes them). As one process it also loads the plain pattern,
``dcp.load({"model": model.state_dict()})`` into a plain model, and prints
``plain: hash=H step=S`` (S: the step number, read from the checkpoint's ``ftrun.step``).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsdp_worker import _full, _xxh3
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard


def fresh_model() -> torch.nn.Module:
    torch.manual_seed(1)  # other values than the checkpoint's: the load must replace them
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def main() -> None:
    step_dir = sys.argv[1]
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    model = fresh_model()
    if distributed:
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=step_dir)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    weights, optim = _full(model, optimizer)
    world = dist.get_world_size() if distributed else 1
    if not distributed or dist.get_rank() == 0:
        lr = optimizer.param_groups[0]["lr"]
        print(f"loaded: hash={weights} optim={optim} world={world} lr={lr}", flush=True)
    if distributed:
        # Both ranks done, then out without tearing gloo down: its teardown at exit aborted
        # the process ("terminate called without an active exception", SIGABRT) twice in CI
        # on a loaded host, once after destroy_process_group behind a barrier. Nothing is
        # left to write: the output is flushed.
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    plain = fresh_model()
    state = {"model": plain.state_dict(), "ftrun": {"step": -1}}
    dcp.load(state, checkpoint_id=step_dir)
    plain.load_state_dict(state["model"])
    print(f"plain: hash={_xxh3(plain.state_dict())} step={state['ftrun']['step']}", flush=True)


if __name__ == "__main__":
    main()
