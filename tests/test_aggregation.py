"""Reports aggregated on the way (ftrun.coordinator.aggregation, .relay, membership's handover):
the plan, the judgement of members whose aggregator fell silent, and real reporters in their
own processes against a real coordinator, an aggregator SIGKILLed among them."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from conftest import wait_for as harness_wait_for

from ftrun.coordinator import relay as relay_mod
from ftrun.coordinator.aggregation import Groups, parse_group_size
from ftrun.coordinator.membership import Membership, NodeRecord
from ftrun.coordinator.relay import GroupRelay
from ftrun.coordinator.server import Coordinator
from ftrun.protocol.transport import Client
from ftrun.testing.procs import kill_sessions

pytestmark = pytest.mark.timeout(60)

JOB = "job-aggr"
SECRET = b"0123456789abcdef0123456789abcdef"
REPO = Path(__file__).resolve().parent.parent
wait_for = functools.partial(harness_wait_for, timeout_s=15.0, what="condition",
                             interval_s=0.05)


def record(i: int, rank: int | None, addr: str = "", **kw: Any) -> NodeRecord:
    r = NodeRecord(f"n{i}/1", f"n{i}", 1, 0.0, 0.0, 0.0, **kw)
    r.fields = {"group_rank": rank, "aggr_addr": addr or None}
    return r


# -- the plan --------------------------------------------------------------------------------


def test_a_job_no_larger_than_a_group_is_never_told_anything() -> None:
    groups = Groups(4)
    nodes = [record(i, i) for i in range(4)]
    assert groups.refresh(nodes, 1) == []
    assert not groups.active
    assert all(groups.tell(n.node_id, None) is None for n in nodes)
    for size in (0, 1):  # aggregation off, whatever the job's size
        off = Groups(size)
        off.refresh([record(i, i) for i in range(100)], 1)
        assert not off.active and off.tell("n5/1", None) is None


def test_groups_by_node_rank_aggregator_first_members_once_it_listens() -> None:
    groups = Groups(2)
    nodes = [record(i, 4 - i) for i in range(5)]  # node rank 4 - i: n4 has rank 0
    groups.refresh(nodes, 1)
    # Groups {0,1}, {2,3}, {4}: the lowest rank of each aggregates; a group of one is direct.
    assert groups.summary()["groups"] == 2
    agg = groups.tell("n4/1", None)
    assert agg is not None and agg["action"] == "aggregate"
    assert agg["data"]["via"] == "n4/1" and agg["data"]["group"] == 0
    assert groups.tell("n2/1", None)["data"]["via"] == "n2/1"  # rank 2: group 1
    assert groups.tell("n0/1", None) is None  # rank 4 alone in group 2: direct, never told
    # Members are told nothing to do until their aggregator says where it listens.
    assert groups.tell("n3/1", None) is None
    # A launcher following its plan is not told again.
    assert groups.tell("n4/1", agg["data"]["plan"]) is None
    nodes[4].fields["aggr_addr"] = "10.0.0.4:5000"
    groups.refresh(nodes, 2)
    member = groups.tell("n3/1", None)
    assert member is not None and member["data"]["via"] == "n4/1"
    assert member["data"]["addr"] == "10.0.0.4:5000"
    assert groups.tell("n1/1", None) is None  # its aggregator (n2) has no address yet
    assert groups.refresh(nodes, 2) == []  # the same table: nothing planned again
    assert groups.summary()["members_via_aggregator"] == 1


def test_the_aggregator_is_handed_on_when_lost_and_kept_while_live() -> None:
    groups = Groups(3)
    nodes = [record(i, i, addr=f"10.0.0.{i}:5000") for i in range(6)]
    groups.refresh(nodes, 1)
    assert groups.plan_of("n1/1").via == "n0/1"
    # A new launcher of lower rank does not take the role from a live aggregator.
    nodes[0].fields["group_rank"] = 1
    nodes[1].fields["group_rank"] = 0
    groups.refresh(nodes, 2)
    assert groups.plan_of("n1/1").via == "n0/1"
    nodes[0].lost = True
    assert groups.refresh(nodes, 3) == [(0, "n0/1", "n1/1")]
    assert groups.plan_of("n2/1").via == "n1/1"
    assert groups.plan_of("n1/1").via == "n1/1"
    told = groups.tell("n2/1", None)
    assert told is not None and told["data"]["addr"] == "10.0.0.1:5000"
    assert groups.summary()["handovers"] == 1
    # Fewer launchers than a group holds: everyone that was told otherwise goes direct.
    for n in nodes[1:4]:
        n.left = True
    groups.refresh(nodes, 4)
    assert not groups.active
    assert groups.plan_of("n4/1").via == "" and groups.tell("n4/1", None) is not None


def test_the_coordinators_host_aggregates_only_when_no_other_member_can() -> None:
    groups = Groups(2, coordinator_host="n0")
    nodes = [record(i, i) for i in range(4)]
    groups.refresh(nodes, 1)
    assert groups.plan_of("n1/1").via == "n1/1"  # not n0, the coordinator's host
    assert groups.plan_of("n2/1").via == "n2/1"
    nodes[1].lost = True
    nodes[2].fields["group_rank"] = 1
    nodes[3].fields["group_rank"] = 2
    groups.refresh(nodes, 2)  # group 0 is n0 and n2 now; group 1 is n3 alone
    assert groups.plan_of("n2/1").via == "n2/1" and groups.plan_of("n3/1") is None


def test_group_size_knob_is_checked() -> None:
    assert parse_group_size("8", "FTRUN_AGGREGATE_GROUP") == 8
    for bad in ("-1", "x", "2.5"):
        with pytest.raises(ValueError, match="FTRUN_AGGREGATE_GROUP.*whole number"):
            parse_group_size(bad, "FTRUN_AGGREGATE_GROUP")


# -- members' silence while their aggregator is silent ----------------------------------------


def beat(ms: Membership, node: str, t: float, via: str | None = None) -> None:
    ms.keepalive(node, 0, t, t, via)


def test_a_member_is_not_lost_while_its_aggregator_is_the_silent_one() -> None:
    ms = Membership(node_timeout_s=10.0)
    for t in range(5):  # both beat every second, the member through the aggregator
        beat(ms, "agg", float(t), via="agg")
        beat(ms, "m", float(t), via="agg")
        beat(ms, "direct", float(t))
    # The aggregator dies at t=4: nobody hears from the member either. While nodes fail
    # (early judgement), the aggregator and a silent direct node are lost; the member is not.
    assert sorted(n for n, *_ in ms.check_lost_early(7.5)) == ["agg", "direct"]
    m = ms.get("m")
    assert not m.lost and m.via is None and m.last_seen_mono == 7.5
    # Handover: its silence counts from the aggregator's loss, and by the timeout: its
    # first direct report may take longer than an early limit.
    assert ms.check_lost_early(11.0) == []
    beat(ms, "m", 11.5)
    assert ms.check_lost_early(14.0) == [] and ms.check_lost(21.0) == []
    assert not ms.get("m").lost
    # Twice beaten, it is judged as any node again.
    beat(ms, "m", 12.5)
    assert [n for n, *_ in ms.check_lost_early(16.0)] == ["m"]


def test_a_member_that_went_down_with_its_aggregator_is_lost_one_timeout_later() -> None:
    ms = Membership(node_timeout_s=10.0)
    for t in range(3):
        beat(ms, "agg", float(t), via="agg")
        beat(ms, "m", float(t), via="agg")
    assert [n for n, *_ in ms.check_lost(13.0)] == ["agg"]
    assert ms.check_lost(22.5) == []
    assert [n for n, *_ in ms.check_lost(23.5)] == ["m"]


def test_a_member_silent_while_its_aggregator_reports_is_judged_as_any_node() -> None:
    ms = Membership(node_timeout_s=10.0)
    for t in range(3):
        beat(ms, "m", float(t), via="agg")
    for t in range(20):
        beat(ms, "agg", float(t), via="agg")
    assert [n for n, *_ in ms.check_lost(19.0)] == ["m"]
    assert not ms.get("agg").lost


def test_an_aggregator_that_says_bye_hands_its_members_over() -> None:
    ms = Membership(node_timeout_s=10.0)
    beat(ms, "agg", 0.0, via="agg")
    beat(ms, "m", 0.0, via="agg")
    ms.leave("agg", "succeeded", 0, 5.0, 5.0)
    assert ms.get("m").via is None and ms.get("m").last_seen_mono == 5.0
    assert ms.check_lost(14.0) == []
    assert [n for n, *_ in ms.check_lost(15.5)] == ["m"]


# -- the aggregator's relay ---------------------------------------------------------------------


def heartbeat(node: str, serial: int, workers: int = 1) -> dict[str, Any]:
    return {"node_id": node, "host": node, "pid": 1, "state": "healthy", "group_rank": 1,
            "group_world_size": 3, "restarts": 0, "max_restarts": 3, "last_error": None,
            "serial": serial, "workers": [{"local_rank": i, "rank": i, "pid": 1,
                                           "state": "healthy", "exitcode": None}
                                          for i in range(workers)]}


def test_the_relay_sends_its_members_reports_on_and_hands_their_directives_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = zmq.Context()
    relay = GroupRelay(SECRET, JOB, "agg/1", "127.0.0.1", ctx, interval_s=0.5)
    answers: list[Any] = []
    members = [Client(relay.address, SECRET, JOB, f"m{i}/1", context=ctx,
                      on_reply=answers.append) for i in range(3)]
    try:
        def send(i: int, kind: str, body: dict[str, Any]) -> None:
            n = len(answers)
            members[i].send(kind, body)
            wait_for(lambda: relay.serve() + members[i].poll(0.01) >= 0 and len(answers) > n,
                     what=f"the relay's answer to m{i}")

        send(0, "heartbeat", heartbeat("m0/1", 4))
        # A keep-alive while its full heartbeat waits: the full one goes, with its acks.
        send(0, "keepalive", {"node_id": "m0/1", "same": 4, "acked": ["d1"], "plan": 7})
        send(1, "keepalive", {"node_id": "m1/1", "same": 2})
        relay.add_own("keepalive", {"node_id": "agg/1", "same": 9})
        [batch] = relay.batches()
        assert [(h.node_id, h.acked) for h in batch.heartbeats] == [("m0/1", ["d1"])]
        assert sorted(k.node_id for k in batch.keepalives) == ["agg/1", "m1/1"]
        assert relay.batches() == []  # sent on: nothing waits
        # The coordinator's answer: the aggregator's own directives now, a member's in the
        # relay's answer to its next report.
        relay.sent(time.monotonic())
        order = {"id": "d2", "action": "restart", "data": {"ranks": [1]}}
        own = relay.deliver({"members": [
            {"node_id": "agg/1", "directives": [{"id": "d3", "action": "probe", "data": {}}]},
            {"node_id": "m1/1", "directives": [order]}]})
        assert [d["id"] for d in own] == ["d3"]
        send(1, "keepalive", {"node_id": "m1/1", "same": 2})
        assert answers[-1].body["directives"] == [order]
        send(1, "keepalive", {"node_id": "m1/1", "same": 2})
        assert answers[-1].body["directives"] == []  # handed on once
        # Large groups go on in several messages, each within the size budget.
        monkeypatch.setattr(relay_mod, "BATCH_BYTES", 4000)
        for i in range(6):
            relay.add_own("heartbeat", heartbeat("agg/1", i, workers=4))
            relay._heartbeats[f"x{i}/1"] = relay._heartbeats.pop("agg/1")
        assert [len(b.heartbeats) for b in relay.batches()] == [2, 2, 2]
        # The coordinator stops answering: the relay stops answering its members, who then
        # report directly.
        relay.sent(time.monotonic() - 60)
        assert not relay.upstream_ok(time.monotonic())
        n = len(answers)
        members[2].send("keepalive", {"node_id": "m2/1", "same": 1})
        wait_for(lambda: relay.serve() and relay.counters["unanswered"] == 1,
                 what="the report taken")
        members[2].poll(0.2)
        assert len(answers) == n
    finally:
        for c in members:
            c.close()
        relay.close()
        ctx.term()


# -- real reporters, a real coordinator --------------------------------------------------------

REPORTER = """
import sys, time
from ftrun.coordinator.client import NodeReporter
endpoint, node, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
def state():
    return {"state": "healthy", "group_rank": rank, "group_world_size": 6, "restarts": 0,
            "max_restarts": 3, "last_error": None, "probe_addr": "127.0.0.1:1",
            "workers": [{"local_rank": 0, "rank": rank, "pid": 1, "state": "healthy",
                         "exitcode": None}]}
r = NodeReporter(endpoint, bytes.fromhex(sys.argv[4]), sys.argv[5], node, node, state,
                 interval_s=0.2)
r.start()
time.sleep(120)
"""


@pytest.fixture
def reporters(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    kill_sessions(procs)


def test_reporters_aggregate_a_killed_or_frozen_aggregator_causes_no_false_lost(
        tmp_path: Path, reporters: list[subprocess.Popen[str]]) -> None:
    c = Coordinator(JOB, SECRET, bind_host="127.0.0.1", node_timeout_s=3.0,
                    events_file=tmp_path / "events.jsonl", aggregate_group=3)
    c.start()
    try:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        for i in range(6):
            log = open(tmp_path / f"reporter{i}.log", "w")  # noqa: SIM115
            reporters.append(subprocess.Popen(
                [sys.executable, "-c", REPORTER, c.endpoint, f"node{i}/1", str(i),
                 SECRET.hex(), JOB], env=env, stdout=log, stderr=subprocess.STDOUT,
                text=True, start_new_session=True))
        # Two groups of three: node0 and node3 aggregate, the others report through them.
        wait_for(lambda: c.status_document(select="none")["coordinator"]["aggregation"]
                 ["members_via_aggregator"] == 4, what="every member pointed at its aggregator")
        agg = c.status_document(select="none")["coordinator"]["aggregation"]
        assert agg["groups"] == 2 and agg["aggregators"] == ["node0/1", "node3/1"]
        counters = c.counters
        wait_for(lambda: c.counters.get("messages", 0) > 0, what="messages")
        # Members' reports arrive inside aggregates: their records say so.
        wait_for(lambda: all(c._membership.get(f"node{i}/1").via == f"node{3 * (i // 3)}/1"
                             for i in (1, 2, 4, 5)), what="reports through the aggregators")
        before = dict(counters)
        time.sleep(1.0)  # noqa: TID251 - a window to count messages in, not a synchronisation
        per_s = (c.counters["messages"] - before["messages"]) / 1.0
        # Six launchers at 5 reports a second would be ~30 messages; two aggregators send ~10.
        assert per_s < 20, per_s
        # The aggregator of group 0 dies.
        os.killpg(reporters[0].pid, signal.SIGKILL)
        reporters[0].wait(10)
        wait_for(lambda: any(e["type"] == "aggregator_handover" for e in c.events()),
                 what="the role handed on")
        handover = next(e for e in c.events() if e["type"] == "aggregator_handover")
        assert handover["node"] == "node1/1" and handover["from"] == "node0/1"
        wait_for(lambda: c._membership.get("node2/1").via == "node1/1",
                 what="node2 reporting through node1")
        lost = [e["node"] for e in c.events() if e["type"] == "node_lost"]
        assert lost == ["node0/1"], lost
        doc = c.status_document()
        assert [n["node_id"] for n in doc["nodes"] if n["lost"]] == ["node0/1"]
        # The new aggregator freezes (as behind a cut link: its connections stay, nothing
        # answers): its member reports directly, and only the frozen one is lost.
        os.killpg(reporters[1].pid, signal.SIGSTOP)
        wait_for(lambda: [e for e in c.events() if e["type"] == "node_lost"
                          and e["node"] == "node1/1"], what="node1 lost")
        wait_for(lambda: c._membership.get("node2/1").via is None, what="node2 direct")
        os.killpg(reporters[1].pid, signal.SIGCONT)
        wait_for(lambda: [e for e in c.events() if e["type"] == "node_joined"
                          and e["node"] == "node1/1" and e.get("rejoined")], what="node1 back")
        lost = [e["node"] for e in c.events() if e["type"] == "node_lost"]
        assert lost == ["node0/1", "node1/1"], lost
    finally:
        c.stop(timeout_s=2)
