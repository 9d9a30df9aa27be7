"""Reference workload for ftrun: a small GPT-style language model trained with DDP.

Run it under ``torchrun``, under ``ftrun`` (same environment: RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) or as a plain ``python examples/train.py`` (one process, no process
group, no DDP)::

    torchrun --standalone --nproc-per-node 2 examples/train.py --steps 8
    ftrun --nproc-per-node 2 examples/train.py --steps 8 --fail-at-step 3 --fail-rank 1

The run is deterministic: with the same flags and world size the final parameters are
bit-identical, also when the job crashed and restarted from step 0. The model is initialised
from ``--seed`` on every rank, and sample ``i`` of the synthetic dataset (``--samples``
sequences) depends on ``(seed, i)`` only.

Data position (docs/snapshots.md, "Data position across a change of world size"): the
samples are read in epochs, each a permutation of the dataset seeded with ``seed + epoch``
(``ftrun.ResumableDistributedSampler``), one epoch after the other. Step ``s`` trains on the
next ``--batch`` positions of that sequence; rank ``r`` of ``W`` takes positions ``r``,
``r + W``, ... of them. Every snapshot carries the position (epoch, samples consumed in it),
which is the same on every rank, so a job that resumes on another number of ranks splits the
rest the same way: no sample is skipped or repeated. ``--batch`` need not divide by the world
size; each rank's loss is its sum over its samples divided by the global batch, so the
gradient is the global batch's mean whatever the split. ``--sample-log FILE`` records the
indices every rank trained on.

``--fsdp`` shards the model with FSDP2 (``fully_shard`` on every block, then on the whole
model) instead of wrapping it in DDP; ``params_xxh3`` is then the digest of the full
(gathered) parameters, comparable across world sizes and with a DDP run.

Steps are counted from 1: step ``s`` is the ``s``-th optimizer step, ``ftrun.progress(s)`` is
called once it completed, and ``--fail-at-step S`` fires inside step ``S`` (after backward,
before ``optimizer.step()``). At the end rank 0 prints one line to stdout::

    ftrun-example: step=N loss=L params_xxh3=HEX

where ``L`` is the mean loss of the last step over the global batch and ``HEX`` the xxh3-64
digest of the raw float32 bytes of every parameter in ``named_parameters()`` order.
``--result FILE`` also writes that (plus world size and restart count) as JSON.

Under ftrun the job restarts in place (``@ftrun.resilient`` on ``run``): after a fault the
surviving ranks run ``run`` again in their own processes, in the new world; only a dead rank
gets a new process. The script snapshots its state with ``ftrun.Snapshotter``, by default
with ``--snapshot-every auto``: as often as keeps the measured slowdown at or below 3% (and
at most 60 s apart, fewer when the job's failure rate makes more not worth it). Tests
that count on a snapshot of every step pass ``--snapshot-every 1``.

Fault injection fires once per job: the failing rank first creates a marker file
``fault-fired-rank{R}-step{S}`` (O_CREAT|O_EXCL) in ``--fault-dir``, else ``$FTRUN_JOB_DIR``,
else ``$TMPDIR/ftrun-example-$TORCHELASTIC_RUN_ID``; a restarted rank finds the marker and
does not fire again. ``--fault-schedule FILE`` plans several faults in one job (a JSON list of
``{"step": S, "rank": R, "mode": M}``), each firing once by the same rule.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import xxhash
from torch import nn
from torch.nn.parallel import DistributedDataParallel

try:
    import ftrun

    _progress: Callable[..., None] = ftrun.progress
    _Snapshotter: Any = ftrun.Snapshotter
    _Sampler: Any = ftrun.ResumableDistributedSampler
    _monitor_collectives: Callable[[], Any] = ftrun.monitor_collectives
    _resilient: Callable[[Any], Any] = ftrun.resilient
except Exception:  # ftrun not installed (or broken): no progress reports, no snapshots.

    def _progress(step: int, done: bool = False) -> None:
        del step, done

    _Snapshotter = None
    _Sampler = None

    def _monitor_collectives() -> Any:
        return None

    def _resilient(fn: Any) -> Any:
        return fn


PREFIX = "ftrun-example"
FAIL_MODES = ("exit", "kill", "hang", "stop", "corrupt", "raise", "collective-hang")
EXIT_CODE_FAULT = 13


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on top of ``scaled_dot_product_attention``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        shape = (b, t, self.heads, c // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: attention and MLP, each with a residual connection."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + learned positional embeddings, transformer blocks, final LayerNorm, linear head."""

    def __init__(self, vocab: int, seq_len: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def samples(
    seed: int, indices: list[int], seq_len: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples ``indices`` of the synthetic dataset: inputs and next-token targets,
    ``(len(indices), seq_len)``.

    Sample ``i`` depends on ``(seed, i)`` only. Its sequence starts at a random token and
    continues with ``next = (token * 3 + 1) % vocab``, replaced by a random token with
    probability 0.1.
    """
    n = len(indices)
    seq = torch.empty(n, seq_len + 1, dtype=torch.long)
    noise = torch.empty(n, seq_len, dtype=torch.bool)
    random_tokens = torch.empty(n, seq_len, dtype=torch.long)
    for row, index in enumerate(indices):
        gen = torch.Generator().manual_seed((seed * 1_000_003 + index) % (2**63))
        seq[row, 0] = torch.randint(vocab, (1,), generator=gen)
        noise[row] = torch.rand(seq_len, generator=gen) < 0.1
        random_tokens[row] = torch.randint(vocab, (seq_len,), generator=gen)
    for t in range(seq_len):
        pattern = (seq[:, t] * 3 + 1) % vocab
        seq[:, t + 1] = torch.where(noise[:, t], random_tokens[:, t], pattern)
    return seq[:, :-1], seq[:, 1:]


def step_indices(
    sampler: Any, epoch: int, consumed: int, batch: int
) -> tuple[list[int], int, int]:
    """This rank's indices of the next global batch from position ``(epoch, consumed)``, and
    the position after it.

    The global batch is the next ``batch`` positions of the epochs' orders, one epoch after
    the other; this rank takes positions ``rank``, ``rank + W``, ... of them.
    """
    mine = len(range(sampler.rank, batch, sampler.num_replicas))
    indices = list(itertools.islice(sampler.stream(epoch, consumed), mine))
    epoch, consumed = divmod(epoch * sampler.length + consumed + batch, sampler.length)
    return indices, epoch, consumed


# --------------------------------------------------------------------------------------------
# Fault injection
# --------------------------------------------------------------------------------------------


def fault_dir(override: str | None) -> str:
    """Where the once-per-job fault markers live (created with mode 0700 if missing)."""
    if override:
        path = override
    elif os.environ.get("FTRUN_JOB_DIR"):
        path = os.environ["FTRUN_JOB_DIR"]
    else:
        # Without a run id (plain python) the job is this process.
        run_id = os.environ.get("TORCHELASTIC_RUN_ID") or f"pid{os.getpid()}"
        path = os.path.join(tempfile.gettempdir(), f"{PREFIX}-{run_id}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


class InjectedFault(RuntimeError):
    """The exception that fault mode ``raise`` throws out of the training loop."""


def load_fault_schedule(path: str, steps: int) -> list[tuple[int, int, str]]:
    """Read ``--fault-schedule``: a JSON list of ``{"step": S, "rank": R, "mode": M}``.

    Raises ValueError naming the bad entry; ranks are checked later, against WORLD_SIZE.
    """
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(doc, list):
        raise ValueError(f"{path} must hold a JSON list of {{step, rank, mode}} objects")
    out = []
    for i, entry in enumerate(doc):
        if not isinstance(entry, dict) or set(entry) != {"step", "rank", "mode"}:
            raise ValueError(f"{path}: entry {i} must be an object with exactly the keys "
                             f"step, rank and mode, got {entry!r}")
        step, rank, mode = entry["step"], entry["rank"], entry["mode"]
        if type(step) is not int or not 1 <= step <= steps:
            raise ValueError(f"{path}: entry {i}: step must be an integer in 1..{steps}, "
                             f"got {step!r}")
        if type(rank) is not int or rank < 0:
            raise ValueError(f"{path}: entry {i}: rank must be an integer >= 0, got {rank!r}")
        if mode not in FAIL_MODES:
            raise ValueError(f"{path}: entry {i}: mode must be one of {', '.join(FAIL_MODES)}, "
                             f"got {mode!r}")
        out.append((step, rank, mode))
    return out


def maybe_inject_fault(
    args: argparse.Namespace, rank: int, step: int, before_forward: bool = False, snap: Any = None
) -> None:
    """Fire the faults planned for this rank and step (``args.faults``) that have not fired yet.

    ``corrupt`` fires at the start of the step, before its collectives, so no rank can have
    moved past the previous committed snapshot; every other mode fires after the backward
    pass, in the middle of the step.
    """
    for fault_step, fault_rank, mode in args.faults:
        if (fault_step, fault_rank) == (step, rank) and before_forward == (mode == "corrupt"):
            _fire_fault(args, rank, step, mode, snap)


def _fire_fault(args: argparse.Namespace, rank: int, step: int, mode: str, snap: Any) -> None:
    marker = os.path.join(fault_dir(args.fault_dir), f"fault-fired-rank{rank}-step{step}")
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        print(
            f"{PREFIX}: fault already fired ({marker}), not injecting again",
            file=sys.stderr,
            flush=True,
        )
        return
    info = {
        "mode": mode,
        "rank": rank,
        "step": step,
        "pid": os.getpid(),
        "time": time.time(),
    }
    try:
        os.write(fd, json.dumps(info).encode() + b"\n")
    finally:
        os.close(fd)
    print(
        f"{PREFIX}: injecting fault mode={mode} rank={rank} step={step}",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    if mode == "corrupt":
        # Flip a byte of this rank's newest snapshot in memory, then crash: the restart must
        # refuse that snapshot and fall back to an older committed one.
        from ftrun.faults import corrupt_newest_snapshot

        if snap is not None:
            snap.wait()  # the previous step's snapshot is staged: it is the one to corrupt
        hit = corrupt_newest_snapshot(rank)
        with open(marker, "a") as f:
            f.write(json.dumps({"corrupted_step": hit.step, "segment": hit.segment}) + "\n")
        print(f"{PREFIX}: corrupted the snapshot of step {hit.step}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CODE_FAULT)
    if mode == "exit":
        sys.exit(EXIT_CODE_FAULT)
    elif mode == "raise":
        raise InjectedFault(f"injected fault: exception in step {step} on rank {rank}")
    elif mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif mode == "collective-hang":
        # An all-reduce no other rank enters: it blocks inside the backend until the side
        # group's (day-long) timeout, while the others wait for this rank in theirs.
        dist.all_reduce(torch.zeros(1), group=args.side_group)
    else:  # hang: alive, but never progresses again.
        while True:
            time.sleep(0.1)


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def params_digest(model: nn.Module) -> str:
    """xxh3-64 over the raw bytes of every parameter, in ``named_parameters()`` order.

    A sharded parameter (an FSDP2 DTensor) is gathered first, which is collective: under
    ``--fsdp`` every rank calls this.
    """
    h = xxhash.xxh3_64()
    for _, p in model.named_parameters():
        full = p.detach()
        if hasattr(full, "full_tensor"):
            full = full.full_tensor()
        h.update(full.cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def write_json_atomic(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON so that readers see either the old file or the complete new one."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def _every(text: str) -> int | str | None:
    """``--snapshot-every``: a number of steps (0: off), ``auto``, or ``launcher`` (None: the
    launcher's ``--snapshot-every`` applies)."""
    text = text.strip().lower()
    if text == "auto":
        return text
    if text == "launcher":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"must be a number of steps >= 0, 'auto' or 'launcher', got {text!r}")
    return value


def parse_args(argv: list[str] | None, world_size: int) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="train.py",
        description="Deterministic GPT-style DDP training workload for ftrun.",
    )
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--dim", type=int, default=64, help="model width (default 64)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--seq-len", type=int, default=32, help="sequence length (default 32)")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size (default 256)")
    p.add_argument(
        "--batch",
        type=int,
        default=8,
        help="global batch size, at least WORLD_SIZE; rank r takes samples r, r+W, ... of it "
        "(default 8)",
    )
    p.add_argument(
        "--samples",
        type=int,
        default=1024,
        help="size of the synthetic dataset: an epoch is this many samples (default 1024)",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the model with FSDP2 (fully_shard per block, then the whole model) "
        "instead of wrapping it in DDP; needs a process group (ftrun or torchrun)",
    )
    p.add_argument(
        "--sample-log",
        metavar="FILE",
        help="every rank appends one JSON line per step to FILE: step, rank, world size, "
        "restart count, epoch and position before the step, and the sample indices it trained on",
    )
    p.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument(
        "--pg-timeout",
        type=float,
        default=60.0,
        help="init_process_group timeout in seconds (default 60)",
    )
    p.add_argument("--result", metavar="FILE", help="rank 0 writes the result as JSON here")
    p.add_argument(
        "--fail-at-step",
        type=int,
        metavar="S",
        help="inject a fault in step S (1..steps), after backward, once per job",
    )
    p.add_argument(
        "--fail-rank", type=int, default=0, metavar="R", help="global rank that fails (default 0)"
    )
    p.add_argument(
        "--fail-mode",
        choices=FAIL_MODES,
        default="exit",
        help="exit: exit code 13; kill: SIGKILL itself; hang: sleep forever; "
        "stop: SIGSTOP itself; corrupt: flip a byte of its newest in-memory snapshot, then exit; "
        "raise: raise an exception out of the training loop; collective-hang: enter an "
        "all-reduce of a side process group (made by every rank at start) that no other rank "
        "enters, so it sits inside a collective that never returns while the others wait for "
        "it in the next one (default exit)",
    )
    p.add_argument(
        "--slow-rank", type=int, default=None, metavar="R",
        help="make rank R slow: after each optimizer step it sleeps (F-1) times the time its "
        "forward, backward and optimizer step took, so it computes F times slower "
        "(--slow-factor); the numbers it computes do not change",
    )
    p.add_argument("--slow-factor", type=float, default=2.0, metavar="F",
                   help="how much slower --slow-rank computes (default 2)")
    p.add_argument(
        "--fault-schedule",
        metavar="FILE",
        help='several faults in one job: a JSON list of {"step": S, "rank": R, "mode": M} '
        "(modes as --fail-mode), each fired once per job like --fail-at-step; combines with it",
    )
    p.add_argument(
        "--snapshot-every",
        type=_every,
        default="auto",
        metavar="K",
        help="snapshot the training state with ftrun.Snapshotter every K steps, or 'auto': as "
        "often as keeps the measured slowdown at or below 3%% and the failure rate makes worth it "
        "(default), or 'launcher': as "
        "ftrun's --snapshot-every says; 0 turns snapshots off (outside ftrun they are off "
        "anyway)",
    )
    p.add_argument(
        "--torch-save-dir",
        metavar="DIR",
        help="the usual alternative to ftrun's snapshots, for comparisons: rank 0 writes "
        "model and optimizer state with torch.save to DIR/checkpoint.pt every "
        "--torch-save-every steps, and every rank loads it at start when present",
    )
    p.add_argument("--torch-save-every", type=int, default=10, metavar="K")
    p.add_argument(
        "--step-log",
        metavar="FILE",
        help="rank 0 appends one JSON line per completed step: time, step, restart count",
    )
    p.add_argument(
        "--step-sleep",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="sleep this long in every step, to stand in for a slower model (default 0)",
    )
    p.add_argument(
        "--fault-dir",
        metavar="DIR",
        help="directory for the fault marker files (default $FTRUN_JOB_DIR, else "
        "$TMPDIR/ftrun-example-$TORCHELASTIC_RUN_ID)",
    )
    args = p.parse_args(argv)

    for name in ("steps", "layers", "dim", "heads", "seq_len", "vocab", "batch", "samples"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.dim % args.heads:
        p.error(f"--dim {args.dim} must be divisible by --heads {args.heads}")
    if args.batch < world_size:
        p.error(f"--batch {args.batch} (global batch size) must be at least WORLD_SIZE="
                f"{world_size}, so that every rank has a sample in every step")
    if args.fsdp and "RANK" not in os.environ:
        p.error("--fsdp needs a process group: run under ftrun or torchrun")
    if args.fsdp and args.torch_save_dir:
        p.error("--torch-save-dir saves rank 0's model, which under --fsdp is one shard: "
                "use ftrun's snapshots (--persist-dir) with --fsdp")
    if not (args.pg_timeout > 0 and math.isfinite(args.pg_timeout)):
        p.error("--pg-timeout must be a positive number of seconds")
    if args.fail_at_step is not None:
        if not 1 <= args.fail_at_step <= args.steps:
            p.error(f"--fail-at-step must be in 1..{args.steps} (steps count from 1)")
        if not 0 <= args.fail_rank < world_size:
            p.error(f"--fail-rank must be in 0..{world_size - 1} (WORLD_SIZE={world_size})")
    args.faults = []
    if args.fault_schedule:
        try:
            args.faults = load_fault_schedule(args.fault_schedule, args.steps)
        except ValueError as e:
            p.error(f"--fault-schedule: {e}")
    if args.fail_at_step is not None:
        args.faults.append((args.fail_at_step, args.fail_rank, args.fail_mode))
    if args.slow_rank is not None and not 0 <= args.slow_rank < world_size:
        p.error(f"--slow-rank {args.slow_rank} is not in 0..{world_size - 1} "
                f"(WORLD_SIZE={world_size})")
    if not (args.slow_factor >= 1 and math.isfinite(args.slow_factor)):
        p.error(f"--slow-factor must be a number >= 1, got {args.slow_factor}")
    for step, rank, _ in args.faults:
        if rank >= world_size:
            p.error(f"--fault-schedule: rank {rank} (step {step}) is not in "
                    f"0..{world_size - 1} (WORLD_SIZE={world_size})")
    seen = [(step, rank) for step, rank, _ in args.faults]
    if len(set(seen)) != len(seen):
        p.error("--fault-schedule/--fail-at-step: at most one fault per (step, rank); "
                "each fires once, recorded by its marker fault-fired-rank{R}-step{S}")
    return args


def train(
    args: argparse.Namespace, rank: int, world_size: int, device: torch.device
) -> tuple[float, str, list[int]]:
    """Run the training loop; return the last step's global-batch loss, the params digest and
    the steps this job resumed from (one per restore from a snapshot).

    The digest is computed on rank 0 only (other ranks return ""). Everything that references the
    process group (DDP and its reducer, FSDP's DTensors) is local to this function, so it is gone
    before the caller destroys the process group.
    """
    if _Sampler is None:
        raise SystemExit(f"{PREFIX}: cannot import ftrun, whose ResumableDistributedSampler "
                         "orders the data: install it (pip install -e .) or set PYTHONPATH")
    distributed = dist.is_initialized()
    torch.manual_seed(args.seed)  # same on every rank, so every rank builds the same model
    model = GPT(args.vocab, args.seq_len, args.dim, args.heads, args.layers).to(device)
    train_model: nn.Module = model
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif distributed:
        device_ids = [device.index] if device.type == "cuda" else None
        # DDP with its default arguments: ftrun's snapshots record the gradient bucket layout
        # DDP settles on, and a restore reduces with it from the first step (ftrun._torch).
        train_model = DistributedDataParallel(model, device_ids=device_ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    last_loss = torch.zeros((), device=device)
    resumed_from: list[int] = []
    start = epoch = consumed = 0
    snap = None
    if args.snapshot_every != 0 and _Snapshotter is not None:
        snap = _Snapshotter(train_model, optimizer, every=args.snapshot_every)
        start = snap.restore()
        if start > 0:
            # The history of restores travels inside the snapshots themselves. Everything in
            # extra is the same on every rank, so it holds whichever old rank a rank of another
            # world size restores it from.
            resumed_from = [*snap.extra["resumed_from"], start]
            last_loss = snap.extra["loss"].to(device)
            epoch, consumed = int(snap.extra["epoch"]), int(snap.extra["consumed"])
            print(f"{PREFIX}: rank {rank} resumed from step {start} (epoch {epoch}, "
                  f"{consumed} samples consumed in it), from {snap.source}", file=sys.stderr,
                  flush=True)

    if args.torch_save_dir:
        start, resumed_from, last_loss, epoch, consumed = _torch_load(
            args, model, optimizer, (start, resumed_from, last_loss, epoch, consumed), device
        )

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    sampler = _Sampler(args.samples, world_size, rank, shuffle=True, seed=args.seed)
    tokens = args.batch * args.seq_len  # the global batch's targets: each rank's loss is a share
    for step in range(start + 1, args.steps + 1):
        indices, next_epoch, next_consumed = step_indices(sampler, epoch, consumed, args.batch)
        if args.sample_log:
            _log_samples(args.sample_log, step, rank, world_size, restart, epoch, consumed,
                         indices)
        epoch, consumed = next_epoch, next_consumed
        inputs, targets = samples(args.seed, indices, args.seq_len, args.vocab)
        inputs, targets = inputs.to(device), targets.to(device)
        maybe_inject_fault(args, rank, step, before_forward=True, snap=snap)
        t_compute = time.perf_counter()
        logits = train_model(inputs)
        # Sum over this rank's targets over all of the global batch's, times the world size
        # that DDP and FSDP average gradients over: the gradient of the global batch's mean,
        # however unevenly the batch is split.
        loss_sum = F.cross_entropy(logits.view(-1, args.vocab), targets.reshape(-1),
                                   reduction="sum")
        optimizer.zero_grad(set_to_none=True)
        (loss_sum * (world_size / tokens)).backward()
        maybe_inject_fault(args, rank, step)
        optimizer.step()
        if rank == args.slow_rank:
            time.sleep((args.slow_factor - 1) * (time.perf_counter() - t_compute))
        last_loss = loss_sum.detach().clone()
        if distributed:
            dist.all_reduce(last_loss)
        last_loss /= tokens  # the mean over the global batch, the same on every rank
        if snap is not None:
            snap.save(step, extra={"resumed_from": resumed_from, "loss": last_loss,
                                   "epoch": epoch, "consumed": consumed})
        if args.torch_save_dir and step % args.torch_save_every == 0 and rank == 0:
            _torch_save(args, model, optimizer, step, resumed_from, last_loss, epoch, consumed)
        if args.step_log and rank == 0:
            with open(args.step_log, "a") as f:
                f.write(json.dumps({"time": time.time(), "step": step, "restart": restart}) + "\n")
        if args.step_sleep > 0:
            time.sleep(args.step_sleep)
        _progress(step)
    _progress(args.steps, done=True)  # training is over: no more hang watch
    if snap is not None:
        snap.close()

    # Under FSDP every rank takes part in gathering the full parameters.
    digest = params_digest(model) if rank == 0 or args.fsdp else ""
    return float(last_loss.item()), digest if rank == 0 else "", resumed_from


def _log_samples(path: str, step: int, rank: int, world_size: int, restart: int, epoch: int,
                 consumed: int, indices: list[int]) -> None:
    """Append one line for ``--sample-log``, in one write, so that ranks never interleave."""
    line = json.dumps({"step": step, "rank": rank, "world_size": world_size,
                       "restart": restart, "epoch": epoch, "consumed": consumed,
                       "indices": indices}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _torch_save(
    args: argparse.Namespace,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    resumed_from: list[int],
    loss: torch.Tensor,
    epoch: int,
    consumed: int,
) -> None:
    path = os.path.join(args.torch_save_dir, "checkpoint.pt")
    os.makedirs(args.torch_save_dir, exist_ok=True)
    state = {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "step": step,
        "resumed_from": resumed_from,
        "loss": loss,
        "rng": torch.get_rng_state(),
        "epoch": epoch,
        "consumed": consumed,
    }
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def _torch_load(
    args: argparse.Namespace,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    current: tuple[int, list[int], torch.Tensor, int, int],
    device: torch.device,
) -> tuple[int, list[int], torch.Tensor, int, int]:
    """``current`` (step, resumed_from, loss, epoch, consumed), or those of DIR/checkpoint.pt
    when it holds a later step."""
    path = os.path.join(args.torch_save_dir, "checkpoint.pt")
    if not os.path.exists(path):
        return current
    state = torch.load(path, map_location=device, weights_only=True)
    if state["step"] <= current[0]:
        return current
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    torch.set_rng_state(state["rng"])
    step = int(state["step"])
    print(
        f"{PREFIX}: resumed from torch.save checkpoint of step {step}", file=sys.stderr, flush=True
    )
    return (step, [*state["resumed_from"], step], state["loss"], int(state["epoch"]),
            int(state["consumed"]))


def _on_sigusr1(signum: int, _frame: object) -> None:
    print(
        f"{PREFIX}: received SIGUSR1 on rank {os.environ.get('RANK', '0')}",
        file=sys.stderr,
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    distributed = "RANK" in os.environ
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if distributed else 1
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if distributed else 0
    args = parse_args(argv, world_size)
    # Slurm's time-limit warning arrives as SIGUSR1 (ftrun forwards it to the ranks). Its
    # default action ends the process; a real script would save state here and go on.
    signal.signal(signal.SIGUSR1, _on_sigusr1)

    # cuBLAS reads this when CUDA initialises; deterministic algorithms need it.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return run(args, device)


@_resilient
def run(args: argparse.Namespace, device: torch.device) -> int:
    """One run of the job in this process: under ftrun, a fault elsewhere in the job runs it
    again here in the new world (``@ftrun.resilient``), so the rank and world size are read
    from the environment each time, and the process group is made and destroyed inside."""
    distributed = "RANK" in os.environ
    rank = int(os.environ["RANK"]) if distributed else 0
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if distributed else 1
    if distributed:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=args.pg_timeout))
        # The collective monitor (ftrun launches only; Snapshotter starts it too).
        _monitor_collectives()
    args.side_group = None
    if distributed and any(mode == "collective-hang" for _, _, mode in args.faults):
        # Every rank makes the group (new_group is collective); only the faulty rank uses it.
        args.side_group = dist.new_group(backend="gloo", timeout=timedelta(days=1))

    loss, digest, resumed_from = train(args, rank, world_size, device)

    if rank == 0:
        print(f"{PREFIX}: step={args.steps} loss={loss:.6f} params_xxh3={digest}", flush=True)
        if args.result:
            write_json_atomic(
                args.result,
                {
                    "step": args.steps,
                    "loss": loss,
                    "params_xxh3": digest,
                    "world_size": world_size,
                    "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0),
                    "resumed_from": resumed_from,
                },
            )

    if distributed:
        # DDP's reducer holds a reference to the process group and is destroyed with the GIL
        # held. If it dropped the last reference, ~ProcessGroupGloo would join its worker
        # threads while one of them waits for the GIL to free a finished collective's tensor:
        # a deadlock at exit. So collect DDP first; the group's own Python binding releases
        # the GIL while it is torn down in destroy_process_group().
        gc.collect()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
