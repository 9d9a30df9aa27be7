"""Replicas between stores: the receiver's checks, and the sender's supersede/abandon rules.

Real segments in shared memory, a real receiver on a TCP socket, a real sender reading the
rank's segment; nothing stands in for either end.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator

import pytest
import torch
import zmq
from snapshot_helpers import stage_segment

from ftrun.errors import IntegrityError
from ftrun.protocol import handshake
from ftrun.protocol.transport import Client
from ftrun.snapshot import segment as shm
from ftrun.snapshot import verify
from ftrun.snapshot.verify import pack_hashes
from ftrun.store.catalog import replica_prefix
from ftrun.store.replica import (
    Abandoned,
    Peer,
    Refused,
    ReplicaReceiver,
    ReplicaSender,
    _Pacer,
)

SECRET = b"r" * 32
ORIGIN = "host-a/1"
HOLDER = "host-b/2"
EPOCH = "e1"
# 10 MiB + a bit: three 4 MiB chunks, the last one short.
STATE = {"w": torch.arange(2_700_000, dtype=torch.float32), "b": torch.ones(7)}


class Job:
    def __init__(self) -> None:
        self.run_id = f"repl-{uuid.uuid4().hex[:8]}"
        self.reports: list[tuple[str, str, int, int]] = []
        self.receiver = ReplicaReceiver(self.run_id, HOLDER, os.getpid(), SECRET,
                                        lambda *a: self.reports.append(a))
        self.address = self.receiver.start("127.0.0.1")
        self.peer = Peer(HOLDER, self.address)
        self.segs: list[shm.Segment] = []
        self.senders: list[ReplicaSender] = []

    def stage(self, step: int, rank: int = 0) -> shm.Segment:
        seg = stage_segment(self.run_id, rank, 0, STATE, step=step)
        seg.set_state(shm.VERIFIED, epoch=EPOCH)
        self.segs.append(seg)
        return seg

    def sender(self, committed: object, **kw: object) -> ReplicaSender:
        s = ReplicaSender(self.run_id, ORIGIN, os.getpid(), SECRET, committed, **kw)  # type: ignore[arg-type]
        self.senders.append(s)
        return s

    def replicas(self) -> list:
        return self.receiver.records()

    def close(self) -> None:
        for s in self.senders:
            s.stop()
        self.receiver.stop(unlink=True)
        for seg in self.segs:
            seg.unlink()


@pytest.fixture
def job() -> Iterator[Job]:
    j = Job()
    try:
        yield j
    finally:
        j.close()
        left = shm.list_segments(shm.job_prefix(j.run_id)) + shm.list_segments(
            replica_prefix(j.run_id))
        assert not left, f"segments left behind: {left}"


def test_good_chunks_land_verified(job: Job) -> None:
    seg = job.stage(step=5)
    sender = job.sender(lambda: (EPOCH, 5))
    assert sender.send_step(job.peer, EPOCH, 5) == 1
    [rec] = job.replicas()
    h = seg.header()
    assert (rec.origin, rec.rank, rec.step, rec.epoch, rec.state) == (ORIGIN, 0, 5, EPOCH,
                                                                       "verified")
    assert h.n_chunks == 3 and rec.hashes == seg.hashes(h)
    assert rec.segment.startswith(replica_prefix(job.run_id))
    assert not rec.segment.startswith(shm.job_prefix(job.run_id))  # never a rank's segment
    replica = shm.Segment.open(rec.segment)
    try:
        assert bytes(replica.data()) == bytes(seg.data())
        assert verify.check(replica) == (True, "")
        assert replica.manifest_bytes() == seg.manifest_bytes()
    finally:
        replica.close()
    assert job.reports == [(ORIGIN, EPOCH, 0, 5)]
    assert job.receiver.verified() == [(ORIGIN, EPOCH, 0, 5)]  # what a restarted coordinator is retaught
    # Sent again: the receiver already has it and says so; nothing more is streamed.
    sent = sender.stats["bytes"]
    sender.send_step(job.peer, EPOCH, 5)
    assert sender.stats["bytes"] == sent and len(job.reports) == 1


def test_flipped_byte_in_a_frame_is_refused_and_named(job: Job) -> None:
    seg = job.stage(step=3)
    h = seg.header()
    client = Client(job.address, SECRET, job.run_id, "test", peer="receiver")
    try:
        ready = client.request("replica_begin", {
            "origin": ORIGIN, "epoch": EPOCH, "rank": 0, "step": 3, "data_len": h.data_len,
            "chunk_size": h.chunk_size, "n_tensors": h.n_tensors,
        }, "replica_ready", 5.0, frames=[seg.manifest_bytes(h), pack_hashes(seg.hashes(h))])
        assert ready.body == {"have": False}
        ranges = verify.chunk_ranges(h.data_len, h.chunk_size)
        acks = {}
        for i, (lo, hi) in enumerate(ranges):
            data = bytearray(seg.data(h)[lo:hi])
            if i == 1:
                data[12345] ^= 0x01  # one bit, after the rank hashed it
            acks[i] = client.request("replica_chunk", {"origin": ORIGIN, "rank": 0, "step": 3,
                                                       "chunk": i}, "replica_ack", 5.0,
                                     frames=[bytes(data)]).body
        assert [acks[i]["ok"] for i in range(3)] == [True, False, True]
        assert "chunk 1 refused" in acks[1]["reason"] and "tensor /w" in acks[1]["reason"]
        with pytest.raises(IntegrityError, match=r"chunk\(s\) 1 refused"):
            client.request("replica_end", {"origin": ORIGIN, "rank": 0, "step": 3},
                           "replica_done", 5.0)
    finally:
        client.close()
    [rec] = job.replicas()
    assert rec.state == "writing" and rec.hashes is None  # never verified
    assert job.reports == []


def test_sender_retries_a_refused_chunk_once_then_gives_up(job: Job) -> None:
    seg = job.stage(step=4)
    h = seg.header()
    seg.mm[h.data_off + h.chunk_size + 99] ^= 0xFF  # bad memory on the sending node
    sender = job.sender(lambda: (EPOCH, 4))
    with pytest.raises(IntegrityError, match=r"chunk\(s\) 1 refused.*tensor /w"):
        sender.send_step(job.peer, EPOCH, 4)
    # every chunk once, and the refused one a second time
    assert sender.stats["bytes"] == h.data_len + h.chunk_size
    [rec] = job.replicas()
    assert rec.state == "writing" and job.reports == []


def test_sender_abandons_a_step_rewritten_under_it(job: Job) -> None:
    seg = job.stage(step=6)
    calls = []

    def committed() -> tuple[str, int]:
        calls.append(1)
        if len(calls) == 4:  # mid-transfer, a rank claims the buffer and writes step 8
            seg.set_state(shm.WRITING, step=8)
        return EPOCH, 6

    sender = job.sender(committed)
    with pytest.raises(Abandoned, match="rewritten"):
        sender.send_step(job.peer, EPOCH, 6)
    assert len(calls) >= 4
    assert all(r.state != "verified" for r in job.replicas()) and job.reports == []


def test_sender_finishes_the_step_in_flight_when_newer_ones_commit(job: Job) -> None:
    job.stage(step=6)
    newest = [6]

    def committed() -> tuple[str, int]:
        newest[0] += 1  # every look finds a newer commit
        return EPOCH, newest[0]

    sender = job.sender(committed)
    assert sender.send_step(job.peer, EPOCH, 6) == 1  # not dropped for a newer step
    assert newest[0] > 8 and job.reports == [(ORIGIN, EPOCH, 0, 6)]


def test_sender_drops_the_step_in_flight_when_the_workers_restart(job: Job) -> None:
    job.stage(step=6)
    calls = []

    def committed() -> tuple[str, int]:
        calls.append(1)
        return ("e2", 3) if len(calls) >= 3 else (EPOCH, 6)  # a new epoch mid-transfer

    sender = job.sender(committed)
    with pytest.raises(Abandoned, match="superseded by step 3 of a new epoch"):
        sender.send_step(job.peer, EPOCH, 6)
    assert job.reports == []


def test_chunk_buffers_in_flight_when_a_transfer_stops_are_never_reused(job: Job) -> None:
    seg = job.stage(step=4)
    # A peer that takes the chunks and never acknowledges one: they stay in flight.
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    served = handshake.serve(silent, SECRET, "silent peer")
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    sender = job.sender(lambda: (EPOCH, 4), window=2, ack_timeout_s=0.5)
    try:
        h = seg.header()
        with pytest.raises(Abandoned, match="no ack"):
            sender._stream(sender._client(Peer("silent", f"127.0.0.1:{port}")), seg, EPOCH, 0, 4,
                           [0, 1, 2], verify.chunk_ranges(h.data_len, h.chunk_size),
                           _Pacer(0, threading.Event()))
        # Both buffers were in flight (window 2): neither is kept for the next transfer.
        assert sender._pool == [], "a buffer ZeroMQ may still send from was kept for reuse"
    finally:
        silent.close(0)
        served.release()
    # The sender goes on with fresh buffers: the next transfer lands verified.
    assert sender.send_step(job.peer, EPOCH, 4) == 1
    [rec] = job.replicas()
    assert rec.state == "verified" and rec.hashes == seg.hashes()
    assert len(sender._pool) == 2  # kept for the next transfer


def test_keeps_the_newest_two_steps_per_origin_and_rank(job: Job) -> None:
    seg = job.stage(step=1)
    job.stage(step=1, rank=1)
    current = [1]
    sender = job.sender(lambda: (EPOCH, current[0]))
    for step in (1, 2, 3):
        current[0] = step
        for s in job.segs:
            s.set_state(shm.VERIFIED, step=step)
        sender.send_step(job.peer, EPOCH, step)
    recs = job.replicas()
    assert sorted((r.rank, r.step) for r in recs) == [(0, 2), (0, 3), (1, 2), (1, 3)]
    assert all(r.state == "verified" for r in recs)
    assert len(job.reports) == 6
    assert seg.header().step == 3


def test_the_durable_steps_replica_is_kept_until_a_newer_step_is_durable(job: Job) -> None:
    """Replication one step behind: the newest durable step (1) is kept while steps 2 and 3
    arrive, 2 is overwritten by 3 (and the coordinator told: it no longer counts towards step
    2); once 3 is durable, step 4 overwrites 1. Dropping the durable step's replica for newer
    steps that never became durable left no step complete when its origin's host was lost."""
    durable = [1]
    dropped: list[tuple[str, str, int, int]] = []
    job.receiver.stop(unlink=True)
    job.receiver = ReplicaReceiver(job.run_id, HOLDER, os.getpid(), SECRET,
                                   lambda *a: job.reports.append(a),
                                   lambda: (EPOCH, durable[0]), lambda *a: dropped.append(a))
    job.peer = Peer(HOLDER, job.receiver.start("127.0.0.1"))
    seg = job.stage(step=1)
    current = [1]
    sender = job.sender(lambda: (EPOCH, current[0]))

    def send(step: int) -> list[int]:
        current[0] = step
        seg.set_state(shm.VERIFIED, step=step)
        sender.send_step(job.peer, EPOCH, step)
        return sorted(r.step for r in job.replicas() if r.state == "verified")

    assert send(1) == [1] and send(2) == [1, 2] and dropped == []
    assert send(3) == [1, 3] and dropped == [(ORIGIN, EPOCH, 0, 2)]
    durable[0] = 3
    assert send(4) == [3, 4] and dropped[1:] == [(ORIGIN, EPOCH, 0, 1)]


def test_a_dropped_replica_no_longer_counts_towards_a_durable_step() -> None:
    from ftrun.coordinator.commits import CommitTracker

    t = CommitTracker(final_settle_s=0.0)
    t.replicas = 2
    t.handle("snap_epoch", {"node_id": "a", "epoch": EPOCH, "base_step": 0, "world_size": 2})
    for rank in (0, 1):
        t.handle("snap_verified", {"node_id": "a", "epoch": EPOCH, "rank": rank, "step": 4,
                                   "nbytes": 10})
    ep = t.get(EPOCH)
    assert ep is not None and ep.committed == 4
    t.replica_verified(EPOCH, "b", "a", 0, 4)
    t.replica_dropped(EPOCH, "b", 0, 4)  # b overwrote it before rank 1's replica landed
    t.replica_verified(EPOCH, "b", "a", 1, 4)
    assert ep.durable == -1 and t.covered([0, 1]) is None
    t.replica_verified(EPOCH, "b", "a", 0, 4)  # sent again
    assert ep.durable == 4


# -- the coordinator's side: placement in replies, durable steps --------------------------------


def test_durable_needs_m_minus_1_replicas_of_every_shard() -> None:
    from ftrun.coordinator.commits import CommitTracker

    t = CommitTracker(final_settle_s=0.0)
    t.replicas = 3
    t.handle("snap_epoch", {"node_id": "a", "epoch": EPOCH, "base_step": 0, "world_size": 2})
    for rank in (0, 1):
        t.handle("snap_verified", {"node_id": "a", "epoch": EPOCH, "rank": rank, "step": 4,
                                   "nbytes": 10})
    ep = t.get(EPOCH)
    assert ep is not None and ep.committed == 4 and ep.durable == -1
    t.replica_verified(EPOCH, "b", "a", 0, 4)
    t.replica_verified(EPOCH, "a", "a", 0, 4)  # the origin itself never counts
    t.replica_verified(EPOCH, "c", "a", 0, 4)
    t.replica_verified(EPOCH, "b", "a", 1, 4)
    assert ep.durable == -1 and t.covered([0]) == 4 and t.covered([0, 1]) is None
    t.replica_verified(EPOCH, "c", "a", 1, 4)
    assert ep.durable == 4 and t.summary()["durable_step"] == 4  # type: ignore[index]
    # a replica of a step that is not committed yet makes nothing durable
    t.replica_verified(EPOCH, "b", "a", 0, 6)
    t.replica_verified(EPOCH, "c", "a", 0, 6)
    assert ep.durable == 4


def test_coordinator_answers_store_reports_with_the_placement() -> None:
    from ftrun.coordinator.server import Coordinator

    coord = Coordinator("job-r", SECRET, bind_host="127.0.0.1")
    coord.start()
    clients = {}
    try:
        def report(node: str) -> dict:
            c = clients.setdefault(node, Client(coord.endpoint, SECRET, "job-r", node,
                                                peer="coordinator"))
            reply = c.request("store_report", {
                "node_id": node, "bytes": 0, "segments": 0, "persisted_step": None,
                "ranks": [int(node[-1])], "replicas": 2, "replica_addr": f"127.0.0.1:{node[-1]}",
            }, "replica_plan", 5.0)
            return reply.body

        nodes = [f"n{i}" for i in range(4)]
        for n in nodes:
            report(n)
        plans = {n: report(n) for n in nodes}
        assert plans["n0"] == {"replicas": 2, "members": 4,
                               "peers": [{"node_id": "n1", "addr": "127.0.0.1:1"}]}
        assert plans["n3"]["peers"] == [{"node_id": "n2", "addr": "127.0.0.1:2"}]
        doc = coord.status_document()["snapshots"]
        assert doc["replica_coverage"]["n2"] == {"peers": ["n3"], "replicated_step": None,
                                                 "sent": 0, "superseded": 0, "abandoned": 0,
                                                 "refused": None}
    finally:
        for c in clients.values():
            c.close()
        coord.stop(timeout_s=2)


# -- room in the tmpfs, and a restarted store's replicas -------------------------------------


def test_a_replica_that_does_not_fit_is_refused_with_the_reason(
        job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    job.stage(step=5)
    sender = job.sender(lambda: (EPOCH, 5))
    real_free = shm.shm_free_bytes
    # Only the free-space figure is changed: the receiver, its socket and segments are real.
    monkeypatch.setattr(shm, "shm_free_bytes", lambda: 8 << 20)
    with pytest.raises(Refused, match=r"refused the replica of rank 0 step 5: .*MiB free"):
        sender.send_step(job.peer, EPOCH, 5)
    assert sender.stats["bytes"] == 0  # refused at replica_begin: no chunk was sent
    assert job.receiver.refused is not None and "Enlarge /dev/shm" in job.receiver.refused
    assert job.replicas() == [] and job.reports == []
    assert not shm.list_segments(replica_prefix(job.run_id))
    # The sender's loop survives it and counts it; the step is not retried until a newer one.
    sender.set_peers([job.peer])
    sender.send_pending()
    assert sender.stats["abandoned"] == 1 and "refused" in sender.last_outcome
    # Room again: the next step lands, and the refusal is no longer reported.
    monkeypatch.setattr(shm, "shm_free_bytes", real_free)
    for s in job.segs:
        s.set_state(shm.VERIFIED, step=6)
    sender.send_step(job.peer, EPOCH, 6)
    assert job.receiver.refused is None and job.reports == [(ORIGIN, EPOCH, 0, 6)]


def test_room_keeps_back_the_missing_second_buffer_of_local_ranks(
        job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    seg = job.stage(step=5)  # this node's rank 0 has one buffer so far: room for b1 is kept
    size = seg.path.stat().st_size
    spare = os.statvfs(shm.SHM_DIR).f_blocks * os.statvfs(shm.SHM_DIR).f_frsize // 16
    monkeypatch.setattr(shm, "shm_free_bytes", lambda: spare + size + (1 << 20) - 1)
    assert job.receiver._room_for(1 << 20) is not None  # b1 would not fit after it
    monkeypatch.setattr(shm, "shm_free_bytes", lambda: spare + size + (1 << 20))
    assert job.receiver._room_for(1 << 20) is None
    # Once the rank has both buffers, nothing more is kept back for it.
    job.segs.append(stage_segment(job.run_id, 0, 1, STATE, step=6))
    monkeypatch.setattr(shm, "shm_free_bytes", lambda: spare + (1 << 20))
    assert job.receiver._room_for(1 << 20) is None



def _restart_receiver(job: Job) -> ReplicaReceiver:
    """What a store restart does to the receiver: the old one stops without removing its
    segments (the process died), a new one of the same node starts."""
    job.receiver.stop(unlink=False)
    job.reports.clear()
    job.receiver = ReplicaReceiver(job.run_id, HOLDER, os.getpid(), SECRET,
                                   lambda *a: job.reports.append(a))
    job.address = job.receiver.start("127.0.0.1")
    job.peer = Peer(HOLDER, job.address)
    assert job.receiver.adopted.wait(30), "the new receiver never finished adopting"
    return job.receiver


def test_a_restarted_store_adopts_its_verified_replicas_and_reports_them(job: Job) -> None:
    job.stage(step=5)
    job.stage(step=5, rank=1)
    current = [5]
    sender = job.sender(lambda: (EPOCH, current[0]))
    sender.send_step(job.peer, EPOCH, 5)
    current[0] = 7
    for s in job.segs:
        s.set_state(shm.VERIFIED, step=7)
    sender.send_step(job.peer, EPOCH, 7)
    before = {(r.rank, r.step, r.segment) for r in job.replicas()}
    assert len(before) == 4

    receiver = _restart_receiver(job)
    recs = job.replicas()
    assert {(r.rank, r.step, r.segment) for r in recs} == before
    assert all(r.state == "verified" and r.origin == ORIGIN and r.hashes for r in recs)
    assert sorted(job.reports) == sorted((ORIGIN, EPOCH, r, s) for r in (0, 1) for s in (5, 7))
    assert sorted(receiver.verified()) == sorted(job.reports)
    # A sender asking to send an adopted step is told it is there already.
    new_sender = job.sender(lambda: (EPOCH, 7))
    new_sender.send_step(job.peer, EPOCH, 7)
    assert new_sender.stats["bytes"] == 0
    # The next step goes into the slot of the oldest adopted one, under its own name.
    current[0] = 9
    for s in job.segs:
        s.set_state(shm.VERIFIED, step=9)
    sender.send_step(job.peer, EPOCH, 9)
    assert sorted((r.rank, r.step) for r in job.replicas()) == [(0, 7), (0, 9), (1, 7), (1, 9)]
    assert {r.segment for r in job.replicas()} == {seg for _, _, seg in before}


def test_a_restarted_store_drops_damaged_and_torn_replicas(job: Job) -> None:
    job.stage(step=5)
    job.stage(step=5, rank=1)
    job.stage(step=5, rank=2)
    sender = job.sender(lambda: (EPOCH, 5))
    sender.send_step(job.peer, EPOCH, 5)
    by_rank = {r.rank: r.segment for r in job.replicas()}
    flipped = shm.Segment.open(by_rank[1])
    h = flipped.header()
    flipped.mm[h.data_off + h.chunk_size + 7] ^= 0x10  # a bad DIMM on the holder
    flipped.close()
    torn = shm.Segment.open(by_rank[2])
    torn.set_state(shm.WRITING)  # the store died in the middle of receiving it
    torn.close()

    _restart_receiver(job)
    assert [(r.rank, r.state) for r in job.replicas()] == [(0, "verified")]
    assert job.reports == [(ORIGIN, EPOCH, 0, 5)]
    left = {p.name for p in shm.list_segments(replica_prefix(job.run_id))}
    assert left == {by_rank[0]}  # the damaged and the torn ones are gone
    # Their senders send them again, in full.
    sender.send_step(job.peer, EPOCH, 5)
    assert sorted((r.rank, r.state) for r in job.replicas()) == [
        (0, "verified"), (1, "verified"), (2, "verified")]


# -- durable with fewer nodes than copies; lag; who holds what ---------------------------------


def _tracker(m: int, nodes: int, world: int = 2):
    """A tracker of an epoch of ``world`` ranks, with ``nodes`` live nodes taking replicas."""
    from ftrun.coordinator.commits import CommitTracker

    t = CommitTracker(final_settle_s=0.0)
    t.replicas = m
    t.set_replica_nodes(nodes)
    t.handle("snap_epoch", {"node_id": "a", "epoch": EPOCH, "base_step": 0, "world_size": world})
    return t


def _replicate(t, step: int, ranks: tuple[int, ...] = (0, 1), holder: str = "b") -> None:
    for rank in ranks:
        t.replica_verified(EPOCH, holder, "a", rank, step)


def _commit(t, step: int, world: int = 2) -> None:
    for rank in range(world):
        t.handle("snap_verified", {"node_id": "a", "epoch": EPOCH, "rank": rank, "step": step,
                                   "nbytes": 10})


def test_one_node_says_durable_is_not_possible_instead_of_waiting() -> None:
    from ftrun.cli.status import _replica_text
    from ftrun.coordinator.commits import NO_PEER

    t = _tracker(2, nodes=1)
    _commit(t, 4)
    doc = t.summary()
    assert doc is not None
    assert doc["durable_off"] == NO_PEER and doc["durable_step"] is None
    assert doc["durable_lag_steps"] is None and doc["replica_holders"] == {}
    assert _replica_text(doc) == f" | durable n/a: {NO_PEER}"
    # A second node joins: durable becomes possible, and is waited for.
    t.set_replica_nodes(2)
    doc = t.summary()
    assert doc is not None and doc["durable_off"] is None and doc["durable_lag_steps"] == 4
    assert "nothing durable yet, 4 step(s)" in _replica_text(doc)


def test_with_fewer_nodes_than_copies_the_replicas_that_can_exist_count() -> None:
    from ftrun.cli.status import _replica_text

    t = _tracker(3, nodes=3)
    _commit(t, 4)
    _replicate(t, 4)
    ep = t.get(EPOCH)
    assert ep is not None and ep.durable == -1  # 3 nodes: two replicas each needed
    t.set_replica_nodes(2)  # a node is gone: one replica is all there can be
    assert ep.durable == 4
    doc = t.summary()
    assert doc is not None and doc["replica_nodes"] == 2
    assert "durable step 4 (2 of 3 copies: 2 live node(s)" in _replica_text(doc)


def test_summary_says_how_far_durable_lags_and_who_holds_each_shard() -> None:
    from ftrun.cli.status import _replica_text

    t = _tracker(2, nodes=2)
    _commit(t, 4)
    _replicate(t, 4)
    _commit(t, 6)
    _commit(t, 8)
    _replicate(t, 8, ranks=(0,))  # rank 1's replica of step 8 not yet
    ep = t.get(EPOCH)
    assert ep is not None
    ep.commit_times[4] = ep.committed_at - 12.5  # step 4 committed 12.5 s before step 8
    doc = t.summary()
    assert doc is not None
    assert doc["durable_step"] == 4 and doc["durable_lag_steps"] == 4
    assert doc["durable_lag_s"] == 12.5
    assert doc["replica_holders"] == {"4": {"0": ["b"], "1": ["b"]}, "8": {"0": ["b"]}}
    assert ", 4 step(s) / 12.5 s behind committed" in _replica_text(doc)
    _replicate(t, 8, ranks=(1,))
    doc = t.summary()
    assert doc is not None and doc["durable_step"] == 8 and doc["durable_lag_steps"] == 0
    assert doc["durable_lag_s"] == 0.0 and "behind" not in _replica_text(doc)


def test_a_refusal_reaches_the_coordinators_coverage_and_status(
        job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    from ftrun.cli.status import _replica_text
    from ftrun.coordinator.server import Coordinator
    from ftrun.store.replica import ReplicaConfig, Replication

    coord = Coordinator(job.run_id, SECRET, bind_host="127.0.0.1")
    coord.start()
    holder = Replication(ReplicaConfig(2, "127.0.0.1"), job.run_id, HOLDER, os.getpid(), SECRET,
                         lambda: ("", -1), coord.endpoint)
    client = Client(coord.endpoint, SECRET, job.run_id, "test-store", peer="coordinator")
    try:
        peer = Peer(HOLDER, holder.start())
        job.stage(step=5)
        monkeypatch.setattr(shm, "shm_free_bytes", lambda: 1 << 20)
        with pytest.raises(Refused):
            job.sender(lambda: (EPOCH, 5)).send_step(peer, EPOCH, 5)
        fields = holder.report_fields()
        assert "MiB free" in fields["replica_refused"]
        for node, ranks, extra in ((ORIGIN, [0], {"replica_addr": "127.0.0.1:1", "replicas": 2}),
                                   (HOLDER, [1], fields)):
            client.request("store_report", {"node_id": node, "bytes": 0, "segments": 0,
                                            "persisted_step": None, "ranks": ranks, **extra},
                           "replica_plan", 5.0)
        client.request("snap_epoch", {"node_id": ORIGIN, "epoch": EPOCH, "base_step": 0,
                                      "world_size": 2}, "commit_info", 5.0)
        snaps = coord.status_document()["snapshots"]
        assert snaps["replica_coverage"][HOLDER]["refused"] == fields["replica_refused"]
        assert snaps["replica_coverage"][ORIGIN]["refused"] is None
        assert f"{HOLDER} refuses replicas: " in _replica_text(snaps)
    finally:
        client.close()
        holder.stop(unlink=True)
        coord.stop(timeout_s=2)


def test_a_reply_without_durable_keeps_the_durable_step() -> None:
    """The coordinator's reply says durable 13, then one says nothing of it (a passing view:
    a store report it has not had for a while, a new coordinator after a failover, which
    may also have sent this store a plan without peers: tests/test_durable_keep.py). The
    rank whose newest shard is step 14 may not overwrite its older buffer (step 13, the only
    other copy of which may be on the host that is being lost), with peers or without."""
    from types import SimpleNamespace

    from ftrun.store.api import StoreConfig
    from ftrun.store.commits import CommitMirror

    class Mirror(CommitMirror):
        def ask(self, kind: str, body: dict) -> dict:
            return {"known": True, "epoch": EPOCH, "committed": 14}  # no "durable"

    cfg = StoreConfig(run_id="r", url="ipc://x", coordinator="127.0.0.1:1", node_id="n1/1",
                      owner_pid=os.getpid(), replicas=2)
    persist = SimpleNamespace(new_epoch=lambda restarted: None, final=None,
                              take_targets=lambda steps, base: None)
    for peers in ((object(),), ()):
        mirror = Mirror(cfg, object(), None, persist)  # type: ignore[arg-type]
        mirror.replication = SimpleNamespace(sender=SimpleNamespace(peers=peers,
                                                                    wake=lambda: None))
        mirror.begin_epoch(EPOCH, 0, False)
        mirror._note_commit({"known": True, "epoch": EPOCH, "committed": 14, "durable": 13},
                            EPOCH)
        assert mirror.durable_step() == 13
        assert mirror.claim(EPOCH, 14) is None, peers
        assert mirror.durable_step() == 13
