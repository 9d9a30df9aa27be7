"""The coordinator at scale: thousands of simulated nodes against a real in-process server.

Every simulated node is what a launcher's reporter is on the wire (its own connection, a
``hello``, heartbeats composed by HeartbeatComposer, signed by the real protocol code).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from conftest import wait_for

from ftrun import exit_codes, jobs, protocol
from ftrun.cli.status import run_status
from ftrun.coordinator import server as server_mod
from ftrun.coordinator.client import HeartbeatComposer, coordinator_client
from ftrun.coordinator.client import request as coordinator_request
from ftrun.coordinator.server import Coordinator

pytestmark = pytest.mark.timeout(120)

JOB = "job-cp"
WORKERS = 8


def node_state(i: int, step: int = 0) -> dict[str, Any]:
    return {
        "state": "healthy", "group_rank": i, "group_world_size": None, "restarts": 0,
        "max_restarts": 3, "last_error": None,
        "workers": [{"local_rank": w, "rank": i * WORKERS + w, "pid": 1000 + w,
                     "state": "healthy", "exitcode": None, "health": "ok", "cause": None,
                     "reason": "x" * 40, "step": step, "progress_age_s": 0.5,
                     "step_interval_s": 1.0, "progress_limit_s": 30.0}
                    for w in range(WORKERS)],
    }


class SimNodes:
    """``n`` simulated node launchers on one ZeroMQ context. They only send: they are given
    the coordinator's incarnation (a real reporter learns it from its first refusal)."""

    def __init__(self, endpoint: str, secret: bytes, n: int, term: int) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, 3 * n + 64)  # a client, its monitor and ZeroMQ's end
        self.nodes = []
        for i in range(n):
            node_id = f"sim-{i:05d}/1"
            self.nodes.append((i, node_id, HeartbeatComposer(node_id, f"sim-{i:05d}", 1),
                               coordinator_client(endpoint, secret, JOB, node_id,
                                                  context=self.ctx, term=term)))

    def join(self) -> None:
        for i, node_id, _, client in self.nodes:
            client.send("hello", {"node_id": node_id, "host": f"sim-{i:05d}", "pid": 1})
        self.beat(0)

    def beat(self, step: int) -> list[str]:
        """One heartbeat from every node (full the first time, then keep-alives)."""
        kinds = []
        for i, _, composer, client in self.nodes:
            kind, body = composer.compose(node_state(i, step), time.monotonic())
            assert client.send(kind, body) is not None
            kinds.append(kind)
        return kinds

    def close(self) -> None:
        for *_, client in self.nodes:
            client.close()
        self.ctx.term()


@pytest.fixture
def make_coordinator(tmp_path: Path) -> Iterator[Callable[[float], Coordinator]]:
    """Starts a coordinator with the given node timeout; stops it after the test."""
    started: list[Coordinator] = []

    def make(node_timeout_s: float) -> Coordinator:
        secret = jobs.load_secret(JOB, str(tmp_path / "state"), create=True)
        c = Coordinator(JOB, secret, bind_host="127.0.0.1", node_timeout_s=node_timeout_s,
                        events_file=tmp_path / "events.jsonl")
        c.start()
        started.append(c)
        return c

    yield make
    for c in started:
        c.stop(timeout_s=5)


def _secret(c: Coordinator) -> bytes:
    return c._secret


def _joined(c: Coordinator, n: int) -> bool:
    """``n`` nodes joined and their first (full) heartbeats read."""
    summary = c.status_document(select="none")["summary"]
    return summary["nodes"] >= n and summary["ranks"] >= n * WORKERS


def test_status_of_thousands_of_nodes_pages_below_the_cap(
        make_coordinator: Callable[[float], Coordinator], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    coordinator = make_coordinator(600.0)
    n = 2048
    sim = SimNodes(coordinator.endpoint, _secret(coordinator), n, coordinator.incarnation)
    try:
        sim.join()
        wait_for(lambda: _joined(coordinator, n), timeout_s=60, what=f"{n} nodes to join")
        secret = _secret(coordinator)
        # Through the wire, page by page: every reply well under the message cap.
        offset: int | None = 0
        pages, listed, largest = 0, [], 0
        while offset is not None:
            reply = coordinator_request(coordinator.endpoint, secret, JOB, "status_request",
                            {"nodes": "all", "offset": offset}, timeout_s=10)
            doc = reply.body["doc"]
            largest = max(largest, len(json.dumps(doc)))
            listed += [node["node_id"] for node in doc["nodes"]]
            offset = doc["page"]["next"]
            pages += 1
            assert doc["summary"]["nodes"] == n and doc["summary"]["ranks"] == n * WORKERS
        assert pages > 1 and largest < protocol.MAX_MESSAGE_BYTES // 2
        assert listed == [f"sim-{i:05d}/1" for i in range(n)]
        # A filter and a summary-only request.
        reply = coordinator_request(coordinator.endpoint, secret, JOB, "status_request",
                        {"nodes": "all", "match": "sim-0100"}, timeout_s=10)
        assert [x["node_id"] for x in reply.body["doc"]["nodes"]] == [
            f"sim-0100{d}/1" for d in range(10)]
        reply = coordinator_request(coordinator.endpoint, secret, JOB, "status_request",
                        {"nodes": "none"}, timeout_s=10)
        assert reply.body["doc"]["nodes"] == [] and reply.body["doc"]["health"] == "healthy"
        assert reply.body["doc"]["detection"] is None

        # ftrun status --json joins the pages into one document.
        state = str(tmp_path / "state")
        monkeypatch.setenv("FTRUN_STATE_DIR", state)
        jobs.write_job_file(jobs.JobFile(JOB, coordinator.endpoint, "h", 1, time.time()),
                            state)
        code = run_status(JOB, endpoint=None, json_out=True, watch=False, no_headers=False,
                          state_dir=None, timeout_s=10)
        doc = json.loads(capsys.readouterr().out)
        assert code == exit_codes.OK and len(doc["nodes"]) == n
        assert doc["page"]["next"] is None
        # The table of a large job: the summary and the nodes with a problem (none).
        code = run_status(JOB, endpoint=None, json_out=False, watch=False, no_headers=False,
                          state_dir=None, timeout_s=10)
        out = capsys.readouterr().out
        assert code == exit_codes.OK
        assert f"{n} node(s), {n * WORKERS} rank(s)" in out
        assert f"listed 0 of 0 node(s) with a problem out of {n}" in out
        assert "sim-00001" not in out
        code = run_status(JOB, endpoint=None, json_out=False, watch=False, no_headers=True,
                          state_dir=None, timeout_s=10, select="all", limit=3, offset=5)
        out = capsys.readouterr().out
        assert "sim-00005" in out and "sim-00007" in out and "sim-00008" not in out
    finally:
        sim.close()


def test_no_false_lost_while_the_coordinator_is_behind(
        make_coordinator: Callable[[float], Coordinator]) -> None:
    """The serving thread stalls (here: something holds the node table for 2.5 node
    timeouts, as a long pause would); every node's heartbeat waits in the queue meanwhile.
    Once it runs again, it is behind by more than a node timeout and has more than one
    batch to read: none of the nodes whose heartbeat is still queued is declared lost."""
    # A node timeout of 3 s: the simulated nodes beat only when told, one after the other, so
    # the last of them beats a round's time after the first; on a loaded 2-CPU machine one
    # round of 2100 (the backlog read, then the next round sent) took over 1 s, and with a
    # 1 s timeout its last nodes were rightly declared lost.
    coordinator = make_coordinator(3.0)
    n = 2 * server_mod.MAX_MESSAGES_PER_TICK + 100
    sim = SimNodes(coordinator.endpoint, _secret(coordinator), n, coordinator.incarnation)
    try:
        sim.join()
        wait_for(lambda: _joined(coordinator, n), timeout_s=60, what=f"{n} nodes to join")

        def keepalives() -> int:
            return sum(r.keepalives for r in coordinator._membership.records())

        # Every node fresh (joining them all may take longer than a node timeout here).
        sim.beat(1)
        wait_for(lambda: keepalives() >= n, timeout_s=60, what="a round of keep-alives")
        seq0 = coordinator.events()[-1]["seq"]
        stall_s = 2.5 * coordinator.node_timeout_s
        with coordinator._membership._lock:
            t0 = time.monotonic()
            kinds = sim.beat(2)
            time.sleep(max(0.0, stall_s - (time.monotonic() - t0)))
        assert set(kinds) == {"keepalive"}
        wait_for(lambda: keepalives() >= 2 * n, timeout_s=60, what="the backlog to be read")
        # Caught up: one more round, then look.
        sim.beat(3)
        wait_for(lambda: keepalives() >= 3 * n, timeout_s=60, what="the next round")
        events = coordinator.events(seq0)
        behind = [e for e in events if e["type"] == "coordinator_caught_up"]
        assert behind and behind[0]["behind_max_s"] > coordinator.node_timeout_s, \
            "the stall did not put the coordinator behind (the fault did not fire)"
        assert [e for e in events if e["type"] == "node_lost"] == []
        doc = coordinator.status_document(select="none")
        assert doc["summary"]["nodes_lost"] == 0 and doc["health"] == "healthy"
    finally:
        sim.close()


def test_heartbeats_unaffected_by_a_flood_of_status_requests(
        make_coordinator: Callable[[float], Coordinator]) -> None:
    """Two clients ask for status pages as fast as they are answered, while 1000
    nodes heartbeat: every node's heartbeats keep being read and nobody is lost."""
    coordinator = make_coordinator(5.0)
    n = 1000
    sim = SimNodes(coordinator.endpoint, _secret(coordinator), n, coordinator.incarnation)
    stop = threading.Event()
    answered = [0]
    errors: list[BaseException] = []

    def flood() -> None:
        client = coordinator_client(coordinator.endpoint, _secret(coordinator), JOB, "flood")
        try:
            while not stop.is_set():
                client.request("status_request", {"nodes": "all", "limit": 256}, None, 30.0)
                answered[0] += 1
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
        finally:
            client.close()

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(2)]
    try:
        sim.join()
        wait_for(lambda: _joined(coordinator, n), timeout_s=60, what=f"{n} nodes to join")
        for t in threads:
            t.start()
        wait_for(lambda: answered[0] >= 8, timeout_s=60, what="the flood to start")
        before = {r.node_id: r.keepalives for r in coordinator._membership.records()}
        for step in range(1, 6):
            sim.beat(step)
            time.sleep(0.2)
        wait_for(lambda: all(r.keepalives >= before.get(r.node_id, 0) + 5
                             for r in coordinator._membership.records()
                             if r.node_id.startswith("sim-")),
                 timeout_s=60, what="every node's keep-alives to be read during the flood")
        flood_answered = answered[0]
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        sim.close()
    assert not errors, errors
    assert flood_answered >= 8
    assert [e for e in coordinator.events() if e["type"] == "node_lost"] == []
