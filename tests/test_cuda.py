"""The CUDA and NCCL paths, on a GPU: snapshots of GPU training, the collective monitor on
NCCL, and re-forming an NCCL group in place.

They skip where torch sees no GPU (CI has none), and say so; ``FTRUN_REQUIRE_CUDA=1`` (set by
``bench/gpu.sh``) turns that skip into a failure. One GPU holds one NCCL rank (NCCL refuses
two ranks on one device), so the jobs here run one rank per GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TRAIN, Procs, free_port, read_events, result_line
from test_collectives import JOB, SECRET, Collector

if not torch.cuda.is_available():
    if os.environ.get("FTRUN_REQUIRE_CUDA") == "1":
        raise RuntimeError("FTRUN_REQUIRE_CUDA=1 but torch sees no GPU "
                           f"(torch {torch.__version__}, CUDA {torch.version.cuda})")
    pytest.skip("no GPU: torch.cuda.is_available() is False (FTRUN_REQUIRE_CUDA=1 makes this "
                "a failure)", allow_module_level=True)

GPUS = torch.cuda.device_count()


def _train(procs: Procs, tmp: Path, name: str, *train_args: str) -> dict[str, Any]:
    run_id = f"cuda-{name}-{uuid.uuid4().hex[:6]}"
    result = tmp / f"{name}.json"
    proc = procs.ftrun("--standalone", "--rdzv-id", run_id, "--nproc-per-node", str(GPUS),
                       "--max-restarts", "2", TRAIN, "--steps", "10", "--dim", "256",
                       "--layers", "2", "--batch", str(8 * GPUS), "--snapshot-every", "1",
                       "--result", str(result), *train_args, name=name)
    code = procs.wait(proc, 300)
    out = procs.output(proc)
    assert code == 0, f"exit {code}\n{out[-5000:]}"
    doc = json.loads(result.read_text())
    assert doc["params_xxh3"] in result_line(out)
    doc["run_id"] = run_id
    return doc


@pytest.mark.integration
@pytest.mark.usefixtures("exact_steps")
def test_gpu_training_killed_resumes_from_its_snapshot_bit_identical(
        procs: Procs, state_dir: Path, tmp_path: Path) -> None:
    """examples/train.py on the GPU (NCCL, CUDA tensors snapshotted through pinned memory):
    SIGKILLed in step 6, restarted from the snapshot of step 5, same weights as without."""
    clean = _train(procs, tmp_path, "clean")
    faulted = _train(procs, tmp_path, "kill", "--fail-at-step", "6", "--fail-rank", "0",
                     "--fail-mode", "kill")
    marker = state_dir / "jobs" / faulted["run_id"] / "fault-fired-rank0-step6"
    assert marker.exists(), "the fault never fired"
    assert faulted["resumed_from"] == [5]
    assert faulted["restart_count"] == 1
    assert faulted["params_xxh3"] == clean["params_xxh3"]
    events = read_events(state_dir, faulted["run_id"])
    assert any(e["type"] == "restore" and e["step"] == 5 for e in events)


NCCL_MONITOR = r"""
import time, torch, torch.distributed as dist
from ftrun import _torch
torch.cuda.set_device(0)
dist.init_process_group("nccl")
import ftrun
monitor = ftrun.monitor_collectives()
assert monitor is not None, "no monitor"
t = torch.ones(1 << 20, device="cuda")
for _ in range(20):
    torch.cuda._sleep(20_000_000)  # the all-reduce waits behind ~10 ms of GPU work
    dist.all_reduce(t)
torch.cuda.synchronize()
time.sleep(1.5)  # the last reports
status = _torch.fr_dump(False)["pg_status"]
print("pg_status", status, flush=True)
# With TORCH_NCCL_ENABLE_TIMING NCCL's recorder also counts kernels started: the monitor
# times a collective from its kernel's start, not from its enqueueing behind other work.
assert any(int(st["last_started_collective"]) >= 20 for st in status.values()), status
print("counters", monitor.counters, flush=True)
dist.destroy_process_group()
"""


def test_nccl_collectives_are_counted_from_nccls_recorder(tmp_path: Path) -> None:
    """The monitor reads NCCL's own Flight Recorder: the reports of a one-rank NCCL job
    count its 20 all-reduces in the default group, and the recorder counts their kernels'
    starts (the start a duration is timed from on NCCL). A one-rank all-reduce's kernel is
    over within one reading, so no duration is reported: those need peers to wait for."""
    collector = Collector()
    try:
        script = tmp_path / "rank.py"
        script.write_text(NCCL_MONITOR)
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "1", str(script)],
            env={**os.environ, "FTRUN_DETECT": collector.endpoint, "FTRUN_SECRET":
                 SECRET.decode(), "FTRUN_RUN_ID": JOB, "FTRUN_NODE_ID": "gpu/1",
                 "TORCH_NCCL_ENABLE_TIMING": "1"},
            capture_output=True, text=True, timeout=180, start_new_session=True)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    finally:
        collector.close()
    reports = collector.reports
    assert reports and all(r["backend"] == "nccl" for r in reports), reports[:2]
    [world] = [g for g in reports[-1]["groups"] if g["pg"] == "0"]
    assert world["completed"] + 1 >= 20 and world["enqueued"] == world["completed"], world
    assert world["waiting_s"] is None, world


REFORM = r"""
import datetime, os, torch, torch.distributed as dist
from ftrun import _torch
torch.cuda.set_device(0)
store = dist.TCPStore("127.0.0.1", int(os.environ["PORT"]), 1, True,
                      timeout=datetime.timedelta(seconds=60))
dist.init_process_group("nccl", store=dist.PrefixStore("world0", store), rank=0, world_size=1)
t = torch.ones(1 << 20, device="cuda")
dist.all_reduce(t)
for n in range(1, 4):
    torch.cuda._sleep(200_000_000)  # the next all-reduce is still queued when we abort
    work = dist.all_reduce(t, async_op=True)
    _torch.abort_process_groups()
    assert not dist.is_initialized()
    dist.init_process_group("nccl", store=dist.PrefixStore(f"world{n}", store), rank=0,
                            world_size=1)
    t = torch.full((1 << 20,), float(n), device="cuda")
    dist.all_reduce(t)
    assert t.sum().item() == n * (1 << 20), t[:4]
dist.destroy_process_group()
print("ok", flush=True)
"""


def test_nccl_group_aborted_with_work_in_flight_re_forms_in_the_same_process(
        tmp_path: Path) -> None:
    """An NCCL group aborted while an all-reduce is queued behind GPU work; a new default
    group forms in the same process (same CUDA context) and computes correctly, three times."""
    proc = subprocess.run([sys.executable, "-c", REFORM], capture_output=True, text=True,
                          timeout=180, env={**os.environ, "PORT": str(free_port()),
                                            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


USER_DDP = str(Path(__file__).resolve().parent.parent / "examples" / "user_ddp.py")


def _user_ddp(procs: Procs, tmp: Path, name: str, *script_args: str) -> tuple[str, str, str]:
    """examples/user_ddp.py on the GPUs (NCCL, one rank per GPU, in-process restart on);
    returns (params_xxh3, run id, output)."""
    run_id = f"cuda-{name}-{uuid.uuid4().hex[:6]}"
    job = tmp / name
    job.mkdir()
    proc = procs.ftrun("--standalone", "--rdzv-id", run_id, "--nproc-per-node", str(GPUS),
                       "--max-restarts", "2", USER_DDP, "--device", "cuda", "--epochs", "2",
                       "--samples", str(96 * GPUS), "--batch-size", "8", "--hidden", "64",
                       "--fault-dir", str(job), "--pid-log", str(job), *script_args,
                       env={"FTRUN_INPLACE_TIMEOUT": "10"}, name=name)
    code = procs.wait(proc, 300)
    out = procs.output(proc)
    assert code == 0, f"exit {code}\n{out[-5000:]}"
    digests = [line.rpartition("params_xxh3=")[2] for line in out.splitlines()
               if line.startswith("user-ddp: step=")]
    assert len(digests) == 1, out[-5000:]
    return digests[0], run_id, out


@pytest.mark.integration
@pytest.mark.usefixtures("exact_steps")
def test_nccl_rank_that_raises_restarts_in_its_own_process_bit_identical(
        procs: Procs, state_dir: Path, tmp_path: Path) -> None:
    """On NCCL a rank whose training function raises keeps its process: its groups are
    aborted, the launcher restarts every rank in place (no new process, same CUDA context),
    the function runs again, restores from the snapshot and ends with the fault-free
    weights."""
    clean, _, _ = _user_ddp(procs, tmp_path, "clean")
    digest, run_id, out = _user_ddp(procs, tmp_path, "raise", "--fail-mode", "raise",
                                    "--kill-at-step", "5", "--kill-rank", "0")
    assert (tmp_path / "raise" / "user-ddp-fault-rank0-step5").exists(), "never fired"
    assert "this process stays" in out, out[-5000:]
    recoveries = [e for e in read_events(state_dir, run_id) if e["type"] == "recovery"]
    assert [r["how"] for r in recoveries] == ["in_process"], recoveries
    assert recoveries[0]["new_processes"] == [], recoveries
    pids = {int(line.split()[1]) for line in
            (tmp_path / "raise" / "pids-rank0.log").read_text().splitlines()}
    assert len(pids) == 1, pids  # the same process before and after the fault
    assert digest == clean
