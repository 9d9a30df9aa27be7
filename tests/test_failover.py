"""A coordinator that fails over (``--rdzv-backend etcd``): terms, replays and stepping down.

Against the real 3-member etcd of ftrun.testing.etcd (skipped without etcd, failed instead
under ``FTRUN_REQUIRE_ETCD=1``). The namespace test of a killed coordinator host is
tests/test_failover_integ.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import zmq
from test_etcd import client_fixture, cluster_fixture  # noqa: F401  (a 3-member etcd)

from ftrun import protocol
from ftrun.coordinator.client import coordinator_client, request
from ftrun.coordinator.server import Coordinator
from ftrun.errors import StaleTermError
from ftrun.launcher import etcd
from ftrun.protocol import handshake
from ftrun.protocol.transport import Client, Server
from ftrun.testing import wait_for
from ftrun.testing.etcd import EtcdCluster

SECRET = b"failover-secret"


def heartbeat(state: str, worker: str) -> dict[str, Any]:
    return {"node_id": "n1/1", "host": "n1", "pid": 1, "state": state, "group_rank": 0,
            "group_world_size": 1, "restarts": 0, "max_restarts": 3, "serial": 1,
            "workers": [{"local_rank": 0, "rank": 0, "pid": 11, "state": worker,
                         "exitcode": 1 if worker == "failed" else None}],
            "last_error": None}


def test_a_server_with_a_term_takes_only_its_term_and_a_client_only_its_replies() -> None:
    """The transport part, without etcd: term 7 refuses term 6 and no term (but the
    read-only kinds), says why, and signs its replies with 7; a client on term 6 drops
    them. A client made without a term follows the term named in the refusal: it sends
    again under term 7 (how launchers follow a coordinator without failover that restarted
    under a new incarnation)."""
    server = Server("coordinator", SECRET, "job", {"hello": lambda m: ("ack", {"re": m.id}),
                                                  "status_request": lambda m: ("ack", {})},
                    sender="coordinator", term=7, term_free=frozenset({"status_request"}))
    url = server.bind("tcp://127.0.0.1:*")
    stop = False

    def serve() -> None:
        while not stop:
            server.serve_once(0.05)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    hello = {"node_id": "n", "host": "h", "pid": 1}
    try:
        c = Client(url, SECRET, "job", "n", term=6)
        with pytest.raises(StaleTermError, match="term 6.*is term 7"):
            c.request("hello", hello, "ack", 2.0)
        c.close()
        follower = Client(url, SECRET, "job", "n2")
        assert follower.request("hello", hello, "ack", 2.0).term == 7  # refused, then again
        assert follower.term == 7
        follower.close()
        # Read-only requests are taken of any term; a client without a term (ftrun status)
        # takes any term's reply.
        anyone = Client(url, SECRET, "job", "cli")
        assert anyone.request("status_request", {}, None, 2.0).term == 7
        anyone.close()
        ok = Client(url, SECRET, "job", "n", term=7)
        assert ok.request("hello", hello, "ack", 2.0).term == 7
        ok.retarget(url, 8)  # a client that moved on to another term drops term 7's replies
        with pytest.raises(Exception, match="did not answer"):
            ok.request("status_request", {}, None, 0.5)
        ok.close()
        assert server.counters["stale_terms"] == 2
    finally:
        stop = True
        t.join(5)
        server.close()


def test_captured_failed_heartbeat_is_refused_after_a_failover(
        client: etcd.EtcdClient, tmp_path: Path) -> None:
    """A "failed" heartbeat captured on the wire while term A's coordinator ran is replayed
    to term B's coordinator after a failover: refused, the job's picture unchanged; and by a
    coordinator without failover (its own incarnation)."""
    run_id = f"t-{uuid.uuid4().hex[:8]}"
    a = etcd.CoordinatorElection(client, run_id, "a/1", "a", ttl_s=2)
    b = etcd.CoordinatorElection(client, run_id, "b/1", "b", ttl_s=2)
    assert a.campaign() is None and b.campaign() is not None
    first = Coordinator(run_id, SECRET, role=a, events_file=tmp_path / "events.jsonl")
    first.start()
    a.publish(first.endpoint, "")
    # The launcher's reporter, on term A, says its worker failed; someone captures the frames.
    node = coordinator_client(first.endpoint, SECRET, run_id, "n1/1", term=a.term)
    captured = protocol.encode("heartbeat", heartbeat("healthy", "failed"), secret=SECRET,
                               job=run_id, sender="n1/1", session="c0ffee", counter=5,
                               term=a.term)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    handshake.join(raw, SECRET)
    try:
        raw.connect(f"tcp://{first.endpoint}")
        raw.send_multipart(captured)
        wait_for(lambda: first.status_document()["nodes"], 10, "the first heartbeat")
        assert first.status_document()["health"] == "degraded"  # taken on its own term

        # Term A's holder dies: its lease runs out, B takes the role with a larger term.
        a._stop.set()  # its renewals stop, as with its host
        first.stop()
        wait_for(lambda: b.campaign() is None, 15, "the role to fail over to B")
        assert b.term > a.term
        second = Coordinator(run_id, SECRET, role=b, events_file=tmp_path / "events.jsonl")
        second.start()
        b.publish(second.endpoint, "")
        assert etcd.read_coordinator(client, run_id).term == b.term  # type: ignore[union-attr]
        node.retarget(second.endpoint, b.term)
        node.send("heartbeat", heartbeat("healthy", "healthy"))  # (answered only with orders)
        wait_for(lambda: second.status_document()["health"] == "healthy", 10,
                 "the node's heartbeat to term B")
        raw.disconnect(f"tcp://{first.endpoint}")
        raw.connect(f"tcp://{second.endpoint}")
        raw.send_multipart(captured)
        assert raw.poll(5000)
        answer = protocol.decode(raw.recv_multipart(), secret=SECRET, job=run_id)
        assert answer.kind == "error" and "signed for coordinator term" in \
            answer.body["message"], answer.body
        assert second.counters["stale_terms"] == 1
        assert second.status_document()["health"] == "healthy"
        refused = [e for e in second.events() if e["type"] == "stale_term"]
        assert refused and f"term {a.term}" in refused[0]["reason"], second.events()
        # The event log goes on past term A's numbers.
        assert min(e["seq"] for e in second.events()) > max(e["seq"] for e in first.events())
        second.stop()
        b.resign()

        # A coordinator without failover signs for an incarnation of its own: it refuses
        # the capture too (it used to take it: no term, an empty replay memory).
        plain = Coordinator(run_id, SECRET)
        plain.start()
        raw.disconnect(f"tcp://{second.endpoint}")
        raw.connect(f"tcp://{plain.endpoint}")
        raw.send_multipart(captured)
        wait_for(lambda: plain.counters["stale_terms"] == 1, 10, "the replay refused")
        assert not plain.status_document()["nodes"]
        plain.stop()
    finally:
        raw.close(0)
        node.close()
        a.resign()
        b.resign()


HOLDER = textwrap.dedent("""
    import json, sys, threading
    from pathlib import Path
    from ftrun.coordinator.server import Coordinator
    from ftrun.launcher import etcd
    endpoints, run_id, events = sys.argv[1:4]
    client = etcd.EtcdClient(endpoints, timeout_s=1)
    coordinator = None
    def lost(reason):
        coordinator.step_down(reason)
    election = etcd.CoordinatorElection(client, run_id, "frozen/1", "frozen", ttl_s=2,
                                        on_lost=lost)
    assert election.campaign() is None
    coordinator = Coordinator(run_id, b"failover-secret", role=election,
                              events_file=Path(events))
    coordinator.start()
    election.publish(coordinator.endpoint, "")
    print(json.dumps({"endpoint": coordinator.endpoint, "term": election.term}), flush=True)
    threading.Event().wait()
""")


def test_a_frozen_holder_steps_down_and_decides_nothing(client: etcd.EtcdClient,
                                                        tmp_path: Path,
                                                        cluster: EtcdCluster) -> None:
    """The holder of the role is frozen (SIGSTOP) past its lease: another launcher takes
    the role (a larger term) while it sleeps. Resumed, the frozen coordinator takes no
    message of its term any more (it knows from the clock, before any renewal), records
    that it stepped down, and never writes the job's state again."""
    run_id = f"t-{uuid.uuid4().hex[:8]}"
    events = tmp_path / "frozen-events.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, cluster.endpoints, run_id,
                             str(events)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    taker = etcd.CoordinatorElection(client, run_id, "taker/1", "taker", ttl_s=2)
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        frozen_client = coordinator_client(info["endpoint"], SECRET, run_id, "n1/1",
                                           term=info["term"])
        frozen_client.send("heartbeat", heartbeat("healthy", "healthy"))
        wait_for(lambda: request(info["endpoint"], SECRET, run_id, "status_request", {},
                                 timeout_s=5).body["doc"]["nodes"], 10, "the heartbeat")
        os.kill(proc.pid, signal.SIGSTOP)
        wait_for(lambda: taker.campaign() is None, 20, "the role to pass to another launcher")
        assert taker.term > info["term"]
        assert taker.save("events_seq", 12345)
        os.kill(proc.pid, signal.SIGCONT)
        # Whatever it finds queued on resuming, and anything after, is refused.
        with pytest.raises(StaleTermError, match="stepped down"):
            frozen_client.request("heartbeat", heartbeat("healthy", "failed"), None, 5.0)
        status = request(info["endpoint"], SECRET, run_id, "status_request", {},
                         timeout_s=5).body["doc"]
        assert status["coordinator"]["stepped_down"], status["coordinator"]
        assert status["nodes"][0]["state"] == "healthy"  # the refused "failed" changed nothing
        wait_for(lambda: any(json.loads(ln)["type"] == "coordinator_stepped_down"
                             for ln in events.read_text().splitlines()), 10,
                 "the frozen coordinator's coordinator_stepped_down event")
        # Each of its events names its term (which coordinator recorded it).
        terms = {json.loads(ln).get("term") for ln in events.read_text().splitlines()}
        assert terms == {info["term"]}, terms
        # Its state thread no longer writes: the new holder's value stays.
        assert taker.load("events_seq") == 12345
        frozen_client.close()
    finally:
        proc.kill()
        proc.wait(10)
        taker.resign()


def test_watch_hands_over_a_vacant_role(client: etcd.EtcdClient) -> None:
    """Followers see the holder, then a vacancy once its lease ends (they campaign), then
    the new holder with a larger term."""
    run_id = f"t-{uuid.uuid4().hex[:8]}"
    holder = etcd.CoordinatorElection(client, run_id, "h/1", "h", ttl_s=2)
    assert holder.campaign() is None
    holder.publish("10.0.0.1:1000", "")
    follower = etcd.CoordinatorElection(client, run_id, "f/1", "f", ttl_s=2)
    seen: list[etcd.CoordinatorRecord] = []

    def vacant() -> None:
        if follower.campaign() is None:
            follower.publish("10.0.0.2:2000", "")

    watch = etcd.CoordinatorWatch(client, run_id, 0, seen.append, vacant, poll_s=0.1)
    watch.start()
    try:
        wait_for(lambda: seen, 10, "the holder")
        assert (seen[0].node_id, seen[0].term) == ("h/1", holder.term)
        holder._stop.set()  # dies: no renewal, no revoke
        wait_for(lambda: len(seen) == 2, 20, "the follower to take the role")
        assert seen[1].node_id == "f/1" and seen[1].term > holder.term
        assert seen[1].endpoint == "10.0.0.2:2000"
    finally:
        watch.stop()
        follower.resign()
        holder.resign()
