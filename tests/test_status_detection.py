"""``ftrun status`` text of a status document with a detection section: suspects with their
evidence, the findings with the action taken, isolated hosts, the health column per node;
documents without one (no detection, older coordinators); and a 4,096-node job."""

from __future__ import annotations

import io
import time

from rich.console import Console

from ftrun import exit_codes
from ftrun.cli.status import exit_code_for, render_status
from ftrun.coordinator.api import JobHealth, NodeState
from ftrun.coordinator.detect import Finding
from ftrun.coordinator.status import health_of, with_detection


def _node(i: int, host: str, *, state: str = "healthy", ranks_per_node: int = 2,
          left: bool = False, exitcode: int | None = None, lost: bool = False) -> dict:
    ranks = list(range(i * ranks_per_node, (i + 1) * ranks_per_node))
    return {"node_id": f"n{i}", "host": host, "pid": 100 + i, "group_rank": i,
            "group_world_size": None, "state": state, "ranks": ranks,
            "workers": [{"rank": r, "pid": 1000 + r, "state": "running", "exitcode": None,
                         "health": "ok", "cause": None, "reason": None} for r in ranks],
            "workers_stale": False, "workers_age_s": 0.0, "restarts": 1, "max_restarts": 3,
            "last_heartbeat_age_s": 0.4, "last_error": None, "lost": lost, "left": left,
            "exitcode": exitcode, "suspect_ranks": []}


def _doc(nodes: list[dict], detection: dict | None) -> dict:
    summary = {"nodes": len(nodes), "nodes_lost": sum(n["lost"] for n in nodes),
               "ranks": sum(len(n["ranks"]) for n in nodes), "workers_running": 0,
               "ranks_suspect": 0, "restarts": 1}
    doc = {"version": 1, "run_id": "job1", "health": health_of(nodes).value, "nodes": nodes,
           "page": {"select": "all", "match": None, "offset": 0, "matched": len(nodes),
                    "next": None},
           "summary": summary, "snapshots": {}}
    return with_detection(doc, detection)


def _text(doc: dict) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(render_status(doc, no_headers=False))
    return out.getvalue()


HANG = Finding("hang", (3,), ("hostb",), ("n1",),
               {"pg": "0", "seq": 41, "op": "allreduce", "reason": "behind",
                "longest_wait_s": 7.25, "threshold_s": 3.0},
               "hang: rank(s) 3 on hostb never entered op 41 of group 0 that 3 rank(s) wait "
               "in (7.2 s)")
SLOW_LINK = Finding("slow_link", (), ("hosta", "hostc"), ("n0", "n2"),
                    {"link": ["hosta", "hostc"], "mb_s": 12.5, "rtt_s": 0.004},
                    "slow_link: hosta -> hostc measured 12 MB/s against a median of 950 MB/s")


def _detection(suspects: list[Finding], *, excluded: dict | None = None,
               findings: list[dict] | None = None) -> dict:
    return {
        "endpoint": "tcp://127.0.0.1:5000", "on_hang": "isolate", "on_slow": "warn",
        "suspects": {"restart": 1, "world": "hosta:29500", "ranks": 8, "groups": 1,
                     "suspects": [f.to_dict() for f in suspects],
                     "probes": [{"src": "hosta", "dst": "hostc", "mb_s": 12.5,
                                 "rtt_s": 0.004, "error": None},
                                {"src": "hosta", "dst": "hostb", "mb_s": 950.0,
                                 "rtt_s": 0.001, "error": None}]},
        "findings": findings or [],
        "excluded": excluded or {},
        "counters": {"reports": 120, "probe_results": 2, "findings": len(findings or []),
                     "directives": 3},
    }


def test_detection_block_and_health_column() -> None:
    now = time.time()
    nodes = [_node(0, "hosta"), _node(1, "hostb"), _node(2, "hostc"),
             _node(3, "hostd", state=NodeState.ISOLATED.value, left=True, exitcode=8)]
    findings = [{**HANG.to_dict(), "action": "isolate", "time": now},
                {**HANG.to_dict(), "action": "warn", "time": now,
                 "note": "already acted on this fault; waiting for the restart"}]
    det = _detection([HANG, SLOW_LINK], findings=findings,
                     excluded={"hostd": {"reason": "rank 7 hung in op 12", "time": now}})
    text = _text(_doc(nodes, det))
    lines = text.splitlines()
    assert "health" in lines[0]
    row = {line.split()[1]: line for line in lines[1:5]}
    assert "suspect (rank 3 hung)" in row["hostb"]
    assert "suspect (slow link)" in row["hosta"] and "suspect (slow link)" in row["hostc"]
    assert "isolated" in row["hostd"]
    assert "detection: 2 suspect(s), 1 host(s) isolated | on hang isolate, on slow warn" in text
    hang_line = next(line for line in lines if "suspect: hang rank 3 on hostb" in line)
    assert "pg=0 seq=41 op=allreduce" in hang_line and "longest_wait_s=7.25" in hang_line
    link_line = next(line for line in lines if "suspect: slow_link" in line)
    assert "mb_s=12.5" in link_line and "link=hosta,hostc" in link_line
    assert "slowest hosta -> hostc 12 MB/s" in text
    assert "hang rank 3 on hostb -> isolate" in text
    assert "-> warn (already acted on this fault" in text
    assert "isolated: hostd" in text and "rank 7 hung in op 12" in text


def test_health_column_ok_and_lost_without_suspects() -> None:
    nodes = [_node(0, "hosta"), _node(1, "hostb", lost=True)]
    text = _text(_doc(nodes, _detection([])))
    rows = text.splitlines()[1:3]
    assert rows[0].split()[4] == "ok"
    assert rows[1].split()[3:6] == ["lost", "(healthy)", "lost"]
    assert "no suspects" in text


def test_no_detection_section() -> None:
    nodes = [_node(0, "hosta"), _node(1, "hostb")]
    for doc in (_doc(nodes, None), {k: v for k, v in _doc(nodes, None).items()
                                    if k != "detection"}):
        text = _text(doc)
        assert "detection:" not in text
        assert text.splitlines()[1].split()[4] == "ok"
        assert exit_code_for(doc) == exit_codes.OK


def test_suspects_make_the_job_degraded() -> None:
    nodes = [_node(0, "hosta"), _node(1, "hostb")]
    assert _doc(nodes, _detection([]))["health"] == JobHealth.HEALTHY
    doc = _doc(nodes, _detection([HANG]))
    assert doc["health"] == JobHealth.DEGRADED
    assert exit_code_for(doc) == exit_codes.DEGRADED


def test_isolated_node_makes_the_job_degraded_not_failed_nor_finished() -> None:
    gone = _node(1, "hostb", state=NodeState.ISOLATED.value, left=True, exitcode=8)
    assert health_of([_node(0, "hosta"), gone]) == JobHealth.DEGRADED
    done = _node(0, "hosta", state=NodeState.SUCCEEDED.value, left=True, exitcode=0)
    assert health_of([done, gone]) == JobHealth.DEGRADED
    # A node that really failed still fails the job.
    failed = _node(2, "hostc", state=NodeState.FAILED.value)
    assert health_of([done, gone, failed]) == JobHealth.FAILED


def test_4096_nodes_stay_short() -> None:
    n = 4096
    hosts = [f"host{i:04d}" for i in range(n)]
    suspects = [Finding("slow_host", (), (h,), (f"n{i}",), {"host": h, "reference_mb_s": 900},
                        f"slow_host: probes row of host {h} median below 0.33 x 900 MB/s")
                for i, h in enumerate(hosts[:300])]
    now = time.time()
    findings = [{**f.to_dict(), "action": "isolate", "time": now} for f in suspects[-20:]]
    excluded = {h: {"reason": "slow", "time": now} for h in hosts[:300]}
    # As the coordinator pages a job this large: the summary covers every node, the page
    # lists the nodes with a problem (at most TABLE_NODES).
    nodes = [_node(i, hosts[i], state=NodeState.ISOLATED.value, left=True, exitcode=8)
             for i in range(64)]
    doc = _doc(nodes, _detection(suspects, excluded=excluded, findings=findings))
    doc["summary"]["nodes"] = n
    doc["page"] = {"select": "problems", "match": None, "offset": 0, "matched": 300,
                   "next": 64}
    lines = _text(doc).splitlines()
    assert len(lines) < 64 + 40, len(lines)
    text = "\n".join(lines)
    assert "detection: 300 suspect(s), 300 host(s) isolated" in text
    assert "more suspect(s)" in text and "more isolated host(s)" in text
    assert sum(1 for line in lines if "  suspect: " in line) == 8


def test_recoveries_are_kept_and_the_newest_is_shown_with_its_phases() -> None:
    """Every launcher's ``recovery`` event is kept for ``ftrun status`` (the newest few, and
    how many so far); the text says how the newest was done and how long each phase took."""
    from ftrun.coordinator.events import RECOVERIES_KEPT, EventLog

    log = EventLog()
    log.record("worker_failure", "n0", {"rank": 1})
    for gen in range(1, RECOVERIES_KEPT + 3):
        log.record("recovery", "n0", {
            "how": "in_process", "why": "rank 1 died (SIGKILL)", "generation": gen,
            "new_processes": [1], "kept": [0, 2], "detect_s": 0.05, "abort_s": 0.1,
            "rendezvous_s": 1.25, "world_s": 0.9, "total_s": 2.3})
    log.record("recovery", "n1", {"how": "fallback", "why": "rank 2 died",
                                  "fallback_reason": "local rank 0 did not acknowledge",
                                  "detect_s": 0.1, "in_place_s": 5.0, "restart_s": 3.0,
                                  "total_s": 8.1})
    rec = log.recoveries()
    assert rec["count"] == RECOVERIES_KEPT + 3 and len(rec["recent"]) == RECOVERIES_KEPT
    assert rec["recent"][-1]["how"] == "fallback" and rec["recent"][-2]["generation"] == 10

    doc = _doc([_node(0, "hosta"), _node(1, "hostb")], None)
    assert "last recovery" not in _text(doc)  # none yet
    doc["recoveries"] = {"count": 1, "recent": rec["recent"][-2:-1]}
    text = _text(doc)
    assert ("last recovery (1 so far, node n0): in place in 2.30 s (detect 0.05 s, abort "
            "0.10 s, rendezvous 1.25 s, new world 0.90 s); new process for rank(s) 1; after: "
            "rank 1 died (SIGKILL)") in text, text
    doc["recoveries"] = rec
    text = _text(doc)
    assert "node n1): new processes (in place failed) in 8.10 s (detect 0.10 s, in-place " \
           "attempt 5.00 s, restart 3.00 s); local rank 0 did not acknowledge" in text, text
