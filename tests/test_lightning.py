"""PyTorch Lightning with ftrun snapshots: a stock Lightning script, a rank killed mid-epoch.

examples/lightning_ddp.py is written the way Lightning users write scripts (LightningModule
with dropout and a per-step LR schedule, LightningDataModule, Trainer(strategy="ddp"),
validation twice an epoch, the default ModelCheckpoint) plus the ``FtrunSnapshots`` callback.
Two runs of 2 nodes x 2 ranks, started together (Lightning's import is slow; theirs overlap):

- plain ``python --devices 2 --num-nodes 2``, one per node (Lightning's multi-node launch:
  each starts its node's other rank itself): the callback says once that snapshots are off,
  and the final weights are the reference;
- ``ftrun --nnodes 2 --nproc-per-node 2`` on 3 hosts (network namespaces, tests/netns.py:
  each host its own address and memory; the third launcher to join waits as the spare),
  two faults in the one job:

  1. rank 2 SIGKILLed in step 14 (epoch 1 of 9-step epochs): ftrun restarts the workers,
     ``fit()`` resumes from the snapshot of step 13 (not from step 0), Lightning's own
     counters (global step, epoch, batch of the epoch) carry on from there on every rank,
     and the plain DataLoader resumes mid-epoch. The uninterrupted run validated between
     steps 13 and 14, the restored one does not: the RNG states must still meet (they meet
     at the training step, not the forward);
  2. once training moved on (every rank waits at the end of step 16 until the test lets it
     go, ``--hold-at-step``), the host of the training node that is not host 0 (whose
     launcher hosts the rendezvous store and the coordinator) is killed, processes and
     memory: the spare joins, and the job resumes on 4 ranks from memory at a step durable
     at the kill, the lost node's shards taken from their replica on another host.

  The final weights are bit-identical to the reference.

The first tests check the Lightning internals the callback uses (ftrun/integrations/
_lightning.py), so a Lightning upgrade that moves one fails here with its name.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import FULL_MATRIX, ROOT, Procs, free_port, full_matrix
from netns import HostLoss, SpareJob, require_netns

from ftrun.testing.netns import Cluster, unavailable_reason

pytest.importorskip("lightning")

SCRIPT = str(ROOT / "examples" / "lightning_ddp.py")
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
STEPS_PER_EPOCH = 9  # 288 training samples / 4 ranks / batch 8; validation after batches 4, 8
STEPS = 2 * STEPS_PER_EPOCH
KILL_STEP, KILL_RANK = 14, 2  # resumes from 13 (or before): mid-epoch, right after a validation
HOLD_STEP = 16  # a host is lost here, once step 15 is durable: the job resumes from 15 or 16


def test_ftrun_imports_no_lightning() -> None:
    code = ("import sys, ftrun.integrations.lightning; "
            "assert not any(m.split('.')[0] in ('lightning', 'pytorch_lightning') "
            "for m in sys.modules), 'imported Lightning'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_lightning_private_seams_exist_with_the_signatures_used() -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.loops import training_epoch_loop
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    from ftrun.integrations import _lightning
    from ftrun.integrations.lightning import FtrunSnapshots

    assert issubclass(FtrunSnapshots, pl.Callback)
    assert _lightning.frameworks()[0] is pl
    params = inspect.signature(_CheckpointConnector.dump_checkpoint).parameters
    assert list(params) == ["self", "weights_only"]
    for name in ("restore_datamodule", "restore_callbacks", "restore_precision_plugin_state",
                 "restore_loops", "restore_optimizers", "restore_lr_schedulers"):
        assert list(inspect.signature(getattr(_CheckpointConnector, name)).parameters) == \
            ["self"], name
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False)
    assert _lightning.framework_of(trainer) is pl
    connector = trainer._checkpoint_connector
    assert isinstance(connector, _CheckpointConnector) and connector._loaded_checkpoint == {}
    fit_loop = trainer.fit_loop
    for attr in ("_combined_loader", "_data_fetcher", "restarting"):
        assert hasattr(fit_loop, attr), attr
    assert isinstance(fit_loop.epoch_loop.batch_progress.current.processed, int)
    assert isinstance(fit_loop.epoch_progress.current.processed, int)
    assert trainer.strategy.restore_checkpoint_after_setup is False
    assert trainer.ckpt_path is None
    # The warning the callback silences once it resumed a plain DataLoader itself.
    assert _lightning.NOT_RESUMABLE_WARNING in inspect.getsource(training_epoch_loop)


def test_skip_sampler_leaves_out_whole_batches_once() -> None:
    from torch.utils.data import BatchSampler, SequentialSampler

    from ftrun.integrations._lightning import SkipSampler

    batches = BatchSampler(SequentialSampler(range(10)), batch_size=3, drop_last=False)
    original = batches.sampler
    batches.sampler = SkipSampler(batches, 6)
    assert list(batches) == [[6, 7, 8], [9]]
    assert batches.sampler is original  # the next epoch starts at the beginning
    assert list(batches) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


def start_plain(procs: Procs, tmp: Path, *args: str) -> list[subprocess.Popen[str]]:
    """The script under plain python, Lightning's multi-node launch: one ``python`` per node
    (NODE_RANK, MASTER_ADDR, MASTER_PORT), each starting its node's other rank itself, in its
    process group (see :func:`end_groups`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTRUN_")}
    env.update(PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    nodes = []
    for node in range(NODES):
        out = open(tmp / f"plain-node{node}.log", "w+")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, SCRIPT, "--devices", str(PER_NODE), "--num-nodes", str(NODES),
             "--root-dir", str(tmp / "plain"), *args], stdout=out, stderr=subprocess.STDOUT,
            text=True, env={**env, "NODE_RANK": str(node)}, cwd=tmp, start_new_session=True)
        proc.log_path = out.name  # type: ignore[attr-defined]
        procs.procs.append(proc)
        nodes.append(proc)
    return nodes


def end_groups(nodes: list[subprocess.Popen[str]]) -> None:
    """Lightning's children exit with their node's first process: make sure none outlives
    the test, also once that one is gone (``Procs.cleanup`` kills live leaders' groups only)."""
    for proc in nodes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def finish(procs: Procs, nodes: list[subprocess.Popen[str]]) -> str:
    """The output of a job's launchers, together, once all exited 0."""
    codes = [procs.wait(p, 240) for p in nodes]
    out = "\n".join(procs.output(p) for p in nodes)
    assert codes == [0] * len(nodes), f"exit codes {codes}\n{out[-6000:]}"
    return out


@dataclass(frozen=True)
class Faulted:
    job: SpareJob  # on 3 hosts: rank KILL_RANK killed in step KILL_STEP, later a host lost
    loss: HostLoss


@dataclass(frozen=True)
class Runs:
    tmp: Path
    plain: str  # the fault-free run's output: plain python, both nodes
    faulted: Faulted | None  # None where network namespaces are unavailable


def start_faulted(hosts: contextlib.ExitStack, tmp: Path) -> SpareJob:
    (tmp / "hosts").mkdir()
    c = hosts.enter_context(Cluster(NODES + 1, tmp / "hosts", tmp / "state"))
    job = SpareJob(c, c.state_dir, "faulted")
    # The resume step is checked: each step waits for its snapshot buffer (see exact_steps).
    job.start_script(PER_NODE, SCRIPT, "--root-dir", str(tmp / "faulted"), "--fault-dir",
                     str(tmp), "--kill-at-step", str(KILL_STEP), "--kill-rank", str(KILL_RANK),
                     "--hold-at-step", str(HOLD_STEP), env={"FTRUN_SNAPSHOT_WAIT": "60"})
    return job


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    tmp = tmp_path_factory.mktemp("lightning")
    procs = Procs(tmp)
    plain: list[subprocess.Popen[str]] = []
    try:
        with contextlib.ExitStack() as hosts:
            # The faulted job needs namespaces; the plain run (the reference) does not. It is a
            # further cell (FTRUN_FULL_MATRIX=1): CI has Lightning's in-place restart
            # (test_framework_inplace) and a lost host under HF's Trainer (test_hf).
            job = None if unavailable_reason() or not full_matrix() else start_faulted(hosts, tmp)
            plain = start_plain(procs, tmp)
            faulted = None
            if job is not None:
                loss = job.lose_a_host([tmp / f"lightning-held-rank{r}" for r in range(WORLD)],
                                       tmp / "lightning-release", durable=HOLD_STEP - 1)
                job.c.succeed(job.live(), 240)
                faulted = Faulted(job, loss)
            plain_out = finish(procs, plain)
            end_groups(plain)
        yield Runs(tmp, plain_out, faulted)
    finally:
        procs.cleanup()
        end_groups(plain)


def digest(out: str) -> str:
    found = re.findall(rf"lightning-ddp: step={STEPS} world={WORLD} params_xxh3=([0-9a-f]+)", out)
    assert len(found) == 1, out[-6000:]
    return found[0]


def starts(out: str) -> list[tuple[int, int, int, int]]:
    """(rank, global step, epoch, batch index) of each process's first training batch."""
    return sorted(tuple(map(int, m)) for m in re.findall(
        r"lightning-ddp: rank (\d) trains from global_step=(\d+) epoch=(\d+) batch_idx=(\d+)",
        out))


def test_plain_python_runs_and_says_once_that_snapshots_are_off(runs: Runs) -> None:
    assert runs.plain.count("ftrun snapshots are off") == 1, runs.plain[-6000:]
    assert f"Starting with {WORLD} processes" in runs.plain
    assert starts(runs.plain) == [(r, 0, 0, 0) for r in range(WORLD)], runs.plain[-6000:]
    digest(runs.plain)


@pytest.mark.integration
@FULL_MATRIX
def test_killed_rank_then_lost_host_resume_from_snapshots_bit_identical(runs: Runs) -> None:
    require_netns()
    assert runs.faulted is not None
    job, loss = runs.faulted.job, runs.faulted.loss
    out = job.output()
    assert (runs.tmp / f"lightning-fault-rank{KILL_RANK}-step{KILL_STEP}").exists(), \
        "the fault never fired"
    assert f"killing rank {KILL_RANK} in step {KILL_STEP}" in out
    # Two resumes, in the coordinator's event log: after the killed rank, after the lost host.
    first, second = [e["step"] for e in job.restores()]
    # The snapshot of the kill step may not be complete on every rank: it resumes from the
    # newest one that is (replication, on by default, can hold back the one before).
    assert STEPS_PER_EPOCH < first <= KILL_STEP, (first, out[-6000:])
    # The lost host's shards came from their replica on its peer, at a step at least as new
    # as the one durable at the kill: training had moved on from the first resume.
    assert job.check_replica_restore(loss, WORLD) == second and first < second <= HOLD_STEP
    # Rank 0 says which snapshot it resumed from, and where it came from.
    resumed = re.findall(r"ftrun: resumed from the snapshot of step (\d+) "
                         r"\((memory(?: \(from node\(s\) [^()]+\))?|[^()]*)\): epoch", out)
    assert sorted(int(s) for s, _ in resumed) == [first, second], resumed
    [source] = [src for s, src in resumed if int(s) == second]
    assert source.startswith("memory"), resumed
    expected = job.replica_sources(loss)
    if 0 in expected:  # rank 0 took over a rank of the lost host
        assert source == expected[0], (resumed, loss)
    # Lightning's own counters carry on from the restored steps on every rank, not from 0:
    # global step, epoch 1, and the batch of the epoch after those already trained.
    fresh = [(r, 0, 0, 0) for r in range(WORLD)]
    assert starts(out) == sorted(fresh + [(r, s, *divmod(s, STEPS_PER_EPOCH))
                                          for s in (first, second) for r in range(WORLD)]), \
        out[-6000:]
    # Mid-epoch: the plain DataLoader skipped what epoch 1 had trained already.
    for step in (first, second):
        skipped = step - STEPS_PER_EPOCH
        assert f"resumes after the {skipped} batches of epoch 1 already trained" in out
    assert digest(out) == digest(runs.plain)
