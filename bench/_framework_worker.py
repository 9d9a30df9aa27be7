"""Run one of the framework examples unchanged, timing its steps, ftrun's snapshot calls and
the framework's own checkpoint saves (``bench/frameworks.py`` launches this file).

::

    ftrun ... bench/_framework_worker.py lightning|hf|accelerate [the example's flags...]

Each rank writes ``rank<R>.json`` into ``$FTRUN_BENCH_TIMINGS`` when the example returns:

- ``steps``: ``time.perf_counter()`` at the end of every optimizer step (a global step
  post-hook of ``torch.optim``; the frameworks' optimizer wrappers are left out, so each
  training step counts once);
- ``snap``: ``[kind, t0, t1, took, every, skipped]`` for every call of
  ``Snapshotter.save`` ("save"; ``took``: it started a snapshot) and ``Snapshotter.wait``
  ("wait": the optimizer pre-hook that holds the next step until the background copy is
  done), the time each held the training thread, and after the call the snapshot interval
  and the snapshots given up so far (the store had not released a buffer in time); and,
  nested in those, for a breakdown: "copy-wait" (``Saver.wait``: the wait for the copy in
  flight, also at the start of every ``save``), "capture" (``TrainingState.capture``:
  the state dicts, RNG states and the framework's own state gathered for the snapshot) and
  "buffers" (``Saver.ensure_segments``: creating or growing the shared-memory buffers);
- ``ckpt``: ``[t0, t1]`` for every call of the framework's own save: Lightning's
  ``Trainer.save_checkpoint`` (what ``ModelCheckpoint`` calls), the HF Trainer's
  ``_save_checkpoint`` (its ``save_steps`` checkpoint), ``Accelerator.save_state``;
- ``params``: the number of parameters the optimizer updates; ``skipped_saves``.

The wrappers call the originals and only read the clock around them.
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TIMINGS_ENV = "FTRUN_BENCH_TIMINGS"
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SCRIPTS = {"lightning": "lightning_ddp.py", "hf": "hf_trainer.py",
           "accelerate": "accelerate_ddp.py"}

steps: list[float] = []
snap_calls: list[list[Any]] = []
ckpt_calls: list[list[float]] = []
snapshotters: list[Any] = []
params = [0]


def framework_save(framework: str) -> tuple[Any, str]:
    """The class and method name of the framework's own checkpoint save."""
    if framework == "lightning":
        import lightning.pytorch as pl

        return pl.Trainer, "save_checkpoint"
    if framework == "hf":
        import transformers

        return transformers.Trainer, "_save_checkpoint"
    import accelerate

    return accelerate.Accelerator, "save_state"


def timed(original: Callable[..., Any], record: Callable[[float, float, Any, Any], None]
          ) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = original(self, *args, **kwargs)
        record(t0, time.perf_counter(), self, out)
        return out

    return wrapper


def on_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    # Lightning's and accelerate's optimizer wrappers subclass torch's Optimizer too; only
    # the optimizer that updates the parameters counts.
    if type(optimizer).__module__.startswith("torch."):
        if not params[0]:
            params[0] = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
        steps.append(time.perf_counter())


def install(framework: str) -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from ftrun.rank.save import Saver
    from ftrun.rank.snapshotter import Snapshotter
    from ftrun.rank.state import TrainingState

    register_optimizer_step_post_hook(on_step)

    def snap_record(kind: str) -> Callable[[float, float, Any, Any], None]:
        def record(t0: float, t1: float, snap: Any, out: Any) -> None:
            snap_calls.append([kind, t0, t1, bool(out), snap.every, snap.skipped_saves])
        return record

    def nested(kind: str) -> Callable[[float, float, Any, Any], None]:
        def record(t0: float, t1: float, _self: Any, _out: Any) -> None:
            snap_calls.append([kind, t0, t1, False, 0, 0])
        return record

    Saver.wait = timed(Saver.wait, nested("copy-wait"))
    TrainingState.capture = timed(TrainingState.capture, nested("capture"))
    Saver.ensure_segments = timed(Saver.ensure_segments, nested("buffers"))
    Snapshotter.save = timed(Snapshotter.save, snap_record("save"))
    Snapshotter.wait = timed(Snapshotter.wait, snap_record("wait"))
    init = Snapshotter.__init__

    @functools.wraps(init)
    def keep(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        snapshotters.append(self)

    Snapshotter.__init__ = keep
    cls, name = framework_save(framework)
    setattr(cls, name, timed(getattr(cls, name),
                             lambda t0, t1, _self, _out: ckpt_calls.append([t0, t1])))


def dump() -> None:
    out = os.environ.get(TIMINGS_ENV)
    if not out:
        return
    rank = int(os.environ.get("RANK", "0"))
    record = {"rank": rank, "pid": os.getpid(), "steps": steps, "snap": snap_calls,
              "ckpt": ckpt_calls, "params": params[0],
              "snapshots_enabled": any(s.enabled for s in snapshotters),
              "skipped_saves": sum(s.skipped_saves for s in snapshotters)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in SCRIPTS:
        raise SystemExit(f"usage: {sys.argv[0]} {{{'|'.join(SCRIPTS)}}} [example flags...]")
    framework = sys.argv[1]
    script = EXAMPLES / SCRIPTS[framework]
    install(framework)
    sys.argv = [str(script), *sys.argv[2:]]
    sys.path.insert(0, str(EXAMPLES))  # the examples import examples/user_ddp.py
    code: int | str | None = 0
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        code = e.code
    if code in (0, None):
        dump()
    return code if isinstance(code, int) else 1


if __name__ == "__main__":
    sys.exit(main())
