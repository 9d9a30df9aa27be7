"""Shards across nodes (ftrun.store.shards) and resharding from memory (memload).

A real shard service over real segments: it lists what it holds, serves manifests and
chunks; a reader takes each chunk from a copy that verifies, and a chunk changed in memory
after the rank hashed it is refused and read from the other copy.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import torch
from snapshot_helpers import stage_segment

from ftrun.errors import IntegrityError
from ftrun.rank import memload
from ftrun.rank.shards import Holding, ShardReader, complete, describe_gaps, holding
from ftrun.snapshot.segment import Segment
from ftrun.store import survey as store_survey
from ftrun.store.shards import ShardService
from ftrun.store.survey import Surveyor, ask_holdings

SECRET = b"s" * 32


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(0)  # model and optimizer: the same on every rank (DDP)
    return {
        "model": {"w": torch.randn(1024, 2560, generator=g),  # 10 MiB: three 4 MiB chunks
                  "b": torch.arange(4, dtype=torch.float64)},
        "optim": {"state": {0: {"exp_avg": torch.full((4, 3), 0.5), "step": torch.tensor(3.0)}},
                  "param_groups": [{"lr": 0.1, "params": [0]}]},
        "rng": {"torch": torch.arange(16, dtype=torch.uint8) + seed,
                "numpy": np.arange(5, dtype=np.uint32) + seed},
        "extra": {"rank": seed},
    }


@pytest.fixture
def held() -> Iterator[tuple[str, list[Segment]]]:
    """Rank 0 of a 2-rank job: step 9 in both buffers (two copies); rank 1: step 9."""
    run_id = f"sh{uuid.uuid4().hex[:8]}"
    made = [stage_segment(run_id, 0, 0, _state(0), step=9, world_size=2),
            stage_segment(run_id, 0, 1, _state(0), step=9, world_size=2),
            stage_segment(run_id, 1, 0, _state(1), step=9, world_size=2)]
    try:
        yield run_id, made
    finally:
        for seg in made:
            seg.unlink()


@pytest.fixture
def service(held: tuple[str, list[Segment]]) -> Iterator[ShardService]:
    svc = ShardService(held[0], "node-a", os.getpid(), SECRET)
    svc.start("127.0.0.1")
    try:
        yield svc
    finally:
        svc.stop()


def survey(stores: dict[str, str], secret: bytes, run_id: str, sender: str,
           timeout_s: float = 3.0) -> tuple[list[Holding], list[str]]:
    records, lost = ask_holdings(stores, secret, run_id, sender, timeout_s)
    return [holding(r) for r in records], lost


def _holding(rank: int, step: int, world: int = 2, node: str = "a") -> Holding:
    return Holding(node, "", f"seg-{node}-{rank}-{step}", node, rank, step, "e", world, 8, 4)


def test_complete_steps_need_every_old_ranks_shard_somewhere() -> None:
    held = [_holding(0, 5), _holding(1, 5, node="b"), _holding(0, 6), _holding(0, 4, world=1)]
    found = complete(held)
    assert [c.key for c in found] == [(5, "e", 2), (4, "e", 1)]
    assert [h.node for h in found[0].holders[1]] == ["b"]
    assert describe_gaps(held) == "step 6 of 2 ranks lacks rank(s) 1"


def test_survey_lists_what_the_store_holds_and_a_dead_address_is_left_out(
        held: tuple[str, list[Segment]], service: ShardService) -> None:
    run_id, _ = held
    from conftest import free_port

    found, lost = survey({"node-a": service.address, "node-x": f"127.0.0.1:{free_port()}"},
                         SECRET, run_id, "t", timeout_s=1.0)
    assert lost == ["node-x"]
    assert sorted((h.rank, h.segment[-2:], h.world_size) for h in found) == [
        (0, "b0", 2), (0, "b1", 2), (1, "b0", 2)]
    [cand] = complete(found)
    assert cand.key[0] == 9 and len(cand.holders[0]) == 2


def test_the_store_surveys_once_per_restore_for_all_its_ranks(
        held: tuple[str, list[Segment]], service: ShardService,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's store asks the other stores once per restore key; its own shard service is
    asked afresh for each rank; the answer comes in pages."""
    run_id, _ = held
    from conftest import free_port, wait_for

    other = ShardService(run_id, "node-b", os.getpid(), SECRET)  # sees the same segments
    other.start("127.0.0.1")
    asked: list[int] = []

    def stores() -> dict[str, str]:
        asked.append(1)
        return {"node-a": service.address, "node-b": other.address,
                "node-x": f"127.0.0.1:{free_port()}"}

    monkeypatch.setattr(store_survey, "SURVEY_TIMEOUT_S", 1.0)
    monkeypatch.setattr(store_survey, "PAGE", 2)
    surveyor = Surveyor(SECRET, run_id, "node-a", stores)
    try:
        def pages(key: str) -> tuple[list[dict], list[str]]:
            first = wait_for(lambda: (r := surveyor.answer(key, 0)).ready and r, timeout_s=10,
                             what="the survey", interval_s=0.02)
            records, nxt = list(first.records), first.next
            while nxt is not msgspec.UNSET:
                page = surveyor.answer(key, nxt)
                records += page.records
                nxt = page.next
            return records, list(first.lost)

        records, lost = pages("w1")
        assert lost == ["node-x"]
        assert sorted((r["node"], r["rank"], r["segment"][-2:]) for r in records) == [
            ("node-a", 0, "b0"), ("node-a", 0, "b1"), ("node-a", 1, "b0"),
            ("node-b", 0, "b0"), ("node-b", 0, "b1"), ("node-b", 1, "b0")]
        assert {r["addr"] for r in records if r["node"] == "node-b"} == {other.address}
        [cand] = complete(holding(r) for r in records)
        assert cand.key[0] == 9 and len(cand.holders[0]) == 4
        # The node's other ranks of the same restore: the same survey, not another one.
        for _ in range(7):
            assert sorted(map(str, pages("w1")[0])) == sorted(map(str, records))
        assert len(asked) == 1 and surveyor.surveys == 1
        pages("w2")  # the next restore surveys again
        assert len(asked) == 2
    finally:
        surveyor.close()
        other.stop()


def test_a_chunk_changed_after_hashing_is_read_from_the_other_copy(
        held: tuple[str, list[Segment]], service: ShardService) -> None:
    run_id, segs = held
    found, _ = survey({"node-a": service.address}, SECRET, run_id, "t")
    [cand] = complete(found)
    # A bit flips in chunk 1 of one copy, after the rank hashed it (a bad DIMM).
    bad = next(s for s in segs if s.name == cand.holders[0][0].segment)
    h = bad.header()
    bad.mm[h.data_off + (4 << 20) + 100] ^= 0x01
    reader = ShardReader(cand.holders[0], "node-b", SECRET, run_id, "t")  # over the wire
    try:
        data = reader.whole()
        good = next(s for s in segs if s is not bad and s.name.split("-r")[1][0] == "0")
        assert bytes(data) == bytes(good.data())
        assert len(reader.refused) == 1 and "chunk 1 does not match its hash" in \
            reader.refused[0] and "/model/w" in reader.refused[0]
    finally:
        reader.close()
    only_bad = [hd for hd in cand.holders[0] if hd.segment == bad.name]
    reader = ShardReader(only_bad, "node-a", SECRET, run_id, "t")  # this node: shared memory
    try:
        with pytest.raises(IntegrityError, match="chunk.s. 1 verified on no holder"):
            reader.whole()
        assert reader.read(0, 16) == bytes(bad.data()[:16])  # chunk 0 is fine
    finally:
        reader.close()


def test_reshard_from_memory_onto_one_rank(held: tuple[str, list[Segment]],
                                           service: ShardService) -> None:
    run_id, _ = held
    found, _ = survey({"node-a": service.address}, SECRET, run_id, "t")
    [cand] = complete(found)
    readers = {r: ShardReader(hs, "node-b", SECRET, run_id, "t")
               for r, hs in cand.holders.items()}
    want = _state(0)
    live = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()},
            "optim": {"state": {0: {k: torch.zeros_like(v)
                                    for k, v in want["optim"]["state"][0].items()}},
                      "param_groups": [{"lr": 0.5, "params": [0]}]}}
    try:
        tree, nbytes = memload.reshard(readers, rank=0, world_size=1, live_state=lambda: live)
    finally:
        for r in readers.values():
            r.close()
    assert tree["model"]["w"] is live["model"]["w"]  # filled in place
    assert torch.equal(live["model"]["w"], want["model"]["w"])
    assert torch.equal(live["optim"]["state"][0]["exp_avg"], want["optim"]["state"][0]["exp_avg"])
    assert tree["optim"]["param_groups"][0]["lr"] == 0.1  # the step's, not the live one
    assert tree["extra"] == {"rank": 0} and torch.equal(tree["rng"]["torch"],
                                                        want["rng"]["torch"])
    assert nbytes == sum(t.numel() * t.element_size() for t in
                         (want["model"]["w"], want["model"]["b"],
                          *want["optim"]["state"][0].values()))
