"""Hugging Face Trainer and Accelerate scripts under ftrun: a killed rank, then a lost host.

examples/hf_trainer.py (``Trainer`` + ``add_snapshots``) and examples/accelerate_ddp.py
(``Accelerator`` + ``AcceleratorSnapshotter``) are written the way those users write them.
Each runs as one job of 2 ``ftrun`` launchers x 2 ranks (``--nnodes 2``, c10d rendezvous,
gloo on CPU) twice, at the same time: once without faults, on loopback, and once on 3 hosts
(network namespaces, tests/netns.py: each its own address and memory; the third launcher to
join waits as the spare) with two faults. First rank 2 is SIGKILLed right after its optimizer
step 7 (mid-epoch, in the second epoch); later, once training moved on (every rank waits a
step or two further until the test lets it go, ``--hold-at-step``), the host of the training
node that is not host 0 (whose launcher hosts the rendezvous store and the coordinator) is
killed, processes and memory, and the spare joins. The faulted job must finish with the
fault-free job's final weights, bit for bit, having resumed twice from a snapshot (the
coordinator's event log holds both restores; the second on 4 ranks from memory, at a step
durable at the kill, the lost node's shards from their replica on another host, which the
ranks that took over the lost node's ranks say they read from), with the framework's own counters carrying on from
each restored step, not from 0 (the Trainer's global step, epoch and ``log_history``;
accelerate's loader epoch and scheduler steps). The second epoch matters: the Trainer must
skip a whole epoch and part of the next, and accelerate draws each epoch's order from a
generator that the snapshot has to carry. Each script also runs under plain ``python``,
which says once that snapshots are off and trains as usual.

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
from conftest import FULL_MATRIX, ROOT, Procs, free_port
from netns import (  # noqa: F401  (the fixture)
    Cluster,
    HostLoss,
    SpareJob,
    cluster_fixture,
)

KILL_STEP, KILL_RANK = 7, 2
# Where a rank's snapshot came from, as ftrun says it (two ranks' lines can run together).
SOURCE = r"memory(?: \(from node\(s\) [^()]+\))?|disk[^()]*|none"
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


def check_fault_and_resume(tmp: Path, runs: Runs, prefix: str,
                           snapshot_every: int) -> tuple[int, int]:
    """The fault fired once; the job resumed from the newest snapshot before it, not from 0,
    and after the lost host from the peer's replica of a later step. Returns both steps."""
    assert (tmp / f"{prefix}-fault-rank{KILL_RANK}-step{KILL_STEP}").exists(), "no fault fired"
    one(rf"fault injection: SIGKILL rank {KILL_RANK} in step {KILL_STEP} \({prefix}\)",
        runs.faulted)
    job, loss = runs.job, runs.loss
    first, second = [e["step"] for e in job.restores()]
    # The newest snapshot before the kill (or the one before it, if rank 1's copy of it had
    # not begun yet): never step 0, never a step the killed rank did not finish.
    newest = KILL_STEP - 1 - (KILL_STEP - 1) % snapshot_every
    assert first in (newest, newest - snapshot_every) and first > 0, (first, runs.faulted[-6000:])
    assert job.check_replica_restore(loss, RANKS) == second and first < second
    # The lost host's ranks: the ranks that took them over read their shards from the
    # replica's holder (those on the holder from their own node's store).
    sources = {r: src for r, s, src in resumed(prefix, runs.faulted) if s == second}
    expected = job.replica_sources(loss)
    assert {r: sources.get(r) for r in expected} == expected, (sources, loss)
    return first, second


def resumed(prefix: str, out: str) -> list[tuple[int, int, str]]:
    """(rank, step, where from) of each ``resumed from step`` line the script printed."""
    return sorted((int(r), int(s), src) for r, s, src in
                  re.findall(rf"{prefix}: rank (\d) resumed from step (\d+) \(({SOURCE})\)", out))


def check_plain_python(out: str) -> None:
    assert out.count("ftrun snapshots are off") == 1, out[-6000:]


@dataclass(frozen=True)
class Runs:
    clean: str  # the fault-free job's output
    job: SpareJob  # rank KILL_RANK killed after step KILL_STEP, later a host lost
    loss: HostLoss
    plain: str  # the script's output under plain python

    @property
    def faulted(self) -> str:
        return self.job.output()


def run_three(procs: Procs, tmp: Path, c: Cluster, name: str, script: str,
              job_args: tuple[str, ...], plain_args: tuple[str, ...], hold: int, durable: int,
              faulted_launcher: tuple[str, ...] = (), dir_flag: str | None = None) -> Runs:
    """The fault-free job, the faulted one (on ``c``: holds at step ``hold``, where a host is
    lost once step ``durable`` is) and the plain python run, started together (their imports
    overlap); each run gets ``dir_flag tmp/out-<run>`` when given. Waits for all."""
    def own_dir(run: str) -> tuple[str, ...]:
        return (dir_flag, str(tmp / f"out-{run}")) if dir_flag else ()

    clean, _ = start_job(procs, tmp, f"{name}-clean", script, *job_args, *own_dir("clean"))
    job = SpareJob(c, c.state_dir, f"{name}-faulted")
    job.start_script(PER_NODE, script, *job_args, *own_dir("faulted"), "--kill-at-step",
                     str(KILL_STEP), "--kill-rank", str(KILL_RANK), "--fault-dir", str(tmp),
                     "--hold-at-step", str(hold), launcher=faulted_launcher)
    plain = start_python(procs, tmp, script, *plain_args, *own_dir("plain"))
    prefix = Path(script).stem.replace("_", "-")
    loss = job.lose_a_host([tmp / f"{prefix}-held-rank{r}" for r in range(RANKS)],
                           tmp / f"{prefix}-release", durable)
    c.succeed(job.live(), 200)
    return Runs(finish(procs, clean), job, loss, finish(procs, [plain]))


def starts(prefix: str, out: str, counters: str) -> list[tuple[str, ...]]:
    """(rank, counters...) of each process's first step, as the script printed them."""
    return sorted(re.findall(rf"{prefix}: rank (\d) trains from {counters}", out))


@pytest.mark.integration
@pytest.mark.usefixtures("exact_steps")
@FULL_MATRIX  # ~145 s; the Trainer's in-place kill is test_framework_inplace's CI cell
def test_trainer_killed_rank_then_lost_host_resume_bit_identical(procs: Procs, tmp_path: Path,
                                                                  cluster_factory) -> None:
    # 64 samples, 4 ranks x batch 4: 4 steps per epoch, so step 7 is mid-epoch 2 of 3. The
    # faulted job snapshots every 2nd step: its resume also crosses the snapshot interval.
    # The host is lost after step 11, with step 8 durable (a store learns that a step
    # committed when its ranks take the next snapshot, of 10 at the start of step 11, and
    # then replicates it): the job resumes from 8 or 10.
    runs = run_three(procs, tmp_path, cluster_factory(NODES + 1), "hf",
                     str(ROOT / "examples" / "hf_trainer.py"),
                     ("--max-steps", "12", "--samples", "64"), ("--max-steps", "4"),
                     hold=11, durable=8, faulted_launcher=("--snapshot-every", "2"),
                     dir_flag="--output-dir")
    result = r"hf-trainer: step=12 world=4 params_xxh3=([0-9a-f]+) train_loss=(\S+)"
    expected = one(result, runs.clean)
    first, second = check_fault_and_resume(tmp_path, runs, "hf-trainer", snapshot_every=2)
    out = runs.faulted
    got = one(result, out)
    assert got.group(1) == expected.group(1), "final weights differ from the fault-free run"
    # The loop's loss accounts came back too: the reported train_loss is the same float.
    assert got.group(2) == expected.group(2)
    # The ranks that finished say which step they resumed from (the first resume's did not
    # finish).
    assert [(r, s) for r, s, _ in resumed("hf-trainer", out)] == [(r, second) for r in range(RANKS)]
    # The TrainerState carried on from each restored step on every rank, not from 0 ...
    counters = r"global_step=(\d+) epoch=([0-9.]+)"  # two ranks' lines can run together
    fresh = [(str(r), "0", "0") for r in range(RANKS)]
    assert starts("hf-trainer", runs.clean, counters) == fresh, runs.clean[-6000:]
    assert starts("hf-trainer", out, counters) == sorted(
        fresh + [(str(r), str(s), f"{s / 4:g}") for s in (first, second) for r in range(RANKS)]), \
        out[-6000:]
    # ... and its log_history: the logs of before the faults came back, the later ones follow
    # at their own steps, with the uninterrupted run's losses.
    logged = r"hf-trainer: logged \(step, loss\) (.*)"
    assert one(logged, out).group(1) == one(logged, runs.clean).group(1)
    assert re.findall(r"\((\d+), ", one(logged, runs.clean).group(1)) == \
        ["2", "4", "6", "8", "10", "12"]
    check_plain_python(runs.plain)
    one(r"hf-trainer: step=4 world=1 params_xxh3=", runs.plain)


# A further cell: a lost host under a framework is also the Trainer's (above) and Lightning's
# (FTRUN_FULL_MATRIX too); accelerate's kill and epoch-boundary resumes, test_framework_inplace.
@pytest.mark.integration
@pytest.mark.usefixtures("exact_steps")
@FULL_MATRIX
def test_accelerate_killed_rank_then_lost_host_resume_bit_identical(procs: Procs,
                                                                     tmp_path: Path,
                                                                     cluster_factory) -> None:
    # 128 samples, 4 ranks x batch 8: 4 steps per epoch, 3 epochs; step 7 is in epoch 2. The
    # host is lost after step 10, with step 9 durable: the job resumes from 9 or 10.
    runs = run_three(procs, tmp_path, cluster_factory(NODES + 1), "acc",
                     str(ROOT / "examples" / "accelerate_ddp.py"),
                     ("--epochs", "3", "--samples", "128"), ("--epochs", "1"), hold=10, durable=9)
    # The prepared scheduler steps once per process per optimizer step.
    result = (r"accelerate-ddp: step=12 world=4 params_xxh3=([0-9a-f]+) "
              rf"scheduler_steps={12 * RANKS}\n")
    expected = one(result, runs.clean).group(1)
    first, second = check_fault_and_resume(tmp_path, runs, "accelerate-ddp", snapshot_every=1)
    out = runs.faulted
    assert one(result, out).group(1) == expected, "final weights differ from the fault-free run"
    # Every rank says which step it resumed from, both times.
    assert [(r, s) for r, s, _ in resumed("accelerate-ddp", out)] == \
        sorted((r, s) for s in (first, second) for r in range(RANKS))
    # The script's step and accelerate's counters carried on from each restored step on every
    # rank: the loader's epoch and the scheduler's steps are the snapshot's, not 0.
    counters = r"step=(\d+) epoch=(\d+) scheduler_steps=(\d+)"
    fresh = [(str(r), "0", "0", "0") for r in range(RANKS)]
    assert starts("accelerate-ddp", runs.clean, counters) == fresh, runs.clean[-6000:]
    assert starts("accelerate-ddp", out, counters) == sorted(
        fresh + [(str(r), str(s), str(s // 4), str(s * RANKS))
                 for s in (first, second) for r in range(RANKS)]), out[-6000:]
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


def test_accelerate_state_is_reset_before_an_in_place_rerun() -> None:
    """accelerate's singletons (``_reset_state``, a private static method on each) are what
    the integrations clear before ``@ftrun.resilient`` runs the function again: a
    ``PartialState`` set up in the old world is forgotten, and the next one sets up anew.
    Importing either integration registers the reset; a reset that fails stops the re-run
    with an FtrunError naming it."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    import ftrun.integrations.accelerate  # noqa: F401  (registers the reset)
    import ftrun.integrations.transformers  # noqa: F401  (the same reset, once)
    from ftrun.errors import FtrunError
    from ftrun.integrations import _hf
    from ftrun.rank import resilient

    assert list(inspect.signature(AcceleratorState._reset_state).parameters) == \
        ["reset_partial_state"]
    for cls in (PartialState, GradientState):
        assert list(inspect.signature(cls._reset_state).parameters) == [], cls
    assert list(resilient._RERUN_HOOKS.items()) == \
        [("accelerate's state", _hf.reset_accelerate_state)]

    assert PartialState(cpu=True).initialized and GradientState().initialized
    resilient._run_rerun_hooks()
    assert PartialState._shared_state == {} and AcceleratorState._shared_state == {}
    assert GradientState._shared_state == {}
    assert PartialState(cpu=True).initialized  # sets up again, in the world of os.environ

    def broken() -> None:
        raise RuntimeError("no such state")

    resilient.before_rerun("a broken framework", broken)
    try:
        with pytest.raises(FtrunError, match="reset of a broken framework failed: "
                                             "RuntimeError: no such state"):
            resilient._run_rerun_hooks()
    finally:
        del resilient._RERUN_HOOKS["a broken framework"]


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
