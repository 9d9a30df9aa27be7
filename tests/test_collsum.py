"""Collective reports summarised on the way (ftrun.coordinator.collsum) and the hang rules
applied to the summaries (Detector.add_summary): the same culprits as from every report."""

from __future__ import annotations

from typing import Any

import pytest

from ftrun.coordinator import collsum
from ftrun.coordinator.collsum import Collector, merge
from ftrun.coordinator.detect import DetectConfig, Detector
from ftrun.protocol import messages as m

PER_NODE = 4


def node_of(rank: int) -> str:
    return f"n{rank // PER_NODE}"


def report(rank: int, enqueued: int, completed: int, waiting_s: float | None,
           seq: int = 1, world: str = "w1", other: dict[str, Any] | None = None,
           size: int = 16, leaving: bool = False) -> dict[str, Any]:
    groups = [{"pg": "0", "size": size, "enqueued": enqueued, "completed": completed,
               "waiting_s": waiting_s}]
    if waiting_s is not None:
        groups[0]["op"] = "allreduce"
    if other is not None:
        groups.append(other)
    body = {"node_id": node_of(rank), "host": f"h{rank // PER_NODE}", "rank": rank,
            "world_size": size, "restart": 0, "pid": 1000 + rank, "backend": "gloo",
            "seq": seq, "interval_s": 0.02, "groups": groups, "world": world}
    if leaving:
        body["leaving"] = True
    return body


def summaries(reports: list[dict[str, Any]], now: float, groups_of: int = 2
              ) -> list[dict[str, Any]]:
    """Each node's summary, merged per ``groups_of`` nodes as an aggregator would."""
    collectors: dict[str, Collector] = {}
    for r in reports:
        collectors.setdefault(r["node_id"], Collector(r["node_id"])).add_report(r, now)
    nodes = sorted(collectors)
    out = []
    for i in range(0, len(nodes), groups_of):
        part = [collectors[n].summary(now) for n in nodes[i:i + groups_of]]
        merged = merge(nodes[i], i + 1, [p for p in part if p is not None])
        assert merged is not None
        m.validate("coll_summary", merged)  # what travels is a valid message
        out.append(merged)
    return out


def both(reports: list[dict[str, Any]], now: float = 100.0, **cfg: Any
         ) -> tuple[list, list]:
    """Findings of the per-rank analysis and of the summarised one, on the same reports."""
    config = DetectConfig(**cfg)
    plain, summed = Detector(config), Detector(config)
    for r in reports:
        plain.add_report(r, now)
    for s in summaries(reports, now):
        summed.add_summary(s, now)
    return plain.analyse(now), summed.analyse(now)


def test_one_rank_that_never_entered_the_op_is_named_from_summaries_as_from_reports() -> None:
    # 16 ranks; rank 5 is stuck before op 41 (it waits in no collective: busy_hang_s) while
    # the others have waited 70 s in it.
    reports = [report(r, 41, 40, 70.0) if r != 5 else report(r, 40, 40, None)
               for r in range(16)]
    plain, summed = both(reports)
    assert [(f.kind, f.ranks) for f in plain] == [("hang", (5,))]
    assert [(f.kind, f.ranks, f.hosts, f.nodes) for f in summed] == \
        [("hang", (5,), ("h1",), ("n1",))]
    ev = summed[0].evidence
    assert (ev["reason"], ev["seq"], ev["waiting_ranks"], ev["behind_ranks"]) == \
        ("behind", 41, 15, 1)


def test_a_culprit_waiting_in_another_group_is_named_after_the_short_threshold() -> None:
    side = {"pg": "1", "size": 2, "enqueued": 3, "completed": 2, "waiting_s": 4.0}
    reports = [report(r, 41, 40, 4.0) if r != 9 else report(r, 40, 40, None, other=side)
               for r in range(16)]
    plain, summed = both(reports)
    assert [(f.kind, f.ranks) for f in plain] == [("hang", (9,))]
    assert [(f.kind, f.ranks) for f in summed] == [("hang", (9,))]
    assert summed[0].evidence["waiting_elsewhere"] == {"9": {"pg": "1", "seq": 3,
                                                             "waiting_s": 4.0}}
    # Without the side wait, 4 s is far below busy_hang_s: nobody is named yet.
    reports[9] = report(9, 40, 40, None)
    assert both(reports) == ([], [])


def test_a_silent_launcher_is_named_once_others_wait() -> None:
    config = DetectConfig()
    det = Detector(config)
    reports = [report(r, 41, 40, 0.5) for r in range(16)]
    for s in summaries(reports, 100.0):
        det.add_summary(s, 100.0)
    assert det.analyse(100.0) == []
    # Node n2 (ranks 8-11) stops reporting; the others keep waiting.
    later = [report(r, 41, 40, 4.5, seq=2) for r in range(16) if node_of(r) != "n2"]
    for s in summaries(later, 104.0):
        det.add_summary(s, 104.0)
    found = det.analyse(104.0)
    assert [(f.kind, f.ranks, f.evidence["reason"]) for f in found] == \
        [("hang", (8, 9, 10, 11), "silent")]


def test_ranks_that_left_are_not_silent_and_an_all_waiting_group_is_a_comm_hang() -> None:
    # The end of a job: launcher n3's ranks leave and it stops; the others still wait in
    # their last collective. Nobody is named.
    det = Detector(DetectConfig())
    end = [report(r, 41, 40, 0.5, leaving=r >= 12) for r in range(16)]
    for s in summaries(end, 100.0):
        det.add_summary(s, 100.0)
    later = [report(r, 41, 40, 5.0, seq=2) for r in range(12)]
    for s in summaries(later, 105.0):
        det.add_summary(s, 105.0)
    assert det.analyse(105.0) == []
    reports = [report(r, 41, 40, 5.0) for r in range(16)]
    plain, summed = both(reports)
    assert [f.kind for f in plain] == ["comm_hang"]
    assert [(f.kind, f.evidence["seq"], f.evidence["members"]) for f in summed] == \
        [("comm_hang", 41, 16)]
    # One rank short of the group: no comm_hang named.
    assert both(reports[:-1])[1] == []


def test_a_tie_names_nobody_and_short_waits_name_nobody() -> None:
    reports = [report(r, 41, 40, 70.0) if r < 8 else report(r, 40, 40, None)
               for r in range(16)]
    assert both(reports)[1] == []
    reports = [report(r, 41, 40, 1.0) if r != 3 else report(r, 40, 40, None)
               for r in range(16)]
    assert both(reports) == ([], [])


def test_classes_count_exactly_and_list_few_ranks_and_waits_age_on_the_way() -> None:
    c = Collector("n0")
    for r in range(12):
        c.add_report(report(r, 41, 40, 1.0) if r != 7 else report(r, 40, 40, None), 10.0)
    s = c.summary(10.5)
    assert s is not None
    (g,) = s["groups"]
    by = {(k["enqueued"], k["completed"]): k for k in g["classes"]}
    assert by[(41, 40)]["count"] == 11 and by[(41, 40)]["waiting"] == 11
    assert by[(41, 40)]["ranks"] == [0, 1, 2, 3, 4, 5, 6, 8]  # CLASS_RANKS lowest
    assert by[(41, 40)]["waiting_max_s"] == pytest.approx(1.5)
    assert by[(40, 40)] == {"enqueued": 40, "completed": 40, "count": 1, "ranks": [7],
                            "waiting": 0}
    aged = collsum.age(s, 0.25)
    assert aged["groups"][0]["classes"][0]["waiting_min_s"] == pytest.approx(1.75)
    # The roster goes with the first summary and when it changes, not every time.
    assert len(s["roster"]) == 12 and "roster" not in (c.summary(10.6) or {})


def test_reports_of_an_earlier_world_are_left_out() -> None:
    c = Collector("n0")
    assert c.add_report(report(0, 5, 4, None, world="w1"), 1.0)
    assert c.add_report(report(0, 2, 1, None, world="w2", seq=2), 2.0)
    assert not c.add_report(report(1, 9, 9, None, world="w1", seq=3), 3.0)
    s = c.summary(3.0)
    assert s is not None and s["world"] == "w2" and s["groups"][0]["members"] == 1
    det = Detector(DetectConfig())
    det.add_summary(dict(s, world="w1"), 2.9)
    det.add_summary(s, 3.0)
    det.add_summary(dict(s, world="w1"), 3.1)  # retired world: ignored
    assert det.world == "w2" and det.summaries == 2


def test_summaries_travel_through_the_aggregator_merged_to_the_detection_service() -> None:
    """Real sockets: ranks report to their launchers' relays; the member's summary goes to
    its aggregator, which sends one summary of both launchers' ranks to the detection
    service. Below the summary size, reports go on as they came."""
    import time

    import zmq

    from ftrun.coordinator.relay import CollRelay, GroupRelay, UpstreamLink
    from ftrun.protocol.transport import Client, Server

    secret, job = b"k" * 32, "collsum-test"
    ctx: zmq.Context[Any] = zmq.Context()
    got: list[tuple[str, dict[str, Any]]] = []
    detect = Server("detect", secret, job,
                    {"coll_summary": lambda msg: got.append(("summary", msg.body)),
                     "coll_report": lambda msg: got.append(("report", msg.body))},
                    sender="coordinator")
    closers: list[Any] = [detect]
    try:
        addr = detect.bind_tcp("127.0.0.1", ctx)
        agg = CollRelay(secret, job, "n0", ctx, summary_ranks=8)
        member = CollRelay(secret, job, "n1", ctx, summary_ranks=8)
        group = GroupRelay(secret, job, "n0", "127.0.0.1", ctx, 1.0,
                           on_summary=agg.add_member_summary)
        link = UpstreamLink("n0", group.address, secret, job, "n1", ctx, 1.0, lambda _m: None)
        closers += [agg, member, group, link]
        for relay in (agg, member):
            relay.set_detect(addr)
        link.confirmed = True  # as after the aggregator's first answer
        ranks = {r: Client(agg.address if r < PER_NODE else member.address, secret, job,
                           f"rank{r}/1", context=ctx) for r in range(8)}
        closers += list(ranks.values())

        def run(until: Any, world_size: int) -> None:
            deadline = time.monotonic() + 10
            seq = 0
            while time.monotonic() < deadline and not until():
                seq += 1
                for r, client in ranks.items():
                    body = report(r, 41, 40, 0.5 if r != 6 else None, seq=seq, size=world_size)
                    body["world_size"] = world_size
                    if r == 6:
                        body["groups"][0].update(enqueued=40)
                    client.send("coll_report", body)
                for _ in range(5):
                    now = time.monotonic()
                    member.pump(now, False, link)
                    group.serve()
                    agg.pump(now, True, None)
                    detect.serve_once(0.02)

        # Below the summary size: every report as it came.
        run(lambda: len({b["rank"] for k, b in got if k == "report"}) == 8, 4)
        assert {k for k, _ in got} == {"report"}
        got.clear()
        # At the summary size: one summary of both launchers, through the aggregator.
        run(lambda: any(k == "summary" and len(b["nodes"]) == 2 for k, b in got), 8)
        summary = next(b for k, b in got if k == "summary" and len(b["nodes"]) == 2)
        assert summary["node_id"] == "n0" and sorted(summary["nodes"]) == ["n0", "n1"]
        (g,) = summary["groups"]
        by = {(c["enqueued"], c["completed"]): c for c in g["classes"]}
        assert g["members"] == 8 and by[(40, 40)]["ranks"] == [6] and by[(41, 40)]["count"] == 7
        assert member.counters["via_aggregator"] > 0 and agg.counters["member_summaries"] > 0
    finally:
        for c in closers:
            c.close()
        ctx.term()


def test_a_summary_size_that_is_not_a_number_of_ranks_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ftrun.coordinator.client import _summary_ranks
    from ftrun.errors import ConfigError

    for bad in ("many", "-1", "1.5"):
        monkeypatch.setenv("FTRUN_COLL_SUMMARY_RANKS", bad)
        with pytest.raises(ConfigError, match="FTRUN_COLL_SUMMARY_RANKS.*whole number"):
            _summary_ranks()
    monkeypatch.setenv("FTRUN_COLL_SUMMARY_RANKS", "0")
    assert _summary_ranks() == 0


def test_malformed_lists_in_a_summary_are_skipped_not_fatal() -> None:
    reports = [report(r, 41, 40, 70.0) if r != 5 else report(r, 40, 40, None)
               for r in range(16)]
    det = Detector(DetectConfig())
    for s in summaries(reports, 100.0):
        s["roster"] = [*s.get("roster", []), [1, 2], ["x", "n", "h"]]
        s["silent"] = [[3], ["r", 1.0]]
        for c in s["groups"][0]["classes"]:
            c["elsewhere"] = [[5, "1"]]
        det.add_summary(s, 100.0)
    assert [(f.kind, f.ranks) for f in det.analyse(100.0)] == [("hang", (5,))]


def test_a_merge_while_a_new_world_forms_keeps_the_senders_world() -> None:
    old = [report(r, 9, 9, None, world="h:9000") for r in range(4, 8)]
    new = [report(r, 1, 1, None, world="h:10000") for r in range(4)]
    mine, theirs = Collector("n0"), Collector("n1")
    for r in new:
        mine.add_report(r, 1.0)
    for r in old:
        theirs.add_report(r, 1.0)
    merged = merge("n0", 1, [s for s in (mine.summary(1.0), theirs.summary(1.0)) if s])
    assert merged is not None and merged["world"] == "h:10000"
    assert merged["nodes"] == ["n0"] and merged["groups"][0]["members"] == 4


def test_a_summary_with_list_entries_of_the_wrong_shape_is_refused_on_receipt() -> None:
    """roster, silent and elsewhere entries have fixed shapes: a message with one of another
    shape is refused by the codec (naming the field), so neither the aggregator's ageing nor
    the detector ever unpacks it."""
    from ftrun.errors import ProtocolError

    reports = [report(r, 41, 40, 70.0) for r in range(8)]
    good = summaries(reports, 100.0)[0]
    m.validate("coll_summary", collsum.age(good, 1.0))
    for field, bad in (("roster", [[1, "n1"]]), ("silent", [[3]]), ("silent", [["r", 1.0]])):
        with pytest.raises(ProtocolError, match=field):
            m.validate("coll_summary", {**good, field: bad})
    classes = [{**c, "elsewhere": [[5, "1"]]} for c in good["groups"][0]["classes"]]
    with pytest.raises(ProtocolError, match="elsewhere"):
        m.validate("coll_summary", {**good, "groups": [{**good["groups"][0], "classes": classes}]})
