"""The copies of the durable step are kept through a coordinator failover.

Invariant: no store releases its copy of a shard of the newest durable step (a rank's buffer
or a replica slot) until a newer step is durable (or DURABLE_KEEP_S passes, said in the log).

A new coordinator (the old one's host frozen or lost) first hears of one store alone: it
answers that store's report with a replica plan without peers, and its commit replies name no
durable step (it counts fewer than two stores taking replicas) until the others report. The
store used to take that for "replication off" and forget the durable step, and a rank whose
claim was retrying then overwrote its shard of the durable step, whose only other copy was on
the host being lost (tests/test_failover_integ.py's frozen-host test, under load). Real
coordinators, a real store-side commit mirror and replication, in the order of a failover.
"""

from __future__ import annotations

import os
import uuid
from concurrent.futures import ThreadPoolExecutor

from ftrun.coordinator.server import Coordinator
from ftrun.protocol.transport import Client
from ftrun.snapshot.api import PersistConfig
from ftrun.store.api import ClaimAnswer, StoreConfig
from ftrun.store.catalog import Catalog
from ftrun.store.commits import CommitMirror
from ftrun.store.persist_writer import PersistWriter
from ftrun.store.replica import ReplicaConfig, Replication

SECRET = b"d" * 32
EPOCH = "e1"
HERE, PEER = "n0/1", "n1/2"  # this store's node, and the other node (rank 1's)
# A store whose report the coordinator has not had for its node timeout does not count as
# taking replicas: far longer than any of these tests, however loaded the host.
NO_TIMEOUT_S = 600.0


def test_a_new_coordinator_without_a_picture_does_not_release_the_durable_step() -> None:
    run_id = f"dur-{uuid.uuid4().hex[:8]}"
    old = Coordinator(run_id, SECRET, bind_host="127.0.0.1", node_timeout_s=NO_TIMEOUT_S)
    new = Coordinator(run_id, SECRET, bind_host="127.0.0.1", node_timeout_s=NO_TIMEOUT_S)
    old.start()
    new.start()
    cfg = StoreConfig(run_id=run_id, url="ipc://unused", coordinator=old.endpoint,
                      node_id=HERE, owner_pid=os.getpid(), replicas=2)
    coord = Client(old.endpoint, SECRET, run_id, f"store:{HERE}", peer="coordinator")
    other = Client(old.endpoint, SECRET, run_id, f"store:{PEER}", peer="coordinator")
    catalog = Catalog(run_id, HERE, os.getpid())
    hashers = ThreadPoolExecutor(max_workers=1)
    persister = PersistWriter(PersistConfig(), catalog, hashers)
    mirror = CommitMirror(cfg, coord, catalog, persister)
    replication = Replication(ReplicaConfig(2, "127.0.0.1"), run_id, HERE, os.getpid(), SECRET,
                              lambda: (mirror.epoch, mirror.committed), old.endpoint)
    mirror.replication = replication
    try:
        address = replication.start()

        def report(client: Client, node: str, addr: str) -> None:
            """A store's periodic report; this store takes the plan it is answered with."""
            reply = client.request("store_report", {
                "node_id": node, "bytes": 0, "segments": 0, "persisted_step": None,
                "ranks": [0 if node == HERE else 1], "replicas": 2, "replica_addr": addr},
                "replica_plan", 5.0)
            if node == HERE:
                replication.set_plan(reply.body)

        # The old coordinator: 2 stores take replicas; steps 1..14 commit, 13 is durable
        # (each rank's shard has its replica on the other node), 14 not yet.
        report(other, PEER, "127.0.0.1:9")
        report(coord, HERE, address)
        assert replication.sender.peers
        mirror.begin_epoch(EPOCH, 0, restarted=False)
        mirror.world_size = 2
        mirror.ask("snap_epoch", mirror.epoch_body(EPOCH, 0))
        for step in range(1, 15):
            for rank in (0, 1):
                mirror.report_verified(EPOCH, rank, step, 64)
        for holder, origin, rank in ((PEER, HERE, 0), (HERE, PEER, 1)):
            other.request("replica_verified", {"node_id": holder, "origin": origin,
                                               "epoch": EPOCH, "rank": rank, "step": 13},
                          "ack", 5.0)
        mirror.refresh()
        assert (mirror.committed, mirror.durable_step()) == (14, 13)
        # Rank 0's buffers hold 13 and 14: it may not overwrite 13 for step 15.
        assert mirror.claim(EPOCH, 14) is None

        # The old coordinator's host is frozen; the new one hears of this store first: a
        # plan without peers, commit replies without a durable step.
        coord.retarget(new.endpoint, 0)
        other.retarget(new.endpoint, 0)
        report(coord, HERE, address)
        assert not replication.sender.peers
        mirror.refresh()  # the new coordinator does not know the epoch: taught it again
        info = mirror.ask("commit_query", {"epoch": EPOCH})
        assert info is not None and info["known"] and "durable" not in info, info
        assert mirror.claim(EPOCH, 14) is None  # was OLDER: step 13 released
        assert mirror.durable_step() == 13

        # The other store reports: durable is counted again (nothing yet in this picture),
        # and 13 is still kept until a newer step is durable.
        report(other, PEER, "127.0.0.1:9")
        report(coord, HERE, address)
        assert replication.sender.peers
        assert mirror.claim(EPOCH, 14) is None
        for holder, origin, rank in ((PEER, HERE, 0), (HERE, PEER, 1)):
            other.request("replica_verified", {"node_id": holder, "origin": origin,
                                               "epoch": EPOCH, "rank": rank, "step": 14},
                          "ack", 5.0)
        assert mirror.claim(EPOCH, 14) == ClaimAnswer.OLDER
        assert mirror.durable_step() == 14
    finally:
        replication.stop(unlink=True)
        coord.close()
        other.close()
        persister.writer.shutdown(wait=True)
        hashers.shutdown(wait=True)
        old.stop(timeout_s=2)
        new.stop(timeout_s=2)
