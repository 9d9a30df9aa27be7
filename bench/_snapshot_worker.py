"""One training rank for ``bench/snapshot.py``: trains a >= 1 GiB model and times its saves.

Not meant to be run by hand; ``bench/snapshot.py`` launches it in two ways:

- ``--mode ftrun`` under ``ftrun --standalone --nproc-per-node 1 --max-restarts 1``: trains
  with steps that call ``Snapshotter.save()`` and steps that do not, finely interleaved
  (``--async-copy 1|0``); times each step, the time inside ``save()`` and the wait before
  ``optimizer.step()``, and ftrun's own copy into shared memory; then copies the same tensors
  with plain ``torch`` into a pre-faulted shared-memory file of its own (the reference).
  With ``--restore`` it then exits with an error on purpose; ftrun restarts it, and the new
  process times ``snap.restore()`` against ``torch.load`` of the same state from ``/dev/shm``.
- ``--mode baselines`` under plain ``torchrun --nproc-per-node 1``: the same model and training
  step, saving every step with DLRover's ``DdpCheckpointer`` (memory), ``torch.save`` to
  ``/dev/shm`` and ``torch.distributed.checkpoint.async_save`` (one block each).

- ``--mode auto`` under ``ftrun --standalone --nproc-per-node 1``: the same model with
  ``Snapshotter(every="auto")``, ``save()`` called every step; for each batch size of
  ``--auto-batches``: steps without ``save()``, the interval settling (two agreements), steps
  with ``save()`` (a whole number of intervals), steps without ``save()`` again.

``--device cuda`` trains on the GPU the way users do (bf16 autocast, fused AdamW, one rank per
GPU with NCCL) and times a step up to the end of the work queued on the compute stream (not
ftrun's copy stream); the reference copy is then a ``non_blocking`` device-to-host copy into
pinned memory (``pin_memory``), timed with CUDA events. ``--device cpu`` (the default) trains
on the CPU with gloo, as before.

With ``--lengths`` the ftrun mode also measures the copy time first, picks a batch size whose
step is about three times as long, and times save-every-step pairs at ``--short-batch`` and at
that batch.

Every incarnation writes its raw measurements as JSON to ``--result`` (the restarted one to
``--result`` + ``.restore.json``). Shared-memory files of its own go to ``--shm-dir`` (a private
directory on ``/dev/shm``, also ftrun's ``FTRUN_SHM_DIR``), which the driver removes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import mmap
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import xxhash
from torch import nn

EXIT_RESTART = 3  # the planned "crash" that makes ftrun restart the rank


class Device:
    """Where training runs, and how its time is read.

    On CUDA a clock reading first waits for the work queued on the current (compute) stream,
    as ``loss.item()`` in a training loop would, and not for ftrun's copy stream: a snapshot
    copy that overlaps the next step does not count, one that delays it does.
    """

    def __init__(self, name: str) -> None:
        self.cuda = name == "cuda"
        if self.cuda:
            if not torch.cuda.is_available():
                raise SystemExit("--device cuda: torch.cuda.is_available() is False here; "
                                 "run with --device cpu")
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            self.torch = torch.device("cuda", torch.cuda.current_device())
        else:
            self.torch = torch.device("cpu")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.current_stream().synchronize()

    def now(self) -> float:
        self.sync()
        return time.perf_counter()

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.cuda:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def backend(self) -> str:
        return "nccl" if self.cuda else "gloo"

    def name(self) -> str:
        if self.cuda:
            props = torch.cuda.get_device_properties(self.torch)
            return (f"{props.name} ({props.total_memory / 2**30:.0f} GiB), CUDA "
                    f"{torch.version.cuda}")
        return "cpu"


# --------------------------------------------------------------------------------------------
# Model, data, step
# --------------------------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-LayerNorm transformer MLP block with a residual connection (dim -> 4 dim -> dim)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def block_params(dim: int) -> int:
    return 8 * dim * dim + 7 * dim


def n_blocks(size_gib: float, dim: int) -> int:
    """Blocks needed so that params * 4 bytes * 3 (param, exp_avg, exp_avg_sq) >= size_gib."""
    return max(1, math.ceil(size_gib * 2**30 / (12 * block_params(dim))))


def build(args: argparse.Namespace, dev: Device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(args.seed)
    model = nn.Sequential(*(Block(args.dim) for _ in range(n_blocks(args.size_gib, args.dim))))
    model = model.to(dev.torch)
    return model, make_optimizer(model, dev)


def make_optimizer(model: nn.Module, dev: Device) -> torch.optim.Optimizer:
    # fused: one kernel for the whole AdamW update, what GPU users pick.
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                             fused=True if dev.cuda else None)


def batch(args: argparse.Namespace, step: int, dev: Device,
          rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    rows = args.batch if rows is None else rows
    g = torch.Generator(device=dev.torch).manual_seed(args.seed * 1_000_003 + step)
    x = torch.randn(rows, args.dim, generator=g, device=dev.torch)
    return x, torch.randn(rows, args.dim, generator=g, device=dev.torch)


def forward_backward(model: nn.Module, opt: torch.optim.Optimizer,
                     xy: tuple[torch.Tensor, torch.Tensor], dev: Device) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    with dev.autocast():
        loss = F.mse_loss(model(xy[0]).float(), xy[1])
    loss.backward()
    return loss.detach()


def state_dict(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The state every method saves: what ftrun's Snapshotter itself saves (DCP state dicts)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def tensors_of(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from tensors_of(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from tensors_of(v)


def digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """xxh3-64 over every parameter and optimizer-state tensor (restore correctness check)."""
    h = xxhash.xxh3_64()
    for t in tensors_of(state_dict(model, opt)):
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state_dict(model, opt)))


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def clock() -> float:
    return time.perf_counter()


def new_shm_file(path: Path, size: int) -> mmap.mmap:
    """A file of ``size`` bytes in tmpfs, mapped and with every page touched (pre-faulted)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    zeros = bytes(1 << 20)
    for off in range(0, size, len(zeros)):
        n = min(len(zeros), size - off)
        mm[off:off + n] = zeros[:n]
    return mm


class PlainCopy:
    """Copies ``sources`` with ``torch`` ``copy_`` into one pre-faulted file in ``shm_dir``, at
    64-byte aligned offsets like ftrun's data region: the reference for ftrun's staging."""

    def __init__(self, sources: list[torch.Tensor], shm_dir: Path) -> None:
        offsets, off = [], 0
        for t in sources:
            offsets.append(off)
            off = (off + t.numel() * t.element_size() + 63) // 64 * 64
        self.path = shm_dir / "reference-copy"
        self.mm = new_shm_file(self.path, max(off, 1))
        base = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.pairs = [(base[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape), t)
                      for o, t in zip(offsets, sources, strict=True)]

    def __call__(self) -> float:
        t0 = clock()
        for view, src in self.pairs:
            view.copy_(src)
        return clock() - t0

    def close(self) -> None:
        self.pairs = []
        try:
            self.mm.close()
        except BufferError:
            pass
        self.path.unlink(missing_ok=True)


class PinnedCopy:
    """Copies device ``sources`` with ``non_blocking`` ``copy_`` into one pinned host buffer
    (``pin_memory``), on a stream of its own, timed with CUDA events: the limit for ftrun's
    staging of the same tensors on a GPU."""

    def __init__(self, sources: list[torch.Tensor]) -> None:
        offsets, off = [], 0
        for t in sources:
            offsets.append(off)
            off = (off + t.numel() * t.element_size() + 63) // 64 * 64
        self.host = torch.empty(max(off, 1), dtype=torch.uint8, pin_memory=True)
        self.pairs = [(self.host[o:o + t.numel() * t.element_size()].view(t.dtype)
                       .view(t.shape), t) for o, t in zip(offsets, sources, strict=True)]
        self.stream = torch.cuda.Stream()

    def __call__(self) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            start.record()
            for view, src in self.pairs:
                view.copy_(src, non_blocking=True)
            end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def close(self) -> None:
        self.pairs = []
        del self.host


def reference_copy(sources: list[torch.Tensor], dev: Device, shm_dir: Path) -> Any:
    """The plain copy ftrun's staging is compared with, on ``dev``."""
    return PinnedCopy(sources) if dev.cuda else PlainCopy(sources, shm_dir)


def write_json(path: str, doc: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def common_info(args: argparse.Namespace, model: nn.Module, opt: torch.optim.Optimizer,
                dev: Device) -> dict[str, Any]:
    return {
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "device": dev.torch.type, "device_name": dev.name(),
        "params": sum(p.numel() for p in model.parameters()), "blocks": len(model),
        "dim": args.dim, "batch": args.batch, "state_bytes": state_bytes(model, opt),
        "pid": os.getpid(), "run_id": os.environ.get("TORCHELASTIC_RUN_ID", ""),
        "loadavg_start": os.getloadavg(),
    }


# --------------------------------------------------------------------------------------------
# ftrun
# --------------------------------------------------------------------------------------------


def run_ftrun(args: argparse.Namespace) -> int:
    from ftrun import Snapshotter

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    dev = Device(args.device)
    dist.init_process_group(dev.backend())
    model, opt = build(args, dev)
    snap = Snapshotter(model, opt, every=1, async_copy=args.async_copy)
    if not snap.enabled:
        raise SystemExit("not started by ftrun: snapshots are off")
    if restart == 1:
        return measure_restore(args, model, opt, snap, dev)
    if restart >= 2:
        return measure_torch_load(args, model, opt, dev)
    info = common_info(args, model, opt, dev)
    info["restore_first"] = snap.restore()
    clock = dev.now

    # Instrument the background writer (instance attributes only; nothing in ftrun changes):
    # _write = claim + copy into the segment + manifest + "staged" message; _claim = the
    # round trip to the store that allows overwriting the older buffer.
    writes: list[tuple[int, float, float]] = []  # (step, write s, claim s)
    claim_s: list[float] = [0.0]
    orig_write: Callable[..., None] = snap._saver.write
    orig_claim: Callable[..., Any] = snap._saver.claim

    def timed_claim(*a: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return orig_claim(*a)
        finally:
            claim_s[0] = time.perf_counter() - t0

    def timed_write(*a: Any, **kw: Any) -> None:  # (job, target, need, flat, blob, cuda)
        claim_s[0] = 0.0
        t0 = time.perf_counter()  # the writer thread's own time: no stream sync here
        orig_write(*a, **kw)
        writes.append((int(a[0].step), time.perf_counter() - t0, claim_s[0]))

    snap._saver.claim = timed_claim  # type: ignore[method-assign]
    snap._saver.write = timed_write  # type: ignore[method-assign]

    steps: list[dict[str, Any]] = []
    step = 0

    def one(mode: str, measured: bool, rows: int | None = None,
            into: list[dict[str, Any]] = steps) -> None:
        nonlocal step
        step += 1
        xy = batch(args, step, dev, rows)
        t0 = clock()
        forward_backward(model, opt, xy, dev)
        tw = clock()
        snap.wait()  # what the optimizer's pre-hook would wait for; measured here
        tw = clock() - tw
        opt.step()
        ts = clock()
        saved = snap.save(step) if mode == "snap" else False
        ts = clock() - ts
        into.append({"step": step, "mode": mode, "measured": measured, "s": clock() - t0,
                     "wait_s": tw, "save_s": ts, "saved": saved})

    unverified: list[int] = []

    def settle() -> float:
        """Untimed: the snapshot in flight staged and hashed by the store, so the next step
        starts with nothing of ftrun running. Returns the seconds waited."""
        t0 = clock()
        # Right after save(): the claim of its buffer may still be on its way (a step would
        # give it the length of a forward and backward pass); wait for it here rather than
        # skip the snapshot.
        snap.wait(claim_wait_s=60.0)
        if not wait_verified(snap, step):
            unverified.append(step)
        return clock() - t0

    for _ in range(args.warmup):  # creates and pre-faults both buffers, warms the allocator
        one("snap", False)
    settle()
    one("none", False)
    # Pairs, finely interleaved so that a drifting machine hits both modes alike:
    #   snap (not counted: nothing of an earlier save overlaps it), snap (counted: the previous
    #   save's copy and hash overlap it, its own save() is in it, as in steady state),
    #   settle (untimed), none (counted).
    settles: list[float] = []

    def pairs(n: int, rows: int | None = None, into: list[dict[str, Any]] = steps) -> None:
        for _ in range(n):
            one("snap", False, rows, into)
            one("snap", True, rows, into)
            settles.append(settle())
            one("none", True, rows, into)

    pairs(args.steps)
    info.update(settle_s=settles, unverified=unverified)

    sources = [t.detach() for t in tensors_of(state_dict(model, opt))]
    info["copy_bytes"] = sum(t.numel() * t.element_size() for t in sources)
    plain = reference_copy(sources, dev, Path(args.shm_dir))
    if args.lengths:
        # (e) the same pairs at a short step and at a step about three times the copy.
        def step_s(rows: int) -> float:
            timed: list[dict[str, Any]] = []
            try:
                for _ in range(3):
                    one("none", True, rows, timed)
            except torch.OutOfMemoryError as e:
                raise SystemExit(f"a batch of {rows} rows does not fit in memory ({e}); pass a "
                                 "smaller --max-batch") from e
            return med([x["s"] for x in timed])

        copy_s = med([plain() for _ in range(3)])
        rows_long, fit = long_batch(args.short_batch, args.batch, 3 * copy_s, step_s,
                                    args.max_batch)
        info["lengths"] = {"copy_s": copy_s, "fit": fit, "parts": []}
        # When even the short step is about 3x the copy (a CPU), it is the only length.
        lengths = [("short", args.short_batch)]
        if rows_long != args.short_batch:
            lengths.append(("long", rows_long))
        for label, rows in lengths:
            part: list[dict[str, Any]] = []
            one("none", False, rows, part)  # a new batch shape: let the allocator settle
            settle()
            part.clear()
            pairs(args.pair_steps, rows, part)
            info["lengths"]["parts"].append({"label": label, "rows": rows, "steps": part})
        info["settle_s"] = settles[:args.steps]

    # (c) ftrun's copy into its buffer and a plain copy of the same tensors (a pre-faulted file
    # on the CPU, pinned memory from the GPU), alternating, with nothing else running (each
    # save settles: copy and hash done). These saves hold the final state, so the last one is
    # what restore must bring back.
    ftrun_copy_s, plain_copy_s = [], []
    try:
        for _ in range(args.copy_repeats):
            step += 1
            snap.save(step)
            settle()
            _, write_s, claim = writes[-1]
            ftrun_copy_s.append(write_s - claim)
            plain_copy_s.append(plain())
    finally:
        plain.close()
    del sources
    last = step
    info.update(ftrun_copy_s=ftrun_copy_s, ref_copy_s=plain_copy_s)
    info.update(steps=steps, writes=writes, last_step=last, skipped=snap.skipped_saves,
                committed=snap.committed, loadavg_end=os.getloadavg())
    if args.restore:
        info["digest"] = digest(model, opt)
    write_json(args.result, info)
    sys.stdout.flush()
    sys.stderr.flush()
    if args.restore:
        os._exit(EXIT_RESTART)  # a crash: ftrun restarts the rank, the segments stay
    snap.close()
    dist.destroy_process_group()
    return 0


def med(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else float("nan")


def long_batch(short: int, base: int, target_s: float, step_s: Callable[[int], float],
               cap: int) -> tuple[int, dict[str, Any]]:
    """The batch size whose step takes about ``target_s``: the step time is fitted as
    a + b * rows from two batch sizes, the pick measured and corrected once. Returns it and
    the fit (measured points, the pick's step time)."""
    r1, r2 = short, max(base, 2 * short)
    t1, t2 = step_s(r1), step_s(r2)
    points = [(r1, t1), (r2, t2)]

    def pick(ra: int, ta: float, rb: int, tb: float) -> int:
        slope = (tb - ta) / (rb - ra) if rb != ra else 0.0
        if slope <= 0:
            return rb
        return max(1, min(cap, round(ra + (target_s - ta) / slope)))

    rows = pick(r1, t1, r2, t2)
    t = step_s(rows)
    points.append((rows, t))
    near = min(points[:2], key=lambda p: abs(p[0] - rows))
    if abs(t - target_s) > 0.15 * target_s and near[0] != rows:
        rows = pick(near[0], near[1], rows, t)
        t = step_s(rows)
        points.append((rows, t))
    return rows, {"target_s": target_s, "points": points, "capped": rows >= cap}


def wait_verified(snap: Any, step: int, timeout_s: float = 5.0) -> bool:
    """Wait until the store has marked the buffer holding ``step`` VERIFIED (reads headers)."""
    from ftrun.snapshot import segment as shm

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for buffer in (0, 1):
            try:
                seg = shm.Segment.open(shm.segment_name(snap.run_id, snap.rank, buffer))
            except FileNotFoundError:
                continue
            try:
                h = seg.header()
                if h.step == step and h.state == shm.VERIFIED:
                    return True
            finally:
                seg.close()
        time.sleep(0.01)
    return False


def measure_restore(args: argparse.Namespace, model: nn.Module, opt: torch.optim.Optimizer,
                    snap: Any, dev: Device) -> int:
    """First restart (a fresh process): time ``snap.restore()``; then write the same state with
    ``torch.save`` for the second restart to load, and crash again."""
    from ftrun.snapshot.verify import check as verify_segment

    out: dict[str, Any] = {"pid": os.getpid(), "loadavg_start": os.getloadavg()}
    parts: dict[str, float] = {}
    orig_load: Callable[..., Any] = snap._restorer._load_memory
    orig_apply: Callable[..., None] = snap._training.apply

    def timed_load(*a: Any) -> Any:
        t0 = clock()
        try:
            return orig_load(*a)
        finally:
            parts["load_memory_s"] = parts.get("load_memory_s", 0.0) + clock() - t0

    def timed_apply(*a: Any) -> None:
        t0 = clock()
        try:
            orig_apply(*a)
        finally:
            parts["apply_s"] = parts.get("apply_s", 0.0) + clock() - t0

    snap._restorer._load_memory = timed_load  # type: ignore[method-assign]
    snap._training.apply = timed_apply  # type: ignore[method-assign]
    # torch's DCP state-dict helpers first give an optimizer without state one by running a
    # step with zero gradients (_init_optim_state); time that part of apply separately.
    import torch.distributed.checkpoint.state_dict as dcp_sd

    orig_init: Callable[..., None] = dcp_sd._init_optim_state

    def timed_init(*a: Any) -> None:
        t0 = clock()
        try:
            orig_init(*a)
        finally:
            parts["init_optim_state_s"] = parts.get("init_optim_state_s", 0.0) + clock() - t0

    dcp_sd._init_optim_state = timed_init
    t0 = dev.now()
    restored = snap.restore()
    dcp_sd._init_optim_state = orig_init
    out["restore_s"] = dev.now() - t0
    out.update(parts, restored_step=restored, source=getattr(snap, "source", "?"),
               digest=digest(model, opt))
    # Where restore's time goes: hashing alone (xxh3 of every tensor, as restore() verifies).
    seg = next((s for s in snap._ctx.segments if s is not None and s.header().step == restored), None)
    if seg is not None:
        t0 = clock()
        ok, reason = verify_segment(seg)
        out["verify_s"] = clock() - t0
        out["verify_ok"] = ok or reason
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, torch_file(args))
    out["loadavg_end"] = os.getloadavg()
    write_json(args.result + ".restore.json", out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_RESTART)


def torch_file(args: argparse.Namespace) -> Path:
    return Path(args.shm_dir) / "restore-reference.pt"


def measure_torch_load(args: argparse.Namespace, model: nn.Module,
                       opt: torch.optim.Optimizer, dev: Device) -> int:
    """Second restart (a fresh process): ``torch.load`` of the same state from ``/dev/shm``
    into the model and an optimizer without state, what a torch user's resume does."""
    out: dict[str, Any] = {"pid": os.getpid(), "loadavg_start": os.getloadavg()}
    path = torch_file(args)
    loads, applied = [], []
    for i in range(args.load_repeats):
        fresh = opt if i == 0 else make_optimizer(model, dev)
        t0 = dev.now()
        sd = torch.load(path, map_location="cpu", weights_only=True)
        t1 = dev.now()
        model.load_state_dict(sd["model"])
        fresh.load_state_dict(sd["optim"])  # moves the state to the parameters' device
        t2 = dev.now()
        loads.append(t1 - t0)
        applied.append(t2 - t0)
        if i == 0:
            out["digest"] = digest(model, opt)
        del sd, fresh
    path.unlink(missing_ok=True)
    out.update(torch_load_s=loads, torch_load_apply_s=applied, loadavg_end=os.getloadavg())
    write_json(args.result + ".load.json", out)
    dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------------------------
# ftrun, every="auto"
# --------------------------------------------------------------------------------------------


def run_auto(args: argparse.Namespace) -> int:
    """For each batch size: the mean step without save() before and after, and with save()
    called every step under ``every="auto"`` once its interval has settled."""
    from ftrun import Snapshotter
    from ftrun.rank.snapshotter import Cadence

    dev = Device(args.device)
    dist.init_process_group(dev.backend())
    model, opt = build(args, dev)
    snap = Snapshotter(model, opt, every="auto")
    if not snap.enabled:
        raise SystemExit("not started by ftrun: snapshots are off")
    info = common_info(args, model, opt, dev)
    info["restore_first"] = snap.restore()
    step = 0

    def run(n: int, rows: int, save: bool) -> list[float]:
        nonlocal step
        times = []
        for _ in range(n):
            step += 1
            xy = batch(args, step, dev, rows)
            t0 = dev.now()
            forward_backward(model, opt, xy, dev)
            opt.step()  # ftrun's pre-hook waits for a copy still in flight, as in training
            if save:
                snap.save(step)
            times.append(dev.now() - t0)
        return times

    parts = []
    for rows in args.auto_batches:
        run(args.warmup, rows, False)
        before = run(args.auto_steps, rows, False)
        # Two agreements on the interval (every Cadence.AGREE_EVERY steps) with this step.
        settle_n = 2 * Cadence.AGREE_EVERY - step % Cadence.AGREE_EVERY
        run(settle_n, rows, True)
        every = snap.every
        # A whole number of intervals, starting at a snapshot step; an interval much longer
        # than --auto-steps is not waited out (its one snapshot then falls outside the count).
        whole = every <= 4 * args.auto_steps
        if whole:
            run((-step) % every, rows, True)
        n = every * max(1, math.ceil(args.auto_steps / every)) if whole else args.auto_steps
        skipped0 = snap.skipped_saves
        with_auto = run(n, rows, True)
        after = run(args.auto_steps, rows, False)
        parts.append({"rows": rows, "every": every, "every_end": snap.every,
                      "whole_intervals": whole, "none_s": before + after, "auto_s": with_auto,
                      "skipped": snap.skipped_saves - skipped0})
    info.update(parts=parts, skipped=snap.skipped_saves, loadavg_end=os.getloadavg())
    write_json(args.result, info)
    snap.close()
    dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------------------------
# Baselines: DLRover flash checkpoint (memory), torch.save, DCP async_save
# --------------------------------------------------------------------------------------------


def run_baselines(args: argparse.Namespace) -> int:
    dev = Device(args.device)
    # DCP's async_save runs its collectives on a CPU backend: gloo beside NCCL on a GPU.
    dist.init_process_group("cpu:gloo,cuda:nccl" if dev.cuda else "gloo")
    clock = dev.now
    shm_dir = Path(args.shm_dir)
    # DLRover first: without dlrover-run its engine forks its own saver process, which is
    # safest before this process has run any (OpenMP-parallel) torch work or grown large.
    # Where it is not installed (the GPU machine has no package index) its row is left out
    # and the report says so.
    try:
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType
    except ImportError as e:
        ckpt, skipped = None, {"dlrover": f"not installed ({e})"}
    else:
        ckpt, skipped = DdpCheckpointer(str(shm_dir / "dlrover-ckpt")), {}
    model, opt = build(args, dev)
    info = common_info(args, model, opt, dev)
    info["skipped"] = skipped
    steps: list[dict[str, Any]] = []
    step = 0

    def one(mode: str, measured: bool, save: Callable[[int], None] | None) -> None:
        nonlocal step
        step += 1
        xy = batch(args, step, dev)
        t0 = clock()
        forward_backward(model, opt, xy, dev)
        opt.step()
        ts = clock()
        if save is not None:
            save(step)
        ts = clock() - ts
        steps.append({"step": step, "mode": mode, "measured": measured, "s": clock() - t0,
                      "save_s": ts})

    # DLRover's agent-less mode: under plain torchrun (ROLE_NAME is not "dlrover-trainer") the
    # engine's start_saver_process() forks the saver; memory saves need no job master.
    def dlrover_save(s: int) -> None:
        assert ckpt is not None
        ckpt.save_checkpoint(s, state_dict(model, opt), storage_type=StorageType.MEMORY)

    ts_path = shm_dir / "torch-save.pt"

    def torch_save(s: int) -> None:
        torch.save(state_dict(model, opt), ts_path)

    import torch.distributed.checkpoint as dcp

    pending: list[Any] = []
    dcp_dir = shm_dir / "dcp"

    def dcp_save(s: int) -> None:
        # Blocking part: waiting for the previous save to finish (one in flight at a time,
        # as the DCP docs do) plus the staging inside async_save().
        while pending:
            fut = pending.pop()
            (getattr(fut, "upload_completion", None) or fut).result()
        pending.append(dcp.async_save(state_dict(model, opt), checkpoint_id=str(dcp_dir)))

    methods: list[tuple[str, Callable[[int], None] | None]] = [
        ("none", None), ("dlrover", dlrover_save), ("torch.save", torch_save), ("dcp", dcp_save)]
    methods = [(name, save) for name, save in methods if name not in skipped]
    for _ in range(args.warmup):
        one("warmup", False, None)
    for name, save in methods:
        for i in range(args.base_steps + args.warmup):
            one(name, i >= args.warmup, save)
        if name == "dcp":
            for fut in pending:
                (getattr(fut, "upload_completion", None) or fut).result()
        if name == "torch.save":
            ts_path.unlink(missing_ok=True)
    info.update(steps=steps, loadavg_end=os.getloadavg())
    write_json(args.result, info)
    dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("ftrun", "auto", "baselines"), required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=16, help="measured steps per mode (ftrun)")
    p.add_argument("--base-steps", type=int, default=6, help="measured saves per baseline")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--async-copy", type=int, choices=(0, 1), default=1)
    p.add_argument("--restore", action="store_true", help="crash, then time restore")
    p.add_argument("--copy-repeats", type=int, default=5)
    p.add_argument("--lengths", action="store_true",
                   help="also time pairs at --short-batch and at a step ~3x the copy")
    p.add_argument("--short-batch", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=1 << 16)
    p.add_argument("--pair-steps", type=int, default=8, help="pairs per step length")
    p.add_argument("--auto-batches", type=int, nargs="+", default=[1])
    p.add_argument("--auto-steps", type=int, default=32,
                   help="steps without save() before and after, and at least as many with")
    p.add_argument("--load-repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shm-dir", required=True)
    p.add_argument("--result", required=True)
    args = p.parse_args(argv)
    args.async_copy = bool(args.async_copy)
    # Die with the launcher (torchrun starts workers in sessions of their own).
    from ftrun.pdeath import set_parent_death_signal

    set_parent_death_signal()
    run = {"ftrun": run_ftrun, "auto": run_auto, "baselines": run_baselines}[args.mode]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
