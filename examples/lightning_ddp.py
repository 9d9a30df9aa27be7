"""A PyTorch Lightning script written the way Lightning users write them, with ftrun snapshots.

Stock Lightning: a ``LightningModule`` (an MLP with dropout, AdamW, a warm-up + cosine
``LambdaLR`` stepped every optimizer step from ``configure_optimizers``), a
``LightningDataModule`` over a small dataset made in memory (nothing is downloaded), and a
``Trainer`` with ``strategy="ddp"`` on CPU, validation twice an epoch and the default
``ModelCheckpoint``. The ftrun part is one callback: ``FtrunSnapshots()``.

Launched by ftrun (or torchrun), Lightning finds the processes already started (its
``TorchElasticEnvironment``) and checks that ``devices * num_nodes`` is the launcher's world
size, so the script takes both from the launcher's ``LOCAL_WORLD_SIZE`` and ``WORLD_SIZE``.
Under plain ``python`` it uses ``--devices`` (and ``--num-nodes``: one ``python`` per node,
with ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, Lightning's multi-node launch)
and Lightning starts the other processes itself; the callback then says once that snapshots
are off.

Run it::

    ftrun --nproc-per-node 3 examples/lightning_ddp.py
    ftrun --nproc-per-node 3 examples/lightning_ddp.py --kill-at-step 7 --kill-rank 1
    python examples/lightning_ddp.py --devices 3        # no snapshots
    # no snapshots, 2 nodes x 2 ranks: on node 0 and 1 (NODE_RANK=1 there), Lightning's way
    NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 \
        python examples/lightning_ddp.py --devices 2 --num-nodes 2

At the end rank 0 prints ``lightning-ddp: step=N world=W params_xxh3=HEX``; each rank prints
``lightning-ddp: rank R trains from global_step=S epoch=E batch_idx=B`` at the first batch it
trains (Lightning's counters: after a resume, those of the snapshot).
``--kill-at-step S --kill-rank R`` SIGKILLs rank R once per job, at the end of step S (after
its optimizer step; the snapshot of S is under way). The marker file lives in
``$FTRUN_JOB_DIR`` (or ``--fault-dir``). ``--hold-at-step S`` (for tests that take a whole
host away at a step of their choosing) has every rank wait at the end of step S, once per
job, until the file ``lightning-release`` exists there; each writes
``lightning-held-rank<R>`` first. ``--fail-mode raise`` raises at the end of step S instead
of the SIGKILL; ``--pid-log DIR`` has each rank append ``step pid time`` to
``DIR/pids-rank<R>.log`` after every training batch.

``--resilient`` runs the training function ``train`` under ``@ftrun.resilient``, as a user
would decorate theirs: after a fault the surviving ranks run it again in their own processes
(a new ``Trainer`` sets up the new world's process group, ``FtrunSnapshots`` restores the
snapshot), and only the failed rank gets a new process::

    ftrun --nproc-per-node 3 examples/lightning_ddp.py --resilient --kill-at-step 7 --kill-rank 1
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# examples/user_ddp.py (this directory is on sys.path)
from user_ddp import add_framework_fault_args, log_pid, params_xxh3

import ftrun
from ftrun.faults import fire_once
from ftrun.integrations.lightning import FtrunSnapshots
from ftrun.testing import wait_for


class Blobs(L.LightningDataModule):
    """A small classification data set, made from a fixed seed."""

    def __init__(self, samples: int = 384, features: int = 16, classes: int = 4,
                 batch_size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        gen = torch.Generator().manual_seed(1234)
        n, f, c = self.hparams.samples, self.hparams.features, self.hparams.classes
        x = torch.randn(n, f, generator=gen)
        w = torch.randn(f, c, generator=gen)
        y = (x @ w + 0.1 * torch.randn(n, c, generator=gen)).argmax(dim=1)
        split = n * 3 // 4
        self.train_set = TensorDataset(x[:split], y[:split])
        self.val_set = TensorDataset(x[split:], y[split:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)


class Classifier(L.LightningModule):
    def __init__(self, features: int = 16, hidden: int = 64, classes: int = 4,
                 dropout: float = 0.1, lr: float = 3e-3, warmup: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(features, hidden), nn.GELU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.GELU(), nn.Dropout(dropout),
            nn.Linear(hidden, classes))
        self.loss = nn.CrossEntropyLoss()
        self.kill: tuple[int, int, str] | None = None  # (step, rank, marker directory)
        self.hold: tuple[int, str] | None = None  # (step, marker directory)
        self.raise_ = False  # the fault raises instead of SIGKILL
        self.pid_log: str | None = None  # directory of the pids-rank<R>.log files
        self.started = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", self.loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        total = self.trainer.estimated_stepping_batches
        warmup = self.hparams.warmup

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1.0 + math.cos(math.pi * min((step - warmup) / max(1, total - warmup), 1)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        # Lightning's own counters where this process starts training (after a resume: the
        # snapshot's step, epoch and batch of the epoch, not 0).
        if not self.started:
            self.started = True
            print(f"lightning-ddp: rank {self.global_rank} trains from "
                  f"global_step={self.global_step} epoch={self.current_epoch} "
                  f"batch_idx={batch_idx}", file=sys.stderr, flush=True)

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        if self.pid_log is not None:
            log_pid(self.pid_log, self.global_rank, self.global_step)
        if self.hold is not None and self.global_step == self.hold[0]:
            release = os.path.join(self.hold[1], "lightning-release")
            if fire_once(os.path.join(self.hold[1], f"lightning-held-rank{self.global_rank}")):
                wait_for(lambda: os.path.exists(release), 600, release)
        if self.kill is None:
            return
        step, rank, directory = self.kill
        if self.global_step != step or self.global_rank != rank:
            return
        if not fire_once(os.path.join(directory, f"lightning-fault-rank{rank}-step{step}")):
            return  # fired already in this job (the marker holds its time)
        if self.raise_:
            print(f"lightning-ddp: raising in rank {rank} in step {step}", file=sys.stderr,
                  flush=True)
            raise RuntimeError(f"lightning-ddp: injected fault in rank {rank} at step {step}")
        print(f"lightning-ddp: killing rank {rank} in step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2, help="without a launcher")
    p.add_argument("--num-nodes", type=int, default=1, help="without a launcher")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--samples", type=int, default=384)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--hidden", type=int, default=64, help="width of the hidden layers")
    p.add_argument("--ckpt-every", type=int, default=0, help="ModelCheckpoint every N training "
                   "steps (default: Lightning's default ModelCheckpoint)")
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--every", default=None, help="snapshot interval: steps or 'auto'")
    p.add_argument("--root-dir", default=None, help="logs and checkpoints (default: cwd)")
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
    """The whole run, from the model to ``trainer.fit()``: under ``--resilient`` ftrun runs it
    again in this process after a fault, and a new ``Trainer`` sets up the new world's process
    group (``FtrunSnapshots`` restores the snapshot into it)."""
    torch.set_num_threads(1)
    L.seed_everything(0)
    # Under a launcher (ftrun, torchrun) the processes exist already: match its world. (So
    # do the processes Lightning starts itself, which get WORLD_SIZE from it.)
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", args.devices))
    num_nodes = int(os.environ.get("WORLD_SIZE", devices * args.num_nodes)) // devices

    model = Classifier(hidden=args.hidden)
    if args.kill_at_step:
        directory = args.fault_dir or os.environ.get("FTRUN_JOB_DIR") or "."
        model.kill = (args.kill_at_step, args.kill_rank, directory)
        model.raise_ = args.fail_mode == "raise"
    model.pid_log = args.pid_log
    if args.hold_at_step:
        model.hold = (args.hold_at_step, args.fault_dir or os.environ.get("FTRUN_JOB_DIR") or ".")
    every = int(args.every) if args.every and args.every.isdigit() else args.every
    callbacks = [FtrunSnapshots(every=every)]
    if args.ckpt_every:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(every_n_train_steps=args.ckpt_every))
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=args.strategy,
        max_epochs=args.epochs, max_steps=args.max_steps, default_root_dir=args.root_dir,
        callbacks=callbacks,
        val_check_interval=0.5, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=Blobs(samples=args.samples, batch_size=args.batch_size))

    if trainer.is_global_zero:
        print(f"lightning-ddp: step={trainer.global_step} world={trainer.world_size} "
              f"params_xxh3={params_xxh3(model)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
