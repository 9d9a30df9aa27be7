"""A persisted FSDP2 checkpoint of 4 ranks, resumed on 3: every rank gets the right shards.

FSDP2 (``fully_shard``) on CPU/gloo shards each parameter and its AdamW state by rows; 4
ranks and 3 ranks cut them at different rows (32 rows: 8 each, or 11, 11, 10), so the
restore reads across the old shards' boundaries. The full weights and the full optimizer
state after the restore must equal, bit for bit, those the 4-rank job ended with. The same
step loads with torch's own tools alone (``dcp.load`` + ``set_state_dict``, and
``dcp.load({"model": model.state_dict()})``) on 1 process and, FSDP2-sharded, on 2, with the
same values; and a step on disk in ftrun's first layout still restores, resharded.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, Procs

from ftrun.snapshot import persist

pytestmark = pytest.mark.integration

WORKER = str(Path(__file__).with_name("fsdp_worker.py"))
LOADER = str(Path(__file__).with_name("dcp_loader.py"))
V1_STEP = Path(__file__).with_name("fixtures") / "persist_v1"  # see its README.md


def result(procs: Procs, nproc: int, ckpt: Path, steps: str) -> tuple[str, str]:
    proc = procs.ftrun("--standalone", "--nproc-per-node", str(nproc), "--persist-dir",
                       str(ckpt), WORKER, steps, name=f"fsdp{nproc}")
    code = procs.wait(proc, 200)
    out = procs.output(proc)
    assert code == 0, out[-4000:]
    return [ln for ln in out.splitlines() if ln.startswith("fsdp:")][0], out


def test_fsdp2_checkpoint_of_4_ranks_restores_onto_3(procs: Procs, state_dir: Path,
                                                     tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    trained, out = result(procs, 4, ckpt, "4")
    assert trained.startswith("fsdp: start=0 ") and trained.endswith(" world=4"), out[-4000:]
    [step] = persist.list_steps(ckpt)
    assert step.step == 4 and step.complete and step.world_size == 4, step.why_incomplete
    # Rank 1's manifest says where its shard of the first layer's weight (32 x 16) sits.
    doc = json.loads((step.path / "rank_00001" / persist.MANIFEST_FILE).read_text())
    weight = next(e for e in doc["tensors"] if e["key"] == "/model/0.weight")
    assert weight["shape"] == [8, 16] and weight["global_shape"] == [32, 16]
    assert weight["offsets"] == [8, 0] and weight["mesh"] == [4]
    assert weight["placements"][0] in ("S(0)", "Shard(dim=0)")

    inspected = subprocess.run([sys.executable, "-m", "ftrun", "inspect", str(ckpt), "--json"],
                               capture_output=True, text=True, timeout=120, cwd=ROOT)
    [shown] = json.loads(inspected.stdout)["steps"]
    assert shown["status"] == "complete" and shown["global_metadata"], inspected.stdout

    resumed, out = result(procs, 3, ckpt, "4")  # a new job: nothing in memory, 3 ranks
    assert resumed.startswith("fsdp: start=4 ") and resumed.endswith(" world=3"), out[-4000:]
    assert "written by 4 ranks, this job has 3: model and optimizer resharded" in out
    # The full weights and the full AdamW state, as the 4-rank job left them.
    assert resumed.split(" hash=")[1].split(" world=")[0] == \
        trained.split(" hash=")[1].split(" world=")[0]

    # Torch alone loads the same values, onto 1 process and FSDP2-sharded onto 2.
    weights, optim = trained.split(" hash=")[1].split(" world=")[0].split(" optim=")
    alone = torch_only(step.path, 1)
    assert f"loaded: hash={weights} optim={optim} world=1 lr=0.01" in alone, alone[-4000:]
    assert f"plain: hash={weights} step=4" in alone, alone[-4000:]
    sharded = torch_only(step.path, 2)
    assert f"loaded: hash={weights} optim={optim} world=2 lr=0.01" in sharded, sharded[-4000:]


def torch_only(step_dir: Path, nproc: int) -> str:
    """dcp_loader.py's output: one process, or ``nproc`` under torch.distributed.run."""
    launch = [] if nproc == 1 else ["-m", "torch.distributed.run", "--standalone",
                                     "--nproc-per-node", str(nproc)]
    proc = subprocess.Popen([sys.executable, *launch, LOADER, str(step_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=Path(LOADER).parent, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:  # timed out: its workers go with it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 0, out[-4000:]
    return out


def test_a_step_of_the_first_layout_still_restores_resharded(
        procs: Procs, state_dir: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(V1_STEP, ckpt, ignore=shutil.ignore_patterns("README.md"))
    [step] = persist.list_steps(ckpt)
    assert step.complete and step.world_size == 2, step.why_incomplete
    assert {persist.read_layout(r.path) for r in step.ranks} == {persist.LAYOUT_FLAT}
    resumed, out = result(procs, 1, ckpt, "3")  # 2 ranks wrote it: resharded onto 1
    assert resumed == "fsdp: start=3 hash=9f3ab9abb5ed0fe6 optim=db1cb60b31633313 world=1", \
        out[-4000:]
    assert "written by 2 ranks, this job has 1: model and optimizer resharded" in out
