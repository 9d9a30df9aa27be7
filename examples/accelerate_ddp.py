"""An Accelerate training script written the way its users write them, with ftrun snapshots.

Stock accelerate: ``Accelerator()``, ``prepare(model, optimizer, dataloader, scheduler)``,
``accelerator.backward``, ``accelerator.clip_grad_norm_``, a model with dropout, AdamW with a
warm-up + cosine ``LambdaLR``, and a shuffled ``DataLoader`` (accelerate draws each epoch's
order from a generator of its own). A resume skips the trained batches of its first epoch
with ``accelerator.skip_first_batches``, as with ``load_state``. The ftrun part is the
``AcceleratorSnapshotter``: ``restore()`` before the loop, ``save(step)`` after the optimizer
step, ``close()`` at the end.

Run it::

    ftrun --nproc-per-node 3 examples/accelerate_ddp.py
    ftrun --nproc-per-node 3 examples/accelerate_ddp.py --kill-at-step 7 --kill-rank 1
    python examples/accelerate_ddp.py           # one process; snapshots are off

(accelerate reads torchrun's environment, which ftrun's workers get. On a machine without a
GPU it trains on CPU with gloo; ``Accelerator(cpu=True)`` is how accelerate is told so.)

At the end rank 0 prints ``accelerate-ddp: step=N world=W params_xxh3=HEX scheduler_steps=K``;
each rank prints ``accelerate-ddp: rank R trains from step=S epoch=E scheduler_steps=K``
(the script's step and accelerate's counters) before its first step, and a rank that resumed
prints ``accelerate-ddp: rank R resumed from step S (SOURCE)``. ``--kill-at-step S
--kill-rank R`` SIGKILLs rank R once per job right after its optimizer step S (before the
snapshot of S); the marker file lives in ``$FTRUN_JOB_DIR`` (or ``--fault-dir``).
``--hold-at-step S`` (for tests that take a whole host away at a step of their choosing) has
every rank wait after its snapshot of step S, once per job, until the file
``accelerate-ddp-release`` exists there; each writes ``accelerate-ddp-held-rank<R>`` first.
``--fail-mode raise`` raises in that step instead of the SIGKILL; ``--pid-log DIR`` has each
rank append ``step pid time`` to ``DIR/pids-rank<R>.log`` after every step.

``--resilient`` runs the training function ``train`` under ``@ftrun.resilient``, as a user
would decorate theirs: after a fault the surviving ranks run it again in their own processes
(a new ``Accelerator``, ``prepare``, ``restore()``), and only the failed rank gets a new
process::

    ftrun --nproc-per-node 3 examples/accelerate_ddp.py --resilient --kill-at-step 7 --kill-rank 1
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader

# The model, data, schedule and digest of examples/user_ddp.py (this script's directory is
# on sys.path when it runs).
from user_ddp import (
    add_framework_fault_args,
    log_pid,
    make_dataset,
    make_model,
    params_xxh3,
    warmup_cosine,
)

import ftrun
from ftrun.faults import fire_once, kill_once
from ftrun.integrations.accelerate import AcceleratorSnapshotter
from ftrun.testing import wait_for


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=8, help="per process")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=128, help="width of the hidden layers")
    p.add_argument("--save-state-every", type=int, default=0,
                   help="accelerator.save_state(--save-dir) every N steps (default: never)")
    p.add_argument("--save-dir", default="accelerate-state")
    p.add_argument("--every", default=None, help="snapshot every K steps, or auto "
                   "(default: the launcher's --snapshot-every)")
    p.add_argument("--kill-at-step", type=int, default=0)
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--hold-at-step", type=int, default=0)
    p.add_argument("--fault-dir")
    add_framework_fault_args(p)
    args = p.parse_args()
    (train if args.resilient else train.__wrapped__)(args)
    return 0


@ftrun.resilient
def train(args: argparse.Namespace) -> None:
    """The whole run, from the Accelerator to the last step: under ``--resilient`` ftrun runs
    it again in this process after a fault (ftrun.integrations.accelerate resets accelerate's
    process-wide state first, so that ``Accelerator()`` joins the new world)."""
    torch.set_num_threads(1)

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    set_seed(0)
    features, classes = 32, 10
    model = make_model(features, hidden=args.hidden, classes=classes, dropout=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    loader = DataLoader(make_dataset(args.samples, features, classes),
                        batch_size=args.batch_size, shuffle=True)
    # Counted before prepare(): a prepared scheduler steps once per process per step.
    total = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(warmup=max(1, total // 10), total=total))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    every = int(args.every) if args.every and args.every.isdigit() else args.every
    snap = AcceleratorSnapshotter(accelerator, model, every=every)
    step = snap.restore()  # 0 on a fresh start
    rank = accelerator.process_index
    if step:
        print(f"accelerate-ddp: rank {rank} resumed from step {step} ({snap.source})",
              file=sys.stderr, flush=True)
    # accelerate's own counters where training starts (after a resume: the snapshot's): the
    # loader's epoch and the prepared scheduler's steps (one per process per optimizer step).
    print(f"accelerate-ddp: rank {rank} trains from step={step} epoch={loader.iteration} "
          f"scheduler_steps={scheduler.scheduler.last_epoch}", file=sys.stderr, flush=True)

    hold_dir = args.fault_dir or os.environ.get("FTRUN_JOB_DIR", ".")
    release = os.path.join(hold_dir, "accelerate-ddp-release")
    loss_fn = nn.CrossEntropyLoss()
    first_epoch, done = divmod(step, len(loader))
    for epoch in range(first_epoch, args.epochs):
        model.train()
        # The loader skip_first_batches returns for a resumed epoch counts epochs apart from
        # this one: keep this one's count (accelerate's epoch) right for the epochs after.
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, done) if done else loader
        done = 0
        for x, y in batches:
            loss = loss_fn(model(x), y)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step == args.kill_at_step and rank == args.kill_rank:
                fail_once(args, rank, step)
            snap.save(step)
            if args.pid_log:
                log_pid(args.pid_log, rank, step)
            if step == args.hold_at_step and fire_once(
                    os.path.join(hold_dir, f"accelerate-ddp-held-rank{rank}")):
                wait_for(lambda: os.path.exists(release), 600, release)
            if args.save_state_every and step % args.save_state_every == 0:
                accelerator.save_state(args.save_dir)
            ftrun.progress(step)
    ftrun.progress(step, done=True)
    snap.close()

    if accelerator.is_main_process:
        print(f"accelerate-ddp: step={step} world={accelerator.num_processes} "
              f"params_xxh3={params_xxh3(accelerator.unwrap_model(model))} "
              f"scheduler_steps={scheduler.scheduler.last_epoch}", flush=True)
    accelerator.end_training()


def fail_once(args: argparse.Namespace, rank: int, step: int) -> None:
    """The injected fault, once per job (its marker file says it fired): SIGKILL, or an
    exception out of the training step."""
    if args.fail_mode == "kill":
        kill_once("accelerate-ddp", rank, step, args.fault_dir)
        return
    directory = args.fault_dir or os.environ.get("FTRUN_JOB_DIR", ".")
    if fire_once(os.path.join(directory, f"accelerate-ddp-fault-rank{rank}-step{step}")):
        print(f"accelerate-ddp: raising in rank {rank} in step {step}", file=sys.stderr,
              flush=True)
        raise RuntimeError(f"accelerate-ddp: injected fault in rank {rank} at step {step}")


if __name__ == "__main__":
    sys.exit(main())
