"""Hugging Face Trainer and Accelerate scripts under ftrun: a killed rank ends bit-identical.

examples/hf_trainer.py (``Trainer`` + ``add_snapshots``) and examples/accelerate_ddp.py
(``Accelerator`` + ``AcceleratorSnapshotter``) are written the way those users write them.
Each runs as one job of 2 ``ftrun`` launchers x 2 ranks (``--nnodes 2``, c10d rendezvous,
gloo on CPU) twice, at the same time: once without faults, and once with rank 2 SIGKILLed
right after its optimizer step 7 (mid-epoch, in the second epoch). The faulted job must
finish with the fault-free job's final weights, bit for bit, having resumed from a snapshot
(every rank says from which step; the coordinator's event log holds the restore), with the
framework's own counters carrying on from that step, not from 0 (the Trainer's global step,
epoch and ``log_history``; accelerate's loader epoch and scheduler steps). The second epoch
matters: the Trainer must skip a whole epoch and part of the next, and accelerate draws each
epoch's order from a generator that the snapshot has to carry. Each script also runs under
plain ``python``, which says once that snapshots are off and trains as usual.

transformers' import is slow (seconds per process), so each framework's three runs go
together, and the seam test checks the private parts the integration relies on without
training anything.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT, Procs, free_port, read_events

KILL_STEP, KILL_RANK = 7, 2
NODES, PER_NODE = 2, 2
RANKS = NODES * PER_NODE


def start_python(procs: Procs, tmp: Path, script: str, *args: str) -> subprocess.Popen[str]:
    """``python script args`` with no ftrun around it, reaped by ``procs.cleanup()``."""
    out = open(tmp / f"python-{Path(script).stem}.log", "w+")  # noqa: SIM115
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTRUN_")}
    proc = subprocess.Popen([sys.executable, script, *args], stdout=out, stderr=subprocess.STDOUT,
                            text=True, env={**env, "PYTHONUNBUFFERED": "1"}, cwd=ROOT,
                            start_new_session=True)
    proc.log_path = out.name  # type: ignore[attr-defined]
    procs.procs.append(proc)
    return proc


def start_job(procs: Procs, tmp: Path, name: str, script: str, *args: str,
              launcher: tuple[str, ...] = ()) -> tuple[list[subprocess.Popen[str]], str]:
    """One job on NODES ftrun launchers x PER_NODE ranks; returns (launchers, run id)."""
    run_id = f"{name}-{uuid.uuid4().hex[:8]}"
    common = ("--nnodes", str(NODES), "--nproc-per-node", str(PER_NODE), "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", run_id,
              "--max-restarts", "2", *launcher, script, *args)
    env = {"FTRUN_STATE_DIR": str(tmp / "state")}
    return [procs.ftrun(*common, env=env, name=f"{name}-node{i}") for i in range(NODES)], run_id


def finish(procs: Procs, launchers: list[subprocess.Popen[str]], timeout_s: float = 200) -> str:
    """The launchers' output, together, once all exited 0."""
    codes = [procs.wait(p, timeout_s) for p in launchers]
    out = "\n".join(procs.output(p) for p in launchers)
    assert codes == [0] * len(launchers), f"exit codes {codes}\n{out[-6000:]}"
    return out


def one(pattern: str, out: str) -> re.Match[str]:
    found = list(re.finditer(pattern, out))
    assert len(found) == 1, f"{pattern!r} found {len(found)} times\n{out[-6000:]}"
    return found[0]


def check_fault_and_resume(tmp: Path, out: str, run_id: str, prefix: str,
                           snapshot_every: int) -> int:
    """The fault fired once, and every rank resumed from the same snapshot, not from 0."""
    assert (tmp / f"{prefix}-fault-rank{KILL_RANK}-step{KILL_STEP}").exists(), "no fault fired"
    one(rf"fault injection: SIGKILL rank {KILL_RANK} in step {KILL_STEP} \({prefix}\)", out)
    resumed = re.findall(rf"{prefix}: rank (\d) resumed from step (\d+)", out)
    assert sorted(int(r) for r, _ in resumed) == list(range(RANKS)), out[-6000:]
    steps = {int(s) for _, s in resumed}
    assert len(steps) == 1, resumed
    step = steps.pop()
    # The newest snapshot before the kill (or the one before it, if rank 1's copy of it had
    # not begun yet): never step 0, never a step the killed rank did not finish.
    newest = KILL_STEP - 1 - (KILL_STEP - 1) % snapshot_every
    assert step in (newest, newest - snapshot_every) and step > 0, (step, out[-6000:])
    restores = [e for e in read_events(tmp / "state", run_id)
                if e["type"] == "restore" and e["step"]]
    assert [e["step"] for e in restores] == [step], restores
    return step


def check_plain_python(out: str) -> None:
    assert out.count("ftrun snapshots are off") == 1, out[-6000:]


@dataclass(frozen=True)
class Runs:
    clean: str  # the fault-free job's output
    faulted: str  # the output of the job whose rank KILL_RANK was killed after step KILL_STEP
    run_id: str  # the faulted job's
    plain: str  # the script's output under plain python


def run_three(procs: Procs, tmp: Path, name: str, script: str, job_args: tuple[str, ...],
              plain_args: tuple[str, ...], faulted_launcher: tuple[str, ...] = (),
              dir_flag: str | None = None) -> Runs:
    """The fault-free job, the faulted one and the plain python run, started together (their
    imports overlap); each run gets ``dir_flag tmp/out-<run>`` when given. Waits for all."""
    def own_dir(run: str) -> tuple[str, ...]:
        return (dir_flag, str(tmp / f"out-{run}")) if dir_flag else ()

    clean, _ = start_job(procs, tmp, f"{name}-clean", script, *job_args, *own_dir("clean"))
    faulted, run_id = start_job(procs, tmp, f"{name}-faulted", script, *job_args,
                                *own_dir("faulted"), "--kill-at-step", str(KILL_STEP),
                                "--kill-rank", str(KILL_RANK), "--fault-dir", str(tmp),
                                launcher=faulted_launcher)
    plain = start_python(procs, tmp, script, *plain_args, *own_dir("plain"))
    return Runs(finish(procs, clean), finish(procs, faulted), run_id, finish(procs, [plain]))


def starts(prefix: str, out: str, counters: str) -> list[tuple[str, ...]]:
    """(rank, counters...) of each process's first step, as the script printed them."""
    return sorted(re.findall(rf"{prefix}: rank (\d) trains from {counters}", out))


@pytest.mark.integration
@pytest.mark.usefixtures("exact_steps")
def test_trainer_killed_rank_resumes_from_snapshot_bit_identical(procs: Procs,
                                                                 tmp_path: Path) -> None:
    # 64 samples, 4 ranks x batch 4: 4 steps per epoch, so step 7 is mid-epoch 2 of 3. The
    # faulted job snapshots every 2nd step: its resume also crosses the snapshot interval.
    runs = run_three(procs, tmp_path, "hf", str(ROOT / "examples" / "hf_trainer.py"),
                     ("--max-steps", "10", "--samples", "64"), ("--max-steps", "4"),
                     faulted_launcher=("--snapshot-every", "2"), dir_flag="--output-dir")
    result = r"hf-trainer: step=10 world=4 params_xxh3=([0-9a-f]+) train_loss=(\S+)"
    expected = one(result, runs.clean)
    step = check_fault_and_resume(tmp_path, runs.faulted, runs.run_id, "hf-trainer",
                                  snapshot_every=2)
    got = one(result, runs.faulted)
    assert got.group(1) == expected.group(1), "final weights differ from the fault-free run"
    # The loop's loss accounts came back too: the reported train_loss is the same float.
    assert got.group(2) == expected.group(2)
    # The TrainerState carried on from the restored step on every rank, not from 0 ...
    counters = r"global_step=(\d+) epoch=([0-9.]+)"  # two ranks' lines can run together
    fresh = [(str(r), "0", "0") for r in range(RANKS)]
    assert starts("hf-trainer", runs.clean, counters) == fresh, runs.clean[-6000:]
    assert starts("hf-trainer", runs.faulted, counters) == sorted(
        fresh + [(str(r), str(step), f"{step / 4:g}") for r in range(RANKS)]), runs.faulted[-6000:]
    # ... and its log_history: the logs of before the fault came back, the later ones follow
    # at their own steps, with the uninterrupted run's losses.
    logged = r"hf-trainer: logged \(step, loss\) (.*)"
    assert one(logged, runs.faulted).group(1) == one(logged, runs.clean).group(1)
    assert re.findall(r"\((\d+), ", one(logged, runs.clean).group(1)) == ["2", "4", "6", "8", "10"]
    check_plain_python(runs.plain)
    one(r"hf-trainer: step=4 world=1 params_xxh3=", runs.plain)


@pytest.mark.integration
@pytest.mark.usefixtures("exact_steps")
def test_accelerate_killed_rank_resumes_from_snapshot_bit_identical(procs: Procs,
                                                                    tmp_path: Path) -> None:
    # 128 samples, 4 ranks x batch 8: 4 steps per epoch, 3 epochs; step 7 is in epoch 2.
    runs = run_three(procs, tmp_path, "acc", str(ROOT / "examples" / "accelerate_ddp.py"),
                     ("--epochs", "3", "--samples", "128"), ("--epochs", "1"))
    # The prepared scheduler steps once per process per optimizer step.
    result = (r"accelerate-ddp: step=12 world=4 params_xxh3=([0-9a-f]+) "
              rf"scheduler_steps={12 * RANKS}\n")
    expected = one(result, runs.clean).group(1)
    step = check_fault_and_resume(tmp_path, runs.faulted, runs.run_id, "accelerate-ddp",
                                  snapshot_every=1)
    assert one(result, runs.faulted).group(1) == expected, \
        "final weights differ from the fault-free run"
    # The script's step and accelerate's counters carried on from the restored step on every
    # rank: the loader's epoch and the scheduler's steps are the snapshot's, not 0.
    counters = r"step=(\d+) epoch=(\d+) scheduler_steps=(\d+)"
    fresh = [(str(r), "0", "0", "0") for r in range(RANKS)]
    assert starts("accelerate-ddp", runs.clean, counters) == fresh, runs.clean[-6000:]
    assert starts("accelerate-ddp", runs.faulted, counters) == sorted(
        fresh + [(str(r), str(step), str(step // 4), str(step * RANKS)) for r in range(RANKS)]), \
        runs.faulted[-6000:]
    check_plain_python(runs.plain)
    one(r"accelerate-ddp: step=12 world=1 params_xxh3=", runs.plain)


def test_hf_private_seams() -> None:
    """The internals ftrun.integrations._hf relies on, in the installed releases."""
    import dataclasses

    from accelerate import Accelerator
    from accelerate.data_loader import DataLoaderShard
    from transformers import Trainer, TrainerState

    from ftrun.integrations import _hf
    from ftrun.integrations.transformers import PROGRESS_FIELDS

    _hf.check_trainer(Trainer)  # _run_epoch and _load_rng_state take what the wrapper passes
    assert set(PROGRESS_FIELDS) <= {f.name for f in dataclasses.fields(TrainerState)}
    # The loop's accounts are set before on_train_begin, where ftrun restores them (FLOPs in
    # __init__), and the loop does not reset them after it.
    loop = inspect.getsource(Trainer._inner_training_loop)
    start, after = loop.split("on_train_begin", 1)
    assigned = start + inspect.getsource(Trainer.__init__)
    for attr in _hf.LOOP_ATTRS:
        assert f"self.{attr} =" in assigned and f"self.{attr} =" not in after, attr
    # It resumes through _run_epoch's resume_from_checkpoint, which it also reloads RNG with.
    epoch = inspect.getsource(Trainer._run_epoch)
    assert "skip_first_batches" in epoch and "self._load_rng_state(resume_from_checkpoint)" in epoch
    # accelerate: what save_state saves, in these lists; a loader records each epoch's start
    # in set_epoch, which its __iter__ calls after syncing the generator, before drawing.
    init = inspect.getsource(Accelerator.__init__)
    for attr in _hf.ACCELERATOR_LISTS:
        assert f"self.{attr} = []" in init, attr
    it = inspect.getsource(DataLoaderShard.__iter__)
    assert it.index("synchronize_rng_states") < it.index("self.set_epoch(") < \
        it.index("self.base_dataloader.__iter__()")
    assert "synchronized_generator" in inspect.signature(DataLoaderShard).parameters


def test_accelerator_snapshotter_refuses_what_it_cannot_snapshot() -> None:
    """A model the accelerator did not prepare, or two models: a ConfigError that says so."""
    import torch
    from accelerate import Accelerator

    from ftrun.errors import ConfigError
    from ftrun.integrations.accelerate import AcceleratorSnapshotter

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="pass the model accelerator.prepare"):
        AcceleratorSnapshotter(accelerator, torch.nn.Linear(2, 2))
    accelerator.prepare(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="2 model"):
        AcceleratorSnapshotter(accelerator, model)
