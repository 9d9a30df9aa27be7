"""On-disk checkpoints: DCP layout, plain-DCP readability, integrity, completeness, pruning."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from snapshot_helpers import stage_segment, write_plain

from ftrun.errors import ConfigError, IntegrityError
from ftrun.snapshot import persist
from ftrun.snapshot.manifest import flatten, parse_manifest
from ftrun.snapshot.segment import STAGED, VERIFIED, Segment

# -- helpers ----------------------------------------------------------------------------------


def make_state(seed: int = 0, step: int = 7) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "fc.weight": torch.randn(4, 3, generator=g),
            "fc.bias": torch.arange(4, dtype=torch.float64) + seed,
            "emb.weight": torch.randn(5, 2, generator=g).to(torch.bfloat16),
            "mask": torch.tensor([True, False, True]),
            "empty": torch.empty(0, 3),
        },
        "optim": {
            "state": {0: {"exp_avg": torch.full((4, 3), 0.5 + seed), "step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}],
        },
        "rng": {"torch": torch.arange(16, dtype=torch.uint8), "python": (3, (1, 2, 3), None),
                "numpy": np.arange(5, dtype=np.uint32) + seed},
        "extra": {"epoch": 2, "name": "demo", "blob": b"\x00\x01", "dtype": torch.float16},
        "step": step,
    }


def assert_same(a: Any, b: Any, path: str = "") -> None:
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, path


SegmentFactory = Callable[..., Segment]


@pytest.fixture
def segments() -> Iterator[SegmentFactory]:
    run_id = f"tp{uuid.uuid4().hex[:10]}"
    made: list[Segment] = []

    def make(rank: int, state: Any, *, step: int, world_size: int = 1, buffer: int = 0,
             verified: bool = True) -> Segment:
        seg = stage_segment(run_id, rank, buffer, state, step=step, world_size=world_size,
                            final_state=VERIFIED if verified else STAGED)
        made.append(seg)
        return seg

    try:
        yield make
    finally:
        for seg in made:
            seg.unlink()


@pytest.fixture
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="ftrun-test-persist-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def persist_from(seg: Segment, root: Path) -> Path:
    doc = parse_manifest(seg.manifest_bytes())
    with seg.data() as data:
        return persist.write_rank(root, doc, data, seg.hashes())


# -- tests ------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_layout_plain_dcp_load_and_load_rank(segments: SegmentFactory, workdir: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = make_state()
    seg = segments(0, state, step=12)
    out = persist_from(seg, workdir)
    assert out == workdir / "step_000000012" / "rank_00000"
    names = {p.name for p in out.iterdir()}
    assert {".metadata", persist.MANIFEST_FILE, persist.HASHES_FILE} <= names
    assert any(n.endswith(".distcp") for n in names)
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".tmp-")]
    seg.mm.close()  # write_rank left no view into the segment behind

    # Plain DCP, knowing nothing of ftrun: a flat dict of empty tensors of the right shapes.
    flat = flatten(state)
    plain = {e.key.lstrip("/"): torch.empty(e.shape, dtype=src.dtype)
             for e, src in zip(flat.tensors, flat.sources, strict=True)}
    assert "model/fc.weight" in plain and "optim/state/0/exp_avg" in plain
    dcp.load(plain, checkpoint_id=str(out), no_dist=True)
    for e, src in zip(flat.tensors, flat.sources, strict=True):
        assert torch.equal(plain[e.key.lstrip("/")], src), e.key

    tree = persist.load_rank(workdir, 12, 0)
    assert_same(tree, state)
    hashes = json.loads((out / persist.HASHES_FILE).read_text())["tensors"]
    assert set(hashes) == {e.key for e in flat.tensors}


def test_write_rank_refuses_corrupt_bytes(segments: SegmentFactory, workdir: Path) -> None:
    seg = segments(0, make_state(), step=3)
    doc = parse_manifest(seg.manifest_bytes())
    hashes = seg.hashes()
    hashes[1] ^= 1
    with seg.data() as data, pytest.raises(IntegrityError, match="refusing to persist"):
        persist.write_rank(workdir, doc, data, hashes)
    assert not (workdir / "step_000000003" / "rank_00000").exists()
    assert not list(workdir.glob("step_*/.tmp-*"))


def test_write_rank_is_idempotent(workdir: Path) -> None:
    first = write_plain(workdir, make_state(), step=5)
    marker = first / "marker"
    marker.write_text("x")
    again = write_plain(workdir, make_state(seed=1), step=5)
    assert again == first and marker.exists()
    assert_same(persist.load_rank(workdir, 5, 0), make_state())


def test_corrupt_distcp_byte_is_detected(workdir: Path) -> None:
    state = make_state()
    out = write_plain(workdir, state, step=1)
    needle = state["optim"]["state"][0]["exp_avg"].numpy().tobytes()
    [distcp] = out.glob("*.distcp")
    raw = bytearray(distcp.read_bytes())
    at = raw.find(needle)
    assert at > 0
    raw[at + 7] ^= 0x40
    distcp.write_bytes(bytes(raw))

    with pytest.raises(IntegrityError) as info:
        persist.load_rank(workdir, 1, 0, verify=True)
    assert distcp.name in str(info.value) and "/optim/state/0/exp_avg" in str(info.value)
    persist.load_rank(workdir, 1, 0, verify=False)  # unchecked reads still go through
    [bad] = persist.verify_dir(out, batch_bytes=64)
    assert bad.key == "/optim/state/0/exp_avg" and bad.file.endswith(distcp.name)


def test_tmp_dirs_and_disagreeing_ranks_are_not_complete(workdir: Path) -> None:
    for rank in (0, 1):
        write_plain(workdir, make_state(rank), step=10, rank=rank, world_size=2)
    done = write_plain(workdir, make_state(), step=20, rank=0, world_size=2)
    # Rank 1 of step 20 died mid-write: a full-looking copy, but still under its temp name.
    shutil.copytree(done, done.parent / ".tmp-rank_00001-4242")
    # Step 30: both ranks present, but they disagree on the world size.
    write_plain(workdir, make_state(), step=30, rank=0, world_size=2)
    write_plain(workdir, make_state(), step=30, rank=1, world_size=3)
    # Step 40: a final-named directory without .metadata is corrupt, never complete.
    write_plain(workdir, make_state(), step=40, rank=0, world_size=1)
    (workdir / "step_000000040" / "rank_00000" / ".metadata").unlink()

    assert persist.complete_steps(workdir) == [(10, 2)]
    assert persist.latest_complete(workdir) == (10, 2)
    steps = {s.step: s for s in persist.list_steps(workdir)}
    assert [r.rank for r in steps[20].ranks] == [0] and len(steps[20].pending) == 1
    assert steps[40].problems and not steps[40].complete
    assert persist.latest_complete(workdir / "nothing-here") is None


def test_prune_keeps_newest_complete(workdir: Path) -> None:
    for step in (1, 2, 3, 4):
        write_plain(workdir, make_state(), step=step)
    write_plain(workdir, make_state(), step=5, rank=0, world_size=2)  # partial, newer
    stale = workdir / "step_000000004" / ".tmp-rank_00003-99"
    fresh = workdir / "step_000000005" / ".tmp-rank_00001-98"
    stale.mkdir()
    fresh.mkdir()
    old = time.time() - 2 * persist.STALE_TMP_S
    os.utime(stale, (old, old))

    removed = persist.prune(workdir, keep=2)
    assert sorted(p.name for p in removed) == [".tmp-rank_00003-99", "step_000000001",
                                                "step_000000002"]
    assert sorted(p.name for p in workdir.iterdir()) == [
        "step_000000003", "step_000000004", "step_000000005"]
    assert fresh.exists()
    assert [s for s, _ in persist.complete_steps(workdir)] == [4, 3]
    assert persist.prune(workdir, keep=1) == [workdir / "step_000000003"]
    with pytest.raises(ConfigError, match="keep"):
        persist.prune(workdir, keep=0)


def test_to_torch_save_round_trip(workdir: Path) -> None:
    state = make_state(seed=3, step=99)
    out = write_plain(workdir, state, step=99)

    rank_file = persist.to_torch_save(out, workdir / "rank.pt")
    assert_same(torch.load(rank_file, weights_only=False), state)
    step_file = persist.to_torch_save(out.parent, workdir / "step.pt")
    assert_same(torch.load(step_file, weights_only=False), state)
    tensors_only = {"model": {"w": torch.ones(2)}, "step": 1}
    plain = write_plain(workdir, tensors_only, step=100)
    assert_same(torch.load(persist.to_torch_save(plain, workdir / "w.pt"), weights_only=True),
                tensors_only)
    with pytest.raises(ConfigError, match="neither"):
        persist.to_torch_save(workdir, workdir / "x.pt")

    # PyTorch's own converter (what `python -m ...format_utils dcp_to_torch` runs).
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(out, workdir / "flat.pt")
    flat = torch.load(workdir / "flat.pt", weights_only=True)
    assert torch.equal(flat["model/fc.weight"], state["model"]["fc.weight"])


def test_colliding_keys_are_refused(workdir: Path) -> None:
    with pytest.raises(ConfigError, match="same checkpoint key"):
        write_plain(workdir, {"model": {1: torch.ones(1), "1": torch.zeros(1)}}, step=1)
    assert not list(workdir.glob("step_*/rank_*"))
