"""PyTorch Lightning with ftrun snapshots: a stock Lightning script, a rank killed mid-epoch.

examples/lightning_ddp.py is written the way Lightning users write scripts (LightningModule
with dropout and a per-step LR schedule, LightningDataModule, Trainer(strategy="ddp"),
validation twice an epoch, the default ModelCheckpoint) plus the ``FtrunSnapshots`` callback.
Two runs:

- plain ``python --devices 3``: Lightning starts the other two processes itself; the callback
  says once that snapshots are off, and the final weights are the reference;
- ``ftrun --nproc-per-node 3``, rank 1 SIGKILLed in step 19 (epoch 1 of 12-step epochs):
  ftrun restarts the workers, ``fit()`` resumes from the snapshot of step 18 (not from step
  0), the plain DataLoader resumes mid-epoch, and the final weights are bit-identical to the
  reference. The uninterrupted run validated between steps 18 and 19, the restored one does
  not: the RNG states must still meet (they meet at the training step, not the forward).

The first tests check the Lightning internals the callback uses (ftrun/integrations/
_lightning.py), so a Lightning upgrade that moves one fails here with its name.
"""

from __future__ import annotations

import inspect
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import ROOT, Procs, read_events

pytest.importorskip("lightning")

SCRIPT = str(ROOT / "examples" / "lightning_ddp.py")
STEPS_PER_EPOCH = 12  # 288 training samples / 3 ranks / batch 8
KILL_STEP = 19  # resumes from 18 (or before): mid-epoch, right after a validation


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


def run_plain(tmp: Path, *args: str) -> tuple[int, str]:
    """The script under plain python; Lightning starts the other ranks itself."""
    log = tmp / "plain.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTRUN_")}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, SCRIPT, *args], stdout=out,
                                stderr=subprocess.STDOUT, env={**env, "PYTHONUNBUFFERED": "1"},
                                cwd=tmp, start_new_session=True)
        try:
            code = proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # Lightning's children are in its group
                proc.wait(timeout=30)
            else:
                # Lightning's children exit with rank 0; make sure none outlives the test.
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    return code, log.read_text()


def digest(out: str) -> str:
    found = re.findall(r"lightning-ddp: step=24 world=3 params_xxh3=([0-9a-f]+)", out)
    assert len(found) == 1, out[-6000:]
    return found[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    tmp = tmp_path_factory.mktemp("lightning-plain")
    code, out = run_plain(tmp, "--devices", "3", "--root-dir", str(tmp))
    assert code == 0, out[-6000:]
    return digest(out), out


def test_plain_python_runs_and_says_once_that_snapshots_are_off(
        reference: tuple[str, str]) -> None:
    _, out = reference
    assert out.count("ftrun snapshots are off") == 1, out[-6000:]
    assert "Starting with 3 processes" in out


@pytest.mark.integration
@pytest.mark.usefixtures("exact_steps")
def test_killed_rank_resumes_from_the_snapshot_bit_identical(
        procs: Procs, tmp_path: Path, reference: tuple[str, str]) -> None:
    run_id = f"lightning-{uuid.uuid4().hex[:8]}"
    state_dir = tmp_path / "state"
    proc = procs.ftrun(
        "--standalone", "--rdzv-id", run_id, "--nproc-per-node", "3", "--max-restarts", "3", SCRIPT,
        "--root-dir", str(tmp_path), "--fault-dir", str(tmp_path),
        "--kill-at-step", str(KILL_STEP), "--kill-rank", "1",
        env={"FTRUN_STATE_DIR": str(state_dir)})
    code = procs.wait(proc, 240)
    out = procs.output(proc)
    assert code == 0, out[-6000:]
    assert (tmp_path / f"lightning-fault-rank1-step{KILL_STEP}").exists(), "the fault never fired"
    assert f"killing rank 1 in step {KILL_STEP}" in out
    # The snapshot of the kill step may not be complete on every rank: it resumes from the
    # newest one that is (replication, on by default, can hold back the one before).
    resumed = [int(s) for s in re.findall(r"ftrun: resumed from the snapshot of step (\d+)", out)]
    assert resumed and STEPS_PER_EPOCH < resumed[0] <= KILL_STEP, out[-6000:]
    assert all(s > STEPS_PER_EPOCH for s in resumed), resumed
    events = read_events(state_dir, run_id)
    assert any(e["type"] == "restore" and e["step"] == resumed[0] for e in events), events
    # Mid-epoch: the plain DataLoader skipped what epoch 1 had trained already.
    skipped = resumed[0] - STEPS_PER_EPOCH
    assert f"resumes after the {skipped} batches of epoch 1 already trained" in out
    assert digest(out) == reference[0]
