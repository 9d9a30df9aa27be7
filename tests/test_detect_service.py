"""The detection service's decisions (ftrun.coordinator.detect_service.DetectService) with a
real Detector: which directives it gives for each finding, the exclude list, the isolate
hook, and what it records. ``direct``, ``record`` and ``nodes`` are the coordinator's
callbacks; here they are plain functions that keep what they are given.

Most tests feed reports into the service's detector with times of their own and call
``tick(now)`` themselves (the service thread is not started); the socket tests send real
``coll_report``/``probe_result`` messages to the endpoint ``start()`` returns.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ftrun.coordinator.detect import DetectConfig
from ftrun.coordinator.detect_service import DetectService
from ftrun.errors import FtrunError
from ftrun.protocol.transport import Client

RUN_ID = "detect-service-test"
SECRET = b"s" * 32
INTERVAL = 0.02
WAIT_S = 20.0  # bound on every wait for the service thread or the hook


class Callbacks:
    """The coordinator's side: directives given, events recorded, the live nodes."""

    def __init__(self, nodes: dict[str, dict[str, Any]]) -> None:
        self.nodes = nodes
        self.directives: list[tuple[str, str, dict[str, Any]]] = []
        self.events: list[tuple[str, str | None, dict[str, Any]]] = []
        self._changed = threading.Condition()

    def direct(self, node: str, action: str, data: dict[str, Any]) -> str:
        with self._changed:
            self.directives.append((node, action, data))
            self._changed.notify_all()
            return f"d{len(self.directives)}"

    def record(self, kind: str, node: str | None, data: dict[str, Any]) -> None:
        json.dumps(data)  # the event log is JSON: whatever is recorded must serialise
        with self._changed:
            self.events.append((kind, node, data))
            self._changed.notify_all()

    def live_nodes(self) -> dict[str, dict[str, Any]]:
        return dict(self.nodes)

    def of(self, kind: str) -> list[dict[str, Any]]:
        with self._changed:
            return [d for k, _, d in self.events if k == kind]

    def wait_for(self, kind: str, count: int = 1) -> list[dict[str, Any]]:
        with self._changed:
            ok = self._changed.wait_for(
                lambda: sum(1 for k, _, _ in self.events if k == kind) >= count, WAIT_S)
        assert ok, f"no {kind!r} event within {WAIT_S} s; events: {self.events}"
        return self.of(kind)


def make_nodes(n_nodes: int, nodes_per_host: int = 1,
               probe: bool = False) -> dict[str, dict[str, Any]]:
    return {f"n{i}": {"host": f"h{i // nodes_per_host}",
                      "probe_addr": f"tcp://10.0.0.{i + 1}:7000" if probe else None}
            for i in range(n_nodes)}


def make_service(tmp_path: Path, cb: Callbacks, *, coordinator_host: str = "coord",
                 term: int = 0, **config: Any) -> DetectService:
    return DetectService(RUN_ID, SECRET, DetectConfig(**config), direct=cb.direct,
                         record=cb.record, nodes=cb.live_nodes,
                         coordinator_host=coordinator_host,
                         excluded_file=tmp_path / "excluded.json", bind_host="127.0.0.1",
                         term=term)


class Ranks:
    """n ranks, ``per_node`` a node, ``nodes_per_host`` nodes a host, one allreduce a step
    on group "0"; reports as the ranks send them, fed to the service's detector."""

    def __init__(self, service: DetectService, n: int = 4, per_node: int = 1,
                 nodes_per_host: int = 1, world: str = "h0:29500") -> None:
        self.service = service
        self.n, self.per_node, self.nodes_per_host = n, per_node, nodes_per_host
        self.world = world
        self.rng = random.Random(1)
        # The service's clock: note_restart() stamps its holds with time.monotonic(), which
        # a fixed start (1000.0) passed by only on machines up for longer than that.
        self.now = time.monotonic()
        self.seq = dict.fromkeys(range(n), 0)
        self.op = 0

    def node(self, rank: int) -> str:
        return f"n{rank // self.per_node}"

    def host(self, rank: int) -> str:
        return f"h{rank // self.per_node // self.nodes_per_host}"

    def body(self, rank: int, groups: list[dict[str, Any]]) -> dict[str, Any]:
        self.seq[rank] += 1
        return {"node_id": self.node(rank), "host": self.host(rank), "rank": rank,
                "world_size": self.n, "restart": 0, "pid": 1000 + rank, "backend": "gloo",
                "seq": self.seq[rank], "interval_s": INTERVAL, "world": self.world,
                "groups": groups}

    def report(self, rank: int, groups: list[dict[str, Any]]) -> None:
        self.service.detector.add_report(self.body(rank, groups), self.now)

    def step(self, comm: float = 0.005) -> None:
        self.op += 1
        arrive = {r: 0.1 + self.rng.uniform(0, 0.005) for r in range(self.n)}
        last = max(arrive.values())
        self.now += last + comm
        for r in range(self.n):
            d = int((last - arrive[r] + comm) / INTERVAL) * INTERVAL
            self.report(r, [{"pg": "0", "size": self.n, "enqueued": self.op,
                             "completed": self.op, "waiting_s": None,
                             "done": [[self.op, d]] if d >= INTERVAL else []}])
        self.service.tick(self.now)

    def stall(self, culprit: int, ticks: int = 12) -> None:
        """``culprit`` stops reporting (SIGSTOP) while the others wait in the next op."""
        s = self.op + 1
        for k in range(1, ticks + 1):
            self.now += 0.5
            for r in range(self.n):
                if r != culprit:
                    self.report(r, [{"pg": "0", "size": self.n, "enqueued": s,
                                     "completed": s - 1, "waiting_s": 0.5 * k,
                                     "op": "gloo:all_reduce"}])
            self.service.tick(self.now)

    def new_world(self, world: str) -> None:
        self.world = world
        self.op = 0


def test_silent_rank_hang_restarts_its_node_once_per_fault_until_a_new_world(tmp_path):
    cb = Callbacks(make_nodes(4))
    service = make_service(tmp_path, cb, on_hang="restart")
    job = Ranks(service, n=4)
    for _ in range(10):
        job.step()
    assert cb.directives == [] and cb.of("detection") == []
    job.stall(culprit=2)
    assert [(n, a, d["ranks"]) for n, a, d in cb.directives] == [("n2", "restart", [2])]
    [det] = cb.of("detection")
    assert det["kind"] == "hang" and det["ranks"] == [2] and det["nodes"] == ["n2"]
    assert det["hosts"] == ["h2"] and det["action"] == "restart"
    assert det["evidence"]["reason"] == "silent" and det["evidence"]["pg"] == "0"
    assert "rank(s) 2" in det["summary"]
    # Rank 2 comes back, still behind (its restart has not happened yet), and stops again:
    # the same fault, within the cooldown and the same world: no second restart, and no
    # second detection either (the rank was ordered killed: its silence is a consequence).
    job.now += 0.5
    job.report(2, [{"pg": "0", "size": 4, "enqueued": job.op, "completed": job.op,
                    "waiting_s": None}])
    job.service.tick(job.now)
    job.stall(culprit=2)
    assert len([d for d in cb.directives if d[1] == "restart"]) == 1
    assert len(cb.of("detection")) == 1 and service.counters["followups"] >= 1
    # Nor is another rank of that world going silent (its launcher stopping it for the
    # restart under way): every worker of the world is restarted.
    followups = service.counters["followups"]
    job.report(2, [{"pg": "0", "size": 4, "enqueued": job.op, "completed": job.op,
                    "waiting_s": None}])
    job.stall(culprit=3)
    assert len([d for d in cb.directives if d[1] == "restart"]) == 1
    assert len(cb.of("detection")) == 1 and service.counters["followups"] > followups
    # The job restarted: a new world, and the same fault again is acted on again.
    job.new_world("h0:29501")
    for _ in range(10):
        job.step()
    job.stall(culprit=1)
    assert [(n, a, d["ranks"]) for n, a, d in cb.directives] == [
        ("n2", "restart", [2]), ("n1", "restart", [1])]
    status = service.status()
    assert status["on_hang"] == "restart" and status["excluded"] == {}
    assert status["findings"][-1]["action"] == "restart"
    assert [s["ranks"] for s in status["suspects"]["suspects"]] == [[1]]
    json.dumps(status)


def test_a_launchers_own_restart_holds_findings_about_its_world(tmp_path):
    """A rank dies and its launcher restarts (event ``worker_failure``): the others waiting
    for it are that fault's consequence, not a hang to act on, until the new world reports;
    there, a hang is acted on again, and its order names that world."""
    cb = Callbacks(make_nodes(4))
    service = make_service(tmp_path, cb, on_hang="restart")
    job = Ranks(service, n=4)
    for _ in range(10):
        job.step()
    service.note_restart("n2", "worker_failure")
    job.stall(culprit=2)
    assert cb.directives == [] and cb.of("detection") == []
    assert service.counters["followups"] >= 1
    job.new_world("h0:29502")
    for _ in range(10):
        job.step()
    job.stall(culprit=1)
    assert [(n, a, d["ranks"], d["world"]) for n, a, d in cb.directives] == [
        ("n1", "restart", [1], "h0:29502")]


def test_isolate_excludes_the_host_orders_its_nodes_out_and_runs_the_hook(tmp_path):
    out = tmp_path / "hook.out"
    hook = tmp_path / "hook.sh"
    hook.write_text(f'#!/bin/sh\nprintf "%s|%s" "$1" "$FTRUN_ISOLATE_REASON" > {out}\n')
    hook.chmod(0o755)
    cb = Callbacks(make_nodes(4, nodes_per_host=2))   # h0: n0 n1, h1: n2 n3
    service = make_service(tmp_path, cb, on_hang="isolate", isolate_hook=str(hook))
    job = Ranks(service, n=8, per_node=2, nodes_per_host=2)
    for _ in range(10):
        job.step()
    job.stall(culprit=5)                                 # node n2, host h1
    assert sorted((n, a) for n, a, _ in cb.directives) == [("n2", "isolate"),
                                                           ("n3", "isolate")]
    assert all("h1" in d["reason"] for _, _, d in cb.directives)
    saved = json.loads((tmp_path / "excluded.json").read_text())
    assert list(saved["hosts"]) == ["h1"] and "rank(s) 5" in saved["hosts"]["h1"]["reason"]
    assert os.stat(tmp_path / "excluded.json").st_mode & 0o077 == 0
    [isolated] = cb.of("host_isolated")
    assert isolated["host"] == "h1" and isolated["evidence"]["reason"] == "silent"
    [det] = cb.of("detection")
    assert det["action"] == "isolate" and det["hosts"] == ["h1"]
    [ran] = cb.wait_for("isolate_hook")
    assert ran == {"host": "h1", "exitcode": 0, "stderr": ""}
    host, reason = out.read_text().split("|", 1)
    assert host == "h1" and "rank(s) 5" in reason
    assert service.excluded_hosts() == ["h1"]
    assert list(service.status()["excluded"]) == ["h1"]
    # Told once: later ticks give no second order.
    job.now += 0.5
    service.tick(job.now)
    assert len(cb.directives) == 2


def test_the_coordinators_host_is_never_isolated(tmp_path):
    cb = Callbacks(make_nodes(4))
    service = make_service(tmp_path, cb, coordinator_host="h2", on_hang="isolate")
    job = Ranks(service, n=4)
    for _ in range(10):
        job.step()
    job.stall(culprit=2)                                  # on h2, the coordinator's host
    assert [(n, a, d["ranks"]) for n, a, d in cb.directives] == [("n2", "restart", [2])]
    assert cb.of("isolate_refused") == [{"host": "h2", "reason": "coordinator host"}]
    assert cb.of("host_isolated") == []
    assert not (tmp_path / "excluded.json").exists()
    assert service.excluded_hosts() == []


def test_a_host_excluded_earlier_is_ordered_out_when_its_node_appears(tmp_path):
    (tmp_path / "excluded.json").write_text(json.dumps(
        {"hosts": {"h1": {"reason": "rank 3 hung", "time": 1.0, "evidence": {"pg": "0"}}}}))
    cb = Callbacks({"n0": {"host": "h0", "probe_addr": None}})
    service = make_service(tmp_path, cb)
    service.tick(1.0)
    assert cb.directives == []
    assert service.status()["excluded"] == {"h1": {"reason": "rank 3 hung", "time": 1.0}}
    cb.nodes["n1"] = {"host": "h1", "probe_addr": None}   # a launcher starts on h1
    service.tick(1.5)
    [(node, action, data)] = cb.directives
    assert (node, action) == ("n1", "isolate")
    assert "h1 is on the job's exclude list: rank 3 hung" in data["reason"]
    assert data["evidence"] == {"pg": "0"}
    service.tick(2.0)
    assert len(cb.directives) == 1


@pytest.mark.parametrize("text", ["{not json", json.dumps({"hosts": ["h1"]}),
                                  json.dumps({"nodes": {}})])
def test_an_unreadable_exclude_list_is_a_clear_error(tmp_path, text):
    (tmp_path / "excluded.json").write_text(text)
    cb = Callbacks({})
    with pytest.raises(FtrunError, match="exclude list .*excluded.json is unreadable.*fix or "
                                         "delete it"):
        make_service(tmp_path, cb)


def test_slow_comm_orders_probes_to_the_peers_addresses(tmp_path):
    cb = Callbacks(make_nodes(4, probe=True))
    service = make_service(tmp_path, cb)
    job = Ranks(service, n=8, per_node=2)                # hosts h0..h3, one node each
    for _ in range(50):
        job.step(comm=0.04)
    assert cb.directives == []
    for _ in range(30):
        job.step(comm=0.4)                                # the network got 10x slower
        if cb.directives:
            break
    [det] = cb.of("detection")
    assert det["kind"] == "slow_comm" and det["action"] == "probe"
    probes = {n: d for n, a, d in cb.directives if a == "probe"}
    assert sorted(probes) == ["n0", "n1", "n2", "n3"]
    addr = {n: i["probe_addr"] for n, i in cb.nodes.items()}
    for node, data in probes.items():
        assert data["size"] > 0
        assert sorted(p["node_id"] for p in data["peers"]) == sorted(set(addr) - {node})
        assert all(p["addr"] == addr[p["node_id"]] for p in data["peers"])
        assert all(p["host"] == cb.nodes[p["node_id"]]["host"] for p in data["peers"])


# -- over the service's socket ----------------------------------------------------------------


def _probe_bodies(slow_host: str, n: int = 4) -> list[dict[str, Any]]:
    rng = random.Random(7)
    bodies = []
    for a in range(n):
        results = []
        for b in range(n):
            if a == b:
                continue
            mb_s = 1000.0 * rng.uniform(0.8, 1.2)
            if f"h{a}" == slow_host:
                mb_s = 40.0
            results.append({"peer": f"n{b}", "host": f"h{b}", "rtt_s": 0.001, "mb_s": mb_s})
        bodies.append({"node_id": f"n{a}", "host": f"h{a}", "id": "d1", "results": results})
    return bodies


def test_reports_and_probe_results_over_the_socket(tmp_path):
    cb = Callbacks(make_nodes(4, probe=True))
    service = make_service(tmp_path, cb, on_slow="isolate")
    endpoint = service.start()
    ranks = Ranks(service, n=4)
    clients = []
    try:
        # coll_report, as the ranks send it (no reply).
        rank_clients = [Client(endpoint, SECRET, RUN_ID, f"rank{r}/{1000 + r}",
                               peer="detection service") for r in range(4)]
        clients += rank_clients
        for r, client in enumerate(rank_clients):
            body = ranks.body(r, [{"pg": "0", "size": 4, "enqueued": 3, "completed": 3,
                                   "waiting_s": None, "done": [[3, 0.04]]}])
            assert client.send("coll_report", body) is not None
        deadline = time.monotonic() + WAIT_S
        while service.status()["counters"]["reports"] < 4:
            assert time.monotonic() < deadline, "the service did not read 4 reports"
            time.sleep(0.01)
        suspects = service.status()["suspects"]
        assert suspects["ranks"] == 4 and suspects["groups"] == 1
        assert suspects["world"] == "h0:29500"
        # probe_result, as the launchers send it: acknowledged, recorded, and a slow row
        # names host h2, which on_slow=isolate excludes.
        for body in _probe_bodies("h2"):
            client = Client(endpoint, SECRET, RUN_ID, body["node_id"], peer="detection service")
            clients.append(client)
            reply = client.request("probe_result", body, "ack", WAIT_S)
            assert reply.body["re"]
        assert len(cb.of("probe_result")) == 4
        assert cb.of("probe_result")[0]["id"] == "d1"
        service.tick(time.monotonic())   # or the service thread's own tick: either acts
        cb.wait_for("host_isolated")
        dets = [d for d in cb.of("detection") if d["kind"] == "slow_host"]
        assert [(d["hosts"], d["action"]) for d in dets] == [(["h2"], "isolate")]
        assert dets[0]["evidence"]["slow"] == ["row"]
        assert [(n, a) for n, a, _ in cb.directives] == [("n2", "isolate")]
        probes = service.status()["suspects"]["probes"]
        assert len(probes) == 12 and {p["src"] for p in probes} == {"h0", "h1", "h2", "h3"}
        assert service.status()["counters"]["probe_results"] == 4
    finally:
        for client in clients:
            client.close()
        service.stop()


def test_a_hook_that_fails_is_recorded(tmp_path):
    cb = Callbacks(make_nodes(2))
    service = make_service(tmp_path, cb, isolate_hook=f"{sys.executable} -c "
                                                      "'import sys; sys.exit(3)'")
    service.isolate("h1", "drill")
    [ran] = cb.wait_for("isolate_hook")
    assert ran["host"] == "h1" and ran["exitcode"] == 3
    assert [(n, a) for n, a, _ in cb.directives] == [("n1", "isolate")]
    service.isolate("h1", "again")                       # already excluded: nothing new
    assert len(cb.of("host_isolated")) == 1 and len(cb.directives) == 1


def test_an_exclude_list_with_a_malformed_entry_is_a_clear_error(tmp_path: Path) -> None:
    """A hand-edited entry that is not an object with a reason would break every status
    and every decision later: it is refused when the service starts, naming the host."""
    path = tmp_path / "excluded.json"
    path.write_text(json.dumps({"hosts": {"h1": {"reason": "drain"}, "h2": "bad"}}))
    with pytest.raises(FtrunError, match="h2"):
        DetectService("job", b"s", DetectConfig(), direct=lambda *a: "", record=lambda *a: None,
                      nodes=dict, coordinator_host="c", excluded_file=path)
    path.write_text(json.dumps({"hosts": {"h1": {"reason": "drain"}}}))
    service = DetectService("job", b"s", DetectConfig(), direct=lambda *a: "",
                            record=lambda *a: None, nodes=dict, coordinator_host="c",
                            excluded_file=path)
    assert service.status()["excluded"] == {"h1": {"reason": "drain", "time": None}}


def test_a_report_captured_before_a_restart_is_refused_after_it_and_senders_follow(tmp_path):
    """The detection service signs for its coordinator's incarnation: a collective report
    captured for one incarnation (one saying a rank waits: a false hang if taken again) is
    refused by the next; a rank's monitor, which only sends, learns the new incarnation from
    the refusal of its first report and its next reports are taken."""
    import zmq
    from conftest import wait_for

    from ftrun import protocol
    from ftrun.protocol import handshake

    cb = Callbacks(make_nodes(2))
    second = make_service(tmp_path, cb, term=22)  # the restarted coordinator's (was 11)
    ranks = Ranks(second, n=2)
    endpoint = second.start()
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    handshake.join(raw, SECRET)
    raw.connect(f"tcp://{endpoint}")
    monitor = Client(endpoint, SECRET, RUN_ID, "rank0/1000", peer="detection service",
                     follow_on_send=True)
    try:
        body = ranks.body(1, [{"pg": "0", "size": 2, "enqueued": 4, "completed": 3,
                               "waiting_s": 30.0, "done": [[3, 0.04]]}])
        raw.send_multipart(protocol.encode("coll_report", body, secret=SECRET, job=RUN_ID,
                                           sender="rank1/1001", term=11))
        counters = second._service.server.counters
        wait_for(lambda: counters["stale_terms"] >= 1, WAIT_S, "the captured report refused")
        assert second.status()["counters"]["reports"] == 0

        def sent_and_taken() -> bool:
            ok = monitor.send("coll_report", ranks.body(0, [
                {"pg": "0", "size": 2, "enqueued": 3, "completed": 3, "waiting_s": None,
                 "done": [[3, 0.04]]}]))
            assert ok is not None
            return second.status()["counters"]["reports"] >= 1

        wait_for(sent_and_taken, WAIT_S, "the monitor's reports taken under the new term")
        assert monitor.term == 22
    finally:
        raw.close(0)
        monitor.close()
        second.stop()
