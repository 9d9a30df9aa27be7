"""A DDP training script written the way PyTorch users write them, with ftrun snapshots.

Everything here is stock PyTorch with default arguments: ``DistributedDataParallel(model)``,
a ``DataLoader`` over a ``DistributedSampler`` (shuffled, ``set_epoch`` every epoch), dropout,
AdamW, a ``LambdaLR`` warm-up + cosine schedule and gradient clipping. The ftrun part is the
``Snapshotter`` (model, optimizer and the scheduler as a stateful object), ``restore()`` before
the loop and ``save()`` after ``optimizer.step()``, and ``@ftrun.resilient`` on the training
function: when a rank of the job fails, the surviving processes leave it, take the new world
from their launcher and run it again (process group, model, restore), keeping the process.

Two ways to resume mid-epoch, chosen with ``--loader``:

- ``sampler`` (default): a plain ``DataLoader``; the script skips the batches of the current
  epoch that were already trained, as users do with ``itertools.islice``.
- ``stateful``: ``torchdata``'s ``StatefulDataLoader`` handed to the Snapshotter, which saves
  and restores its position; the script counts nothing.

Run it::

    ftrun --nproc-per-node 4 examples/user_ddp.py --epochs 3
    ftrun --nproc-per-node 4 examples/user_ddp.py --loader stateful --kill-at-step 7 --kill-rank 2

At the end rank 0 prints ``user-ddp: step=N params_xxh3=HEX``. ``--kill-at-step S --kill-rank
R`` SIGKILLs rank R in step S once per job, after its optimizer step and before its snapshot
(the snapshot of step S-1 is then staged on every rank, so the job resumes from S-1);
``--fault-at start|forward|backward|optimizer`` moves it elsewhere in the step (``start``: after
the previous ``save()``, before the batch is fetched, where data-loading errors land);
``--fail-mode raise|stop|hang`` raises, freezes it (SIGSTOP) or hangs it in Python code outside any
collective (alive, never progressing) instead, and ``--fail-mode bitflip`` flips one
bit of one of its parameters in place (silent data corruption: the rank goes on, its replica
now differs from the others'; ftrun's coordinator finds it at the snapshot of that step);
``--fail-mode copy`` SIGKILLs it from its snapshot copy thread while the snapshot of step S is
half written (the job resumes from S-1). ``--stuck-rank`` and
``--kill-after-restore-rank`` add a rank that never leaves the function and a second fault
while the job re-forms. Each fault fires once per job: its marker file (holding the fault's
time) lives in ``$FTRUN_JOB_DIR`` (or ``--fault-dir``).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import xxhash
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ftrun
from ftrun.faults import fire_once, kill_in_snapshot_copy


def make_dataset(n: int, features: int, classes: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(n, features, generator=gen)
    w = torch.randn(features, classes, generator=gen)
    y = (x @ w + 0.1 * torch.randn(n, classes, generator=gen)).argmax(dim=1)
    return TensorDataset(x, y)


def make_model(features: int, hidden: int, classes: int, dropout: float) -> nn.Module:
    return nn.Sequential(
        nn.Linear(features, hidden), nn.GELU(), nn.Dropout(dropout),
        nn.Linear(hidden, hidden), nn.GELU(), nn.Dropout(dropout),
        nn.Linear(hidden, classes),
    )


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return factor


def params_xxh3(model: nn.Module) -> str:
    h = xxhash.xxh3_64()
    for _, p in model.named_parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def add_framework_fault_args(p: argparse.ArgumentParser) -> None:
    """The flags the framework examples (lightning_ddp.py, hf_trainer.py, accelerate_ddp.py)
    share for in-place restart: how their injected fault fails, a log of the process that
    trained each step, and running the training function under ``@ftrun.resilient``."""
    p.add_argument("--fail-mode", choices=("kill", "raise"), default="kill",
                   help="SIGKILL rank --kill-rank in step --kill-at-step, or raise there")
    p.add_argument("--pid-log", metavar="DIR",
                   help="each rank appends 'step pid time' after every step to "
                        "DIR/pids-rank<R>.log")
    p.add_argument("--resilient", action="store_true",
                   help="run the training function under @ftrun.resilient: after a fault the "
                        "surviving ranks run it again in their own processes")


def log_pid(directory: str, rank: int, step: int) -> None:
    """Append ``step pid time`` to ``directory/pids-rank<rank>.log`` (--pid-log)."""
    with open(os.path.join(directory, f"pids-rank{rank}.log"), "a", encoding="utf-8") as f:
        f.write(f"{step} {os.getpid()} {time.time():.6f}\n")


def once(args: argparse.Namespace, name: str) -> bool:
    """True the first time in the job that fault ``name`` fires (a marker file)."""
    directory = args.fault_dir or os.environ.get("FTRUN_JOB_DIR") or "."
    return fire_once(os.path.join(directory, name))


FAULT_POINTS = ("start", "forward", "backward", "optimizer", "after-step")


def maybe_kill(args: argparse.Namespace, rank: int, step: int, model: nn.Module,
               point: str = "after-step") -> None:
    if step != args.kill_at_step or rank != args.kill_rank or point != args.fault_at:
        return
    if args.fail_mode == "copy":
        return  # armed in train(): the snapshot's copy thread fires it
    if not once(args, f"user-ddp-fault-rank{rank}-step{step}"):
        return  # fired already in this job (the marker holds its time: benchmarks read it)
    if args.fail_mode == "raise":
        print(f"user-ddp: raising in rank {rank} in step {step}", file=sys.stderr, flush=True)
        raise RuntimeError(f"user-ddp: injected fault in rank {rank} at step {step}")
    if args.fail_mode == "bitflip":
        flip_bit(model, rank, step)
        return
    if args.fail_mode == "stop":
        print(f"user-ddp: stopping rank {rank} in step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if args.fail_mode == "hang":
        print(f"user-ddp: rank {rank} hangs in step {step}", file=sys.stderr, flush=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:  # alive, in Python, outside any collective
            time.sleep(0.05)
        return
    print(f"user-ddp: killing rank {rank} in step {step}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def flip_bit(model: nn.Module, rank: int, step: int) -> None:
    """Flip bit 20 (a float32 mantissa bit) of the first element of the first parameter,
    in place: what a faulty GPU or a bad memory cell does to one replica."""
    name, p = next(iter(model.named_parameters()))
    with torch.no_grad():
        bits = p.detach().view(-1)[:1].view(torch.int32)
        bits ^= 1 << 20
    print(f"user-ddp: flipped a bit of {name} in rank {rank} in step {step}", file=sys.stderr,
          flush=True)


def maybe_get_stuck(args: argparse.Namespace, rank: int, step: int) -> None:
    """--stuck-rank: in step --kill-at-step, this rank enters a C call that never returns
    and that no signal interrupts (a driver call, a C extension's loop): it cannot leave
    the training function, whatever its launcher asks."""
    if rank != args.stuck_rank or step != args.kill_at_step:
        return
    if not once(args, f"user-ddp-stuck-rank{rank}-step{step}"):
        return
    print(f"user-ddp: rank {rank} stuck in a C call in step {step}", file=sys.stderr, flush=True)
    import ctypes

    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    ctypes.CDLL(None).sleep(600)


def maybe_fail_after_restore(args: argparse.Namespace, rank: int, step: int) -> None:
    """--kill-after-restore-rank: once, in a restarted world, SIGKILL this rank right after
    its restore (a second fault while the job re-forms)."""
    if rank != args.kill_after_restore_rank or not step:
        return
    if once(args, f"user-ddp-after-restore-rank{rank}"):
        print(f"user-ddp: killing rank {rank} after its restore", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--loader", choices=("sampler", "stateful"), default="sampler")
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--kill-at-step", type=int, default=0)
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--fail-mode", choices=("kill", "raise", "stop", "hang", "bitflip", "copy"),
                   default="kill",
                   help="SIGKILL, raise an exception, SIGSTOP (frozen) the rank, hang it in "
                        "Python outside collectives, flip a bit of one of its parameters, or "
                        "SIGKILL it while its snapshot of the step is half copied")
    p.add_argument("--fault-at", choices=FAULT_POINTS, default="after-step",
                   help="where in step --kill-at-step the fault lands: start (after the "
                        "previous save(), before the batch is fetched: a data-loading error), "
                        "forward, backward (after the loss, before backward()), optimizer "
                        "(before optimizer.step()) or after-step (after the optimizer step, "
                        "before save(): the default)")
    p.add_argument("--stuck-rank", type=int, default=-1,
                   help="in step --kill-at-step, this rank blocks in a C call for 600 s")
    p.add_argument("--kill-after-restore-rank", type=int, default=-1,
                   help="once, SIGKILL this rank right after a restore that found a step")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds to sleep after each step (tests that act mid-run)")
    p.add_argument("--pg-timeout", type=float,
                   help="init_process_group timeout in seconds (default: torch's)")
    p.add_argument("--fault-dir")
    p.add_argument("--pid-log")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: one GPU per rank (LOCAL_RANK), NCCL")
    p.add_argument("--plain", action="store_true",
                   help="call the training function without @ftrun.resilient (the Snapshotter "
                        "alone: a fault restarts every rank as a new process)")
    args = p.parse_args()
    (train.__wrapped__ if args.plain else train)(args)
    return 0


@ftrun.resilient
def train(args: argparse.Namespace) -> None:
    """The whole run: under ftrun it runs again, in the same process, after a fault."""
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        torch.use_deterministic_algorithms(True)  # and CUBLAS_WORKSPACE_CONFIG, see main
    timeout = None if args.pg_timeout is None else datetime.timedelta(seconds=args.pg_timeout)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if args.fail_mode == "copy" and rank == args.kill_rank and args.kill_at_step:
        kill_in_snapshot_copy(rank, args.kill_at_step,
                              args.fault_dir or os.environ.get("FTRUN_JOB_DIR") or ".")

    dataset = make_dataset(args.samples, args.features, args.classes)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    if args.loader == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader: DataLoader = StatefulDataLoader(dataset, batch_size=args.batch_size,
                                                sampler=sampler, num_workers=args.num_workers)
    else:
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                            num_workers=args.num_workers)
    steps_per_epoch = len(loader)
    total_steps = args.epochs * steps_per_epoch

    model = make_model(args.features, args.hidden, args.classes, args.dropout).to(device)
    model = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(warmup=max(1, total_steps // 10), total=total_steps))

    state = {"scheduler": scheduler}
    if args.loader == "stateful":
        state["loader"] = loader
    snap = ftrun.Snapshotter(model, optimizer, state=state)
    step = snap.restore()  # 0 on a fresh start
    if step:
        print(f"user-ddp: rank {rank} resumed from step {step}", file=sys.stderr, flush=True)
    maybe_fail_after_restore(args, rank, step)

    loss_fn = nn.CrossEntropyLoss()
    pid_log = None
    if args.pid_log:
        pid_log = open(os.path.join(args.pid_log, f"pids-rank{rank}.log"), "a")  # noqa: SIM115
    for epoch in range(step // steps_per_epoch, args.epochs):
        sampler.set_epoch(epoch)
        batches = iter(loader)
        if args.loader == "sampler":
            # A plain DataLoader starts the epoch over: skip what was trained already.
            batches = itertools.islice(batches, step - epoch * steps_per_epoch, None)
        model.train()
        while True:
            maybe_kill(args, rank, step + 1, model.module, "start")  # the data pipeline's turn
            batch = next(batches, None)
            if batch is None:
                break
            x, y = batch
            step += 1
            x, y = x.to(device), y.to(device)
            maybe_kill(args, rank, step, model.module, "forward")
            loss = loss_fn(model(x), y)
            optimizer.zero_grad()
            maybe_kill(args, rank, step, model.module, "backward")
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            maybe_kill(args, rank, step, model.module, "optimizer")
            optimizer.step()
            scheduler.step()
            maybe_kill(args, rank, step, model.module)
            maybe_get_stuck(args, rank, step)
            snap.save(step)
            ftrun.progress(step)
            if pid_log is not None:
                pid_log.write(f"{step} {os.getpid()} {time.time():.6f}\n")
                pid_log.flush()
            if args.step_sleep:
                time.sleep(args.step_sleep)
    ftrun.progress(step, done=True)
    if pid_log is not None:
        pid_log.close()
    snap.close()

    if rank == 0:
        print(f"user-ddp: step={step} world={world} params_xxh3={params_xxh3(model)}", flush=True)
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
