"""Lightning, the HF Trainer and Accelerate restart in place under ``@ftrun.resilient``.

Each framework's example (examples/lightning_ddp.py, hf_trainer.py, accelerate_ddp.py) runs
with ``--resilient``: its training function, from building the model to the framework's
``fit``/``train``/loop, is decorated the way a user decorates theirs. One launcher x 3 ranks
(gloo, CPU); rank 1 is SIGKILLed after an optimizer step in the second epoch (Lightning's
rank 1 also raises instead, in a run of its own: its exception goes through Lightning's own
teardown first). Each case asserts that:

- the fault fired (its marker file, the script's line);
- only rank 1 got a new process: ranks 0 and 2 kept theirs (``--pid-log``: every step's pid),
  and the launcher's recovery event says ``in_process``, new process for [1], kept [0, 2];
- the framework's own counters carried on from the step every rank resumed from, in every
  process, the survivors' second run included (Lightning's global step, epoch and batch of the
  epoch; the Trainer's global step and epoch; accelerate's loader epoch and scheduler steps),
  and the survivors' pid logs go on from there in the same process;
- the final weights are bit-identical to the same script's fault-free run.

What had to change for it: accelerate's ``PartialState`` sets the process group up once per
process and keeps it, so the survivors' second ``Accelerator()`` built on the old, aborted
world (``prepare`` failed: no default process group). ftrun.integrations.accelerate and
.transformers reset accelerate's process-wide state before each re-run
(``ftrun.rank.resilient.before_rerun``). Lightning needed nothing: a new ``Trainer`` sets up
the new world's process group.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import FULL_MATRIX, ROOT, Procs, free_port, read_events

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("exact_steps")]

WORLD, FAULT_RANK = 3, 1


@dataclass(frozen=True)
class Example:
    name: str  # the script's prefix in its output
    marker: str  # its fault's marker file, in --fault-dir (once per job)
    script: str
    args: tuple[str, ...]
    steps: int  # in all
    steps_per_epoch: int
    fault_step: int  # the default; a case may move it
    final: str  # the regex of rank 0's last line, capturing the digest

    def counters(self, step: int) -> str:
        """The line each process prints where it starts training from ``step``."""
        epoch, batch = divmod(step, self.steps_per_epoch)
        if self.name == "lightning-ddp":
            return f"trains from global_step={step} epoch={epoch} batch_idx={batch}"
        if self.name == "hf-trainer":
            return f"trains from global_step={step} epoch={step / self.steps_per_epoch:g}"
        # accelerate: the loader's epoch counter is that of the snapshot's step (the script's
        # set_epoch moves it on when the next epoch begins); the prepared scheduler steps
        # once per process per optimizer step.
        epoch = max(step - 1, 0) // self.steps_per_epoch
        return f"trains from step={step} epoch={epoch} scheduler_steps={WORLD * step}"


EXAMPLES = {e.name: e for e in (
    # 144 training samples / 3 ranks / batch 8 = 6 steps per epoch, 2 epochs, validation
    # twice an epoch; the fault in step 9: epoch 1, after its first validation.
    Example("lightning-ddp", "lightning-fault", "lightning_ddp.py", ("--samples", "192", "--epochs", "2"),
            12, 6, 9, r"lightning-ddp: step=12 world=3 params_xxh3=([0-9a-f]+)"),
    # 48 samples / 3 ranks / batch 4 = 4 steps per epoch, 10 steps.
    Example("hf-trainer", "hf-trainer-fault", "hf_trainer.py", ("--samples", "48", "--max-steps", "10"),
            10, 4, 6, r"hf-trainer: step=10 world=3 params_xxh3=([0-9a-f]+)"),
    # 96 samples / 3 ranks / batch 8 = 4 steps per epoch, 2 epochs.
    Example("accelerate-ddp", "accelerate-ddp-fault", "accelerate_ddp.py", ("--samples", "96", "--epochs", "2"),
            8, 4, 6, r"accelerate-ddp: step=8 world=3 params_xxh3=([0-9a-f]+)"),
)}


@dataclass(frozen=True)
class Job:
    digest: str
    out: str
    events: list[dict[str, Any]]


def run_job(procs: Procs, tmp: Path, ex: Example, *args: str) -> Job:
    run_id = f"fwip-{uuid.uuid4().hex[:8]}"
    workdir = tmp / "work"
    workdir.mkdir()
    dirs = {"lightning-ddp": ("--root-dir", str(workdir)),
            "hf-trainer": ("--output-dir", str(workdir)),
            "accelerate-ddp": ("--save-dir", str(workdir))}[ex.name]
    proc: subprocess.Popen[str] = procs.ftrun(
        "--nnodes", "1", "--nproc-per-node", str(WORLD), "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", run_id,
        "--max-restarts", "2", str(ROOT / "examples" / ex.script), *ex.args, *dirs,
        "--fault-dir", str(tmp), "--pid-log", str(tmp), *args,
        env={"FTRUN_STATE_DIR": str(tmp / "state")}, name=ex.name)
    code = procs.wait(proc, 200)
    out = procs.output(proc)
    assert code == 0, f"exit code {code}\n{out[-6000:]}"
    digests = re.findall(ex.final, out)
    assert len(digests) == 1, out[-6000:]
    return Job(digests[0], out, read_events(tmp / "state", run_id))


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each example's digest without a fault (and without the decorator), once per module."""
    digests = {}
    for ex in EXAMPLES.values():
        tmp = tmp_path_factory.mktemp(f"{ex.name}-fault-free")
        procs = Procs(tmp)
        try:
            digests[ex.name] = run_job(procs, tmp, ex).digest
        finally:
            procs.cleanup()
    return digests


def step_log(tmp: Path, rank: int) -> list[tuple[int, str]]:
    """(step, pid) for every step rank ``rank`` completed, in order."""
    return [(int(step), pid) for step, pid, _ in
            (line.split() for line in (tmp / f"pids-rank{rank}.log").read_text().splitlines())]


@pytest.mark.parametrize("name, mode, fault_step", [
    ("lightning-ddp", "kill", 9),  # Lightning's one fault in CI (its lost host: full matrix)
    # (a raise in place is also test_inprocess's and test_fault_points'.)
    pytest.param("lightning-ddp", "raise", 9, marks=FULL_MATRIX),
    ("hf-trainer", "kill", 6),
    # (accelerate's kill in place is also the epoch-boundary cell's below.)
    pytest.param("accelerate-ddp", "kill", 6, marks=FULL_MATRIX),
    # Resumes from step 4, the first epoch's last: the next epoch must draw its order from
    # where that epoch left accelerate's generator, not from that epoch's start (it did:
    # every resume at an epoch's end trained the next epoch on the previous one's order).
    ("accelerate-ddp", "kill", 5),
])
def test_survivors_restart_in_place_and_the_framework_carries_on_bit_identical(
        procs: Procs, tmp_path: Path, fault_free: dict[str, str], name: str, mode: str,
        fault_step: int) -> None:
    ex = dataclasses.replace(EXAMPLES[name], fault_step=fault_step)
    job = run_job(procs, tmp_path, ex, "--resilient", "--fail-mode", mode,
                  "--kill-at-step", str(ex.fault_step), "--kill-rank", str(FAULT_RANK))
    out = job.out
    # The fault fired, once.
    assert (tmp_path / f"{ex.marker}-rank{FAULT_RANK}-step{ex.fault_step}").exists(), \
        "the fault never fired"
    if mode == "kill" and ex.name != "lightning-ddp":  # ftrun.faults.kill_once's line
        said = f"fault injection: SIGKILL rank {FAULT_RANK} in step {ex.fault_step}"
    else:
        verb = "killing" if mode == "kill" else "raising in"
        said = f"{ex.name}: {verb} rank {FAULT_RANK} in step {ex.fault_step}"
    assert out.count(said) == 1, out[-6000:]

    # In place: the launcher's account, and the processes that trained each step.
    rec = [e for e in job.events if e["type"] == "recovery"]
    assert [(e["how"], e["new_processes"], e["kept"]) for e in rec] == \
        [("in_process", [FAULT_RANK], [0, 2])], rec
    logs = {r: step_log(tmp_path, r) for r in range(WORLD)}
    pids = {r: {pid for _, pid in logs[r]} for r in range(WORLD)}
    assert [len(pids[r]) for r in range(WORLD)] == [1, 2, 1], pids
    assert "running the training function again in place" in out

    # Every rank resumed from the same step, the last one before the fault or the one
    # before it (the fault may come before that step's snapshot was taken everywhere).
    if ex.name == "lightning-ddp":
        resumed = [int(s) for s in re.findall(r"ftrun: resumed from the snapshot of step (\d+)",
                                               out)]
    else:
        resumed = [int(s) for s in re.findall(rf"{ex.name}: rank \d resumed from step (\d+)",
                                              out)]
    assert len(resumed) == (1 if ex.name == "lightning-ddp" else WORLD), out[-6000:]
    step = resumed[0]
    assert set(resumed) == {step} and ex.fault_step - 2 <= step < ex.fault_step, resumed
    # The framework's own counters start from that step in every process, the survivors'
    # second run included, not from 0.
    for rank in range(WORLD):
        line = f"{ex.name}: rank {rank} {ex.counters(step)}"
        assert out.count(line) == 1, (line, out[-6000:])
        assert out.count(f"{ex.name}: rank {rank} {ex.counters(0)}") == 1, out[-6000:]
    # The survivors trained up to the fault, then on from the step resumed, to the last
    # step, in the same process.
    for rank in (0, 2):
        steps = [s for s, _ in logs[rank]]
        before = len(steps) - (ex.steps - step)
        assert step <= before <= ex.fault_step and steps == \
            [*range(1, before + 1), *range(step + 1, ex.steps + 1)], steps

    assert job.digest == fault_free[ex.name]
