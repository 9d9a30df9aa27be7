"""A persisted FSDP2 checkpoint of 4 ranks, resumed on 3: every rank gets the right shards.

FSDP2 (``fully_shard``) on CPU/gloo shards each parameter and its AdamW state by rows; 4
ranks and 3 ranks cut them at different rows (32 rows: 8 each, or 11, 11, 10), so the
restore reads across the old shards' boundaries. The full weights and the full optimizer
state after the restore must equal, bit for bit, those the 4-rank job ended with.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, Procs

from ftrun.snapshot import persist

pytestmark = pytest.mark.integration

WORKER = str(Path(__file__).with_name("fsdp_worker.py"))


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
