"""``ftrun status``: list the jobs in the state directory, or show one job's status.

Plain functions the typer layer calls; they write to stdout/stderr and return an exit code
from :mod:`ftrun.exit_codes`. JSON output goes through ``sys.stdout.write`` only (never
through rich), so it is never wrapped or styled. Tables never wrap a cell: every column stays
on one line and long text (the last error, a suspect's reason) is cut with an ellipsis; the
full text is in ``--json``. Without a terminal (a pipe, a CI log) tables are laid out
:data:`PIPE_WIDTH` columns wide unless ``COLUMNS`` says otherwise.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ftrun import exit_codes, jobs, knobs
from ftrun.cli import history as hist
from ftrun.coordinator.api import JobHealth, NodeState
from ftrun.coordinator.client import request
from ftrun.coordinator.status import detection_suspects
from ftrun.errors import (
    ConfigError,
    FtrunError,
)

LIST_VERSION = 1
ERROR_CHARS = 60
PIPE_WIDTH = 200
# A job of at most this many nodes is shown node by node; a larger one as a summary and the
# nodes with a problem (``--nodes all`` lists every node, ``--match`` some).
TABLE_NODES = 64
# The detection block lists at most this many suspects, findings and isolated hosts; the
# rest are counted (every one is in ``--json``).
DETECT_SUSPECTS = 8
DETECT_FINDINGS = 5
DETECT_EXCLUDED = 8
# How a finding reads in the health column: ``suspect (rank 3 hung)``.
_KIND_WORD = {"hang": "hung", "comm_hang": "comm hang", "slow_rank": "slow",
              "slow_comm": "slow comm", "slow_host": "slow host", "slow_link": "slow link"}
# Evidence fields shown (in this order) after a suspect's summary; the rest are in --json.
_EVIDENCE_KEYS = ("pg", "seq", "seqs", "op", "reason", "longest_wait_s", "threshold_s",
                  "silent_s", "last_in", "ops", "wait_share", "lateness_s", "others_lateness_s", "op_s",
                  "baseline_s", "mb_s", "rtt_s", "reference_mb_s", "slow", "link", "error")

_HEALTH_CODES = {
    JobHealth.HEALTHY.value: exit_codes.OK,
    JobHealth.FINISHED.value: exit_codes.OK,
    JobHealth.STARTING.value: exit_codes.OK,
    JobHealth.DEGRADED.value: exit_codes.DEGRADED,
    JobHealth.FAILED.value: exit_codes.JOB_FAILED,
}
_HEALTH_STYLE = {
    JobHealth.HEALTHY.value: "green",
    JobHealth.FINISHED.value: "green",
    JobHealth.STARTING.value: "cyan",
    JobHealth.DEGRADED.value: "yellow",
    JobHealth.FAILED.value: "bold red",
}


def exit_code_for(doc: dict[str, Any]) -> int:
    """OK for healthy/finished/starting, DEGRADED, JOB_FAILED; DEGRADED when unknown."""
    return _HEALTH_CODES.get(str(doc.get("health")), exit_codes.DEGRADED)


def _console() -> Console:
    """A console for tables: a pipe gets PIPE_WIDTH columns (rich would assume 80)."""
    console = Console()
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(width=PIPE_WIDTH)
    return console


def _cell(text: str, style: str = "") -> Text:
    """One line of table text: never wrapped, cut with an ellipsis when too long."""
    return Text(text, style=style, no_wrap=True, overflow="ellipsis")


def _fail(e: FtrunError) -> int:
    sys.stderr.write(f"ftrun status: {e}\n")
    sys.stderr.flush()
    return exit_codes.for_error(e)


# -- job list ---------------------------------------------------------------------------------


def _liveness(job: jobs.JobFile) -> bool | None:
    """True/False when the job's process is on this host, None when it cannot be told."""
    if job.host != socket.gethostname() or job.pid <= 0:
        return None
    try:
        os.kill(job.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return None
    return True


def _fmt_time(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def list_jobs(*, json_out: bool, no_headers: bool, state_dir: str | None) -> int:
    """Print the jobs known in the state directory, newest first."""
    found = jobs.list_jobs(state_dir)
    rows = []
    for job in found:
        rows.append({
            "run_id": job.run_id,
            "endpoint": job.endpoint,
            "rdzv_endpoint": job.rdzv_endpoint,
            "host": job.host,
            "pid": job.pid,
            "started_at": job.started_at,
            "live": _liveness(job),
        })
    if json_out:
        sys.stdout.write(json.dumps({"version": LIST_VERSION, "jobs": rows}) + "\n")
        sys.stdout.flush()
        return exit_codes.OK
    console = _console()
    if not rows:
        if not no_headers:
            console.print(f"no jobs in {knobs.state_dir(state_dir)}")
        return exit_codes.OK
    table = Table(show_header=not no_headers, box=None, pad_edge=False)
    for column in ("run id", "coordinator", "host", "pid", "started", "live"):
        table.add_column(column, no_wrap=True, overflow="ellipsis")
    for row in rows:
        live = {True: "[green]live[/]", False: "[dim]gone[/]", None: "?"}[row["live"]]
        table.add_row(Text(row["run_id"]), row["endpoint"], row["host"], str(row["pid"]),
                      _fmt_time(row["started_at"]), live)
    console.print(table)
    return exit_codes.OK


# -- one job ----------------------------------------------------------------------------------


def _ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    if not ranks:
        return "-"
    parts: list[str] = []
    ordered = sorted(ranks)
    start = prev = ordered[0]
    for r in ordered[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(parts)


def _age_text(age_s: float | None) -> str:
    if age_s is None:
        return "-"
    if age_s < 60:
        return f"{age_s:.1f}s ago"
    if age_s < 3600:
        return f"{age_s / 60:.0f}m ago"
    return f"{age_s / 3600:.1f}h ago"


def _truncate(text: str | None, limit: int = ERROR_CHARS) -> str:
    if not text:
        return ""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _state_cell(node: dict[str, Any]) -> Text:
    state = str(node.get("state", "?"))
    if node.get("lost"):
        return _cell(f"lost ({state})", "bold red")
    if node.get("suspect_ranks") and state == NodeState.HEALTHY:
        return _cell(f"suspect ({_ranks_text(list(node['suspect_ranks']))})", "bold yellow")
    if state in (NodeState.FAILED, NodeState.ISOLATED):
        return _cell(state, "red")
    if state in (NodeState.RESTARTING, NodeState.RENDEZVOUS):
        return _cell(state, "yellow")
    return _cell(state)


def _suspect_lines(doc: dict[str, Any]) -> list[Text]:
    """One line per suspect rank: which, where, and why."""
    lines = []
    for node in doc.get("nodes", []):
        if node.get("lost") or not node.get("suspect_ranks"):
            continue
        group = node.get("group_rank")
        where = f"node {'?' if group is None else group}, {node.get('host', '?')}"
        for w in node.get("workers", []):
            if w.get("rank") in node["suspect_ranks"]:
                lines.append(Text.assemble(
                    ("suspect: ", "bold yellow"),
                    (f"rank {w.get('rank')} ({where}, pid {w.get('pid')}): ", ""),
                    (_truncate(w.get("reason") or str(w.get("cause") or "?"), 2 * ERROR_CHARS),
                     ""),
                    no_wrap=True, overflow="ellipsis",
                ))
    return lines


def _detection(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The document's detection section; None without one (no detection, or a coordinator
    older than it) or when it is not an object."""
    det = doc.get("detection")
    return det if isinstance(det, dict) else None


def _excluded(det: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    excluded = (det or {}).get("excluded")
    return {str(h): (i if isinstance(i, dict) else {}) for h, i in excluded.items()} \
        if isinstance(excluded, dict) else {}


def _node_suspicions(doc: dict[str, Any]) -> dict[str, list[str]]:
    """node id -> what the collective analysis suspects of it (``rank 3 hung``)."""
    out: dict[str, list[str]] = {}
    ranks_of = {n.get("node_id"): set(n.get("ranks") or []) for n in doc.get("nodes", [])}
    for f in detection_suspects(_detection(doc)):
        word = _KIND_WORD.get(str(f.get("kind")), str(f.get("kind")))
        for node in f.get("nodes") or []:
            mine = sorted(set(f.get("ranks") or []) & ranks_of.get(node, set()))
            what = f"rank {_ranks_text(mine)} {word}" if mine else word
            out.setdefault(str(node), []).append(what)
    return out


def _health_cell(node: dict[str, Any], excluded: dict[str, dict[str, Any]],
                 suspicions: dict[str, list[str]]) -> Text:
    """ok / suspect (rank N hung|slow|stopped) / isolated / lost, from the document."""
    if node.get("state") == NodeState.ISOLATED or node.get("host") in excluded:
        return _cell("isolated", "bold red")
    if node.get("left"):
        return _cell("left" if node.get("exitcode") in (None, 0) else "left (failed)",
                     "dim" if node.get("exitcode") in (None, 0) else "red")
    if node.get("lost"):
        return _cell("lost", "bold red")
    what = list(suspicions.get(str(node.get("node_id")), []))
    if node.get("suspect_ranks"):
        what.append(f"rank {_ranks_text(list(node['suspect_ranks']))} "
                    f"{_launcher_cause(node)}")
    if what:
        return _cell(f"suspect ({'; '.join(what)})", "bold yellow")
    if node.get("state") == NodeState.FAILED:
        return _cell("failed", "red")
    return _cell("ok", "green")


def _launcher_cause(node: dict[str, Any]) -> str:
    causes = {str(w.get("cause")) for w in node.get("workers", [])
              if w.get("rank") in node.get("suspect_ranks", []) and w.get("cause")}
    return {"stopped": "stopped", "no_progress": "no progress"}.get(
        next(iter(causes)) if len(causes) == 1 else "", "suspect")


def _evidence_text(evidence: Any) -> str:
    """``pg=0 seq=41 op=allreduce longest_wait_s=7.2``: the fields that locate a finding."""
    if not isinstance(evidence, dict):
        return ""
    parts = []
    for key in _EVIDENCE_KEYS:
        value = evidence.get(key)
        if value is None or value == "":
            continue
        if isinstance(value, list):
            value = ",".join(str(v) for v in value)
        elif isinstance(value, dict):
            value = ",".join(f"{k}:{v}" for k, v in list(value.items())[:4])
        parts.append(f"{key}={value}")
    return " ".join(parts)


def _who_text(f: dict[str, Any]) -> str:
    ranks = [r for r in f.get("ranks") or [] if isinstance(r, int)]
    hosts = [str(h) for h in f.get("hosts") or []]
    who = []
    if ranks:
        who.append(f"rank {_ranks_text(ranks)}")
    if hosts:
        who.append(("on " if ranks else "") + (",".join(hosts[:4])
                                                + (f" +{len(hosts) - 4}" if len(hosts) > 4
                                                   else "")))
    return " ".join(who)


def _summary_text(f: dict[str, Any]) -> str:
    """A finding's summary on one line, without the ``kind: `` it starts with."""
    text = " ".join(str(f.get("summary") or "").split())
    prefix = f"{f.get('kind')}: "
    return text[len(prefix):] if text.startswith(prefix) else text


def detection_lines(doc: dict[str, Any]) -> list[Text]:
    """The detection block: policy, suspects with their evidence, probes, the last findings
    with the action taken, isolated hosts. [] when the document has no detection section."""
    det = _detection(doc)
    if det is None:
        return []
    suspects = detection_suspects(det)
    findings = [f for f in det.get("findings") or [] if isinstance(f, dict)]
    excluded = _excluded(det)
    counters = det.get("counters") or {}
    inner = det.get("suspects") if isinstance(det.get("suspects"), dict) else {}
    lines = [Text.assemble(
        ("detection: ", "bold"),
        (f"{len(suspects)} suspect(s)" if suspects else "no suspects",
         "bold yellow" if suspects else "green"),
        (f", {len(excluded)} host(s) isolated" if excluded else "",
         "bold red" if excluded else ""),
        (f" | on hang {det.get('on_hang', '?')}, on slow {det.get('on_slow', '?')}", ""),
        (f" | {inner.get('ranks', 0)} rank(s) reporting in {inner.get('groups', 0)} group(s)"
         if inner else "", ""),
        (f" | {counters.get('findings', 0)} finding(s), {counters.get('directives', 0)} "
         "directive(s)" if counters else "", ""),
        no_wrap=True, overflow="ellipsis")]
    for f in suspects[:DETECT_SUSPECTS]:
        ev = _evidence_text(f.get("evidence"))
        lines.append(Text.assemble(
            ("  suspect: ", "bold yellow"), (f"{f.get('kind', '?')} {_who_text(f)}: ", "bold"),
            (_summary_text(f), ""),
            (f" [{ev}]" if ev else "", "dim"), no_wrap=True, overflow="ellipsis"))
    if len(suspects) > DETECT_SUSPECTS:
        lines.append(Text(f"  … {len(suspects) - DETECT_SUSPECTS} more suspect(s) "
                          "(--json has them all)", style="dim"))
    probes = [p for p in inner.get("probes") or [] if isinstance(p, dict)]
    if probes:
        rates = sorted((p.get("mb_s") or 0.0, p) for p in probes if not p.get("error"))
        failed = [p for p in probes if p.get("error")]
        text = f"  probes: {len(probes)} link(s) measured"
        if rates:
            mid = rates[len(rates) // 2][0]
            low, p = rates[0]
            text += (f", median {mid:.0f} MB/s, slowest {p.get('src')} -> {p.get('dst')} "
                     f"{low:.0f} MB/s")
            if p.get("rtt_s") is not None:
                text += f" (rtt {p['rtt_s'] * 1000:.1f} ms)"
        if failed:
            text += (f", {len(failed)} failed (first: {failed[0].get('src')} -> "
                     f"{failed[0].get('dst')}: {_truncate(str(failed[0].get('error')))})")
        lines.append(Text(text, no_wrap=True, overflow="ellipsis"))
    if findings:
        shown = findings[-DETECT_FINDINGS:]
        lines.append(Text(f"  last {len(shown)} finding(s), newest last:", style="dim"))
        for f in shown:
            when = f.get("time")
            stamp = (datetime.fromtimestamp(when).strftime("%H:%M:%S")
                     if isinstance(when, (int, float)) else "--:--:--")
            action = str(f.get("action") or "?")
            lines.append(Text.assemble(
                (f"  {stamp} ", "dim"), (f"{f.get('kind', '?')} {_who_text(f)}", "bold"),
                (" -> ", ""), (action, "bold red" if action in ("isolate", "restart")
                               else "yellow"),
                (f" ({f['note']})" if f.get("note") else "", "dim"),
                (f": {_summary_text(f)}", ""),
                no_wrap=True, overflow="ellipsis"))
    for host, info in list(sorted(excluded.items()))[:DETECT_EXCLUDED]:
        when = info.get("time")
        since = (f" since {_fmt_time(when)}" if isinstance(when, (int, float)) else "")
        lines.append(Text.assemble(
            ("  isolated: ", "bold red"), (host, "bold"), (since, "dim"),
            (f": {' '.join(str(info.get('reason') or '?').split())}", ""),
            no_wrap=True, overflow="ellipsis"))
    if len(excluded) > DETECT_EXCLUDED:
        lines.append(Text(f"  … {len(excluded) - DETECT_EXCLUDED} more isolated host(s) "
                          "(--json has them all)", style="dim"))
    return lines


def render_status(doc: dict[str, Any], *, no_headers: bool) -> Group:
    """The status table (and summary lines unless ``no_headers``) of a status document."""
    table = Table(show_header=not no_headers, box=None, pad_edge=False)
    excluded = _excluded(_detection(doc))
    suspicions = _node_suspicions(doc)
    for column in ("node", "host", "ranks", "state", "health", "restarts", "last heartbeat",
                   "snapshots", "last error"):
        # Only "last error" and "health" give way on a narrow screen; their cells are one
        # line anyway (cut with an ellipsis).
        table.add_column(_cell(column), no_wrap=column not in ("last error", "health"),
                         overflow="ellipsis")
    snaps = doc.get("snapshots") or {}
    stores = snaps.get("stores") or {}
    for node in doc.get("nodes", []):
        group_rank = node.get("group_rank")
        table.add_row(
            _cell("?" if group_rank is None else str(group_rank)),
            _cell(str(node.get("host", ""))),
            _cell(_ranks_text(list(node.get("ranks", [])))),
            _state_cell(node),
            _health_cell(node, excluded, suspicions),
            _cell(f"{node.get('restarts', 0)}/{node.get('max_restarts', 0)}"),
            _cell(_age_text(node.get("last_heartbeat_age_s"))),
            _bytes_text((stores.get(node.get("node_id")) or {}).get("bytes")),
            _cell(_truncate(node.get("last_error"))),
        )
    if no_headers:
        return Group(table)
    summary = doc.get("summary", {})
    health = str(doc.get("health", "?"))
    lost = summary.get("nodes_lost", 0)
    suspect = summary.get("ranks_suspect", 0)
    line = Text.assemble(
        ("job ", ""), (str(doc.get("run_id", "?")), "bold"), (": ", ""),
        (health, _HEALTH_STYLE.get(health, "")),
        (f" | {summary.get('nodes', 0)} node(s), {summary.get('ranks', 0)} rank(s), "
         f"{summary.get('workers_running', 0)} running", ""),
        (f", {suspect} suspect" if suspect else "", "bold yellow"),
        (f" | {lost} lost", "bold red" if lost else ""),
        (f" | {summary.get('restarts', 0)} restart(s)", ""),
    )
    details = _suspect_lines(doc) + detection_lines(doc)
    recovered = recovery_line(doc)
    if recovered is not None:
        details.append(recovered)
    if isinstance(doc.get("history"), dict):
        # Its first line repeats the job line above; the faults and skips follow.
        details += history_lines(doc["history"], str(doc.get("run_id", "?")), live=True)[1:]
    listed = _listed_line(doc)
    if listed is not None:
        details.insert(0, listed)
    behind = (doc.get("coordinator") or {}).get("behind_s")
    if behind:
        details.insert(0, Text(f"coordinator {behind:.1f} s behind its messages: nobody is "
                               "declared lost until it catches up", style="bold yellow"))
    if not snaps:
        return Group(table, line, *details)
    committed = snaps.get("committed_step")
    age = snaps.get("committed_age_s")
    persisted = snaps.get("persisted_step")
    snap_line = Text.assemble(
        ("snapshots: ", ""),
        (f"committed step {committed}" if committed is not None else "none committed yet",
         "bold" if committed is not None else "yellow"),
        (f" ({_age_text(age)})" if age is not None else "", ""),
        (f" | {_bytes_text(sum(int(v.get('bytes') or 0) for v in stores.values())).plain}"
         f" in memory on {len(stores)} node(s)", ""),
        (f" | persisted step {persisted}" if persisted is not None else " | nothing persisted",
         ""),
        (_replica_text(snaps), ""),
        (_cadence_text(snaps), ""),
        (f" | {snaps['skipped']} skipped{hist.reasons_text(snaps.get('skip_reasons') or {})}"
         if snaps.get("skipped") else "", "bold yellow"),
        _corruption_text(snaps),
    )
    source = snaps.get("restored_from")
    if source and source != "none":
        fallback = source.startswith("disk")
        restored = Text.assemble(
            (f"restored step {snaps.get('base_step')} from {source}",
             "bold yellow" if fallback else ""),
            (" (no step was held in full in memory: fell back to the persisted checkpoint)"
             if fallback else "", "bold yellow"))
        return Group(table, line, *details, snap_line, restored)
    return Group(table, line, *details, snap_line)


_HOW = {"in_process": "in place", "new_process": "new processes",
        "fallback": "new processes (in place failed)"}
# The phases of a recovery event, in order, as the launcher measured them.
_PHASES = (("detect_s", "detect"), ("abort_s", "abort"), ("rendezvous_s", "rendezvous"),
           ("world_s", "new world"), ("in_place_s", "in-place attempt"),
           ("restart_s", "restart"))


def recovery_line(doc: dict[str, Any]) -> Text | None:
    """The newest recovery: how (in place, new processes, fallback and why), its phases,
    which ranks got new processes; None when the job has not recovered yet."""
    rec = doc.get("recoveries") or {}
    recent = rec.get("recent") or []
    if not recent:
        return None
    e = recent[-1]
    how = str(e.get("how", "?"))
    phases = ", ".join(f"{name} {e[key]:.2f} s" for key, name in _PHASES
                       if isinstance(e.get(key), (int, float)))
    parts = [f"last recovery ({rec.get('count', len(recent))} so far, node "
             f"{e.get('node', '?')}): {_HOW.get(how, how)}"]
    if isinstance(e.get("total_s"), (int, float)):
        parts.append(f" in {e['total_s']:.2f} s" + (f" ({phases})" if phases else ""))
    if how == "in_process":
        new = e.get("new_processes") or []
        parts.append(f"; new process for rank(s) {_ranks_text(new)}" if new
                     else "; every rank kept its process")
    elif e.get("fallback_reason"):
        parts.append(f"; {_truncate(str(e['fallback_reason']))}")
    if e.get("why"):
        parts.append(f"; after: {_truncate(str(e['why']))}")
    return Text("".join(parts), style="yellow" if how == "fallback" else "")


def _corruption_text(snaps: dict[str, Any]) -> tuple[str, str]:
    """The replicas' comparison (silent data corruption, ftrun.coordinator.corruption)."""
    sdc = snaps.get("corruption") or {}
    if not sdc.get("disagreed_steps"):
        checked = sdc.get("checked_steps")
        return (f" | replicas agreed at {checked} step(s)" if checked else "", "")
    last = (sdc.get("findings") or [{}])[-1]
    return (f" | SILENT CORRUPTION: replicas disagreed at {sdc['disagreed_steps']} step(s), "
            f"latest step {last.get('step')}: rank(s) {last.get('ranks')}"
            f"{'' if last.get('majority') else ' (no majority)'}, {last.get('action')}",
            "bold red")


def _listed_line(doc: dict[str, Any]) -> Text | None:
    """Which nodes the table lists, when not every node."""
    page = doc.get("page") or {}
    total = (doc.get("summary") or {}).get("nodes", 0)
    shown = len(doc.get("nodes", []))
    if shown == total and not page.get("next"):
        return None
    what = {"problems": "with a problem", "none": "(none asked for)"}.get(
        page.get("select", "all"), "")
    match = f" matching {page['match']!r}" if page.get("match") else ""
    more = (f"; more from --offset {page['next']}" if page.get("next") is not None else "")
    return Text(f"listed {shown} of {page.get('matched', shown)} node(s) {what}{match} "
                f"out of {total}{more} (--nodes all|problems, --match TEXT, --limit N)",
                style="dim")


def _replica_text(snaps: dict[str, Any]) -> str:
    """``durable step S, N step(s) / T behind (m copies; n/N node(s) replicated)``, or why
    nothing can be durable (one node): with replication only."""
    if snaps.get("redundancy"):
        return _parity_text(snaps)
    m = snaps.get("replicas") or 1
    if m <= 1:
        return ""
    off = snaps.get("durable_off")
    if off:
        return f" | durable n/a: {off}"
    durable = snaps.get("durable_step")
    coverage = snaps.get("replica_coverage") or {}
    covered = sum(1 for c in coverage.values() if c.get("replicated_step") is not None)
    lag_steps, lag_s = snaps.get("durable_lag_steps"), snaps.get("durable_lag_s")
    lag = (f", {lag_steps} step(s) / {lag_s:.1f} s behind committed"
           if lag_steps and lag_s is not None else "")
    nodes = snaps.get("replica_nodes")
    copies = (f"{m} copies" if nodes is None or nodes >= m
              else f"{nodes} of {m} copies: {nodes} live node(s)")
    refused = [f"{node} refuses replicas: {c['refused']}" for node, c in sorted(coverage.items())
               if c.get("refused")]
    return (f" | {f'durable step {durable}' if durable is not None else 'nothing durable yet'}"
            f"{lag} ({copies}; {covered}/{len(coverage)} node(s) replicated)"
            + "".join(f" | {r}" for r in refused))


def _parity_text(snaps: dict[str, Any]) -> str:
    """``ec:K+M: durable step S (parity of step T built on n/N node(s); P MB of parity)``."""
    parity = snaps.get("parity") or {}
    durable = snaps.get("parity_durable_step")
    newest = max((p["built_step"] for p in parity.values()), default=-1)
    built = sum(1 for p in parity.values() if newest > 0 and p["built_step"] == newest)
    mb = sum(p["parity_bytes"] for p in parity.values()) / 1e6
    rebuilt = sum(p["rebuilt_bytes"] for p in parity.values()) / 1e6
    return (f" | {snaps['redundancy']}: "
            + (f"durable step {durable}" if durable is not None else "nothing durable yet")
            + (f" (parity of step {newest} built on {built}/{len(parity)} node(s); "
               f"{mb:.1f} MB of parity" if newest > 0 else " (no parity built yet")
            + (f", {rebuilt:.1f} MB rebuilt" if rebuilt else "") + ")")


def _cadence_text(snaps: dict[str, Any]) -> str:
    every, effective = snaps.get("every"), snaps.get("effective_every")
    if every is None:
        return ""
    text = f" | every {every} step(s)"
    if effective is not None and effective != every:
        text += f", effective {effective:g}"
    return text


def _bytes_text(n: int | None) -> Text:
    if n is None:
        return _cell("-")
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return _cell(f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}")
        value /= 1024
    return Text(str(n))


def _fetch_page(endpoint: str, secret: bytes, run_id: str, timeout_s: float,
                body: dict[str, Any]) -> dict[str, Any]:
    reply = request(endpoint, secret, run_id, "status_request", body, timeout_s=timeout_s)
    if reply.kind != "status_reply":
        raise FtrunError(f"coordinator at {endpoint} answered {reply.kind!r} to a status request")
    return dict(reply.body["doc"])


def _fetch(endpoint: str, secret: bytes, run_id: str, timeout_s: float, *,
           select: str | None = None, match: str | None = None, offset: int = 0,
           limit: int | None = None, table: bool = False) -> dict[str, Any]:
    """The status document with the nodes asked for, fetched page by page (a page is one
    reply, well below the message size cap) and joined: ``nodes`` holds them all, ``page``
    says how many matched and where the next page would start (``limit`` reached).

    ``select`` None: every node, except in a ``table`` of a job larger than
    :data:`TABLE_NODES` nodes, which lists the nodes with a problem (at most that many unless
    ``limit`` says otherwise)."""
    if select is None and table:
        doc = _fetch_page(endpoint, secret, run_id, timeout_s,
                          _page_body("all", match, offset, limit or TABLE_NODES))
        if doc.get("summary", {}).get("nodes", 0) <= TABLE_NODES or match:
            return doc
        select, limit = "problems", limit or TABLE_NODES
    select = select or "all"
    doc: dict[str, Any] = {}
    nodes: list[dict[str, Any]] = []
    next_offset: int | None = offset
    while next_offset is not None and (limit is None or len(nodes) < limit):
        want = None if limit is None else limit - len(nodes)
        doc = _fetch_page(endpoint, secret, run_id, timeout_s,
                          _page_body(select, match, next_offset, want))
        nodes.extend(doc.get("nodes", []))
        next_offset = (doc.get("page") or {}).get("next")
    doc["nodes"] = nodes
    if doc.get("page") is not None:
        doc["page"] = {**doc["page"], "offset": offset, "next": next_offset}
    return doc


def _page_body(select: str, match: str | None, offset: int,
               limit: int | None) -> dict[str, Any]:
    body: dict[str, Any] = {"nodes": select, "offset": offset}
    if match:
        body["match"] = match
    if limit is not None:
        body["limit"] = limit
    return body


def run_status(
    run_id: str | None,
    *,
    endpoint: str | None,
    json_out: bool,
    watch: bool,
    no_headers: bool,
    state_dir: str | None,
    interval_s: float = 2.0,
    timeout_s: float = 5.0,
    select: str | None = None,
    match: str | None = None,
    offset: int = 0,
    limit: int | None = None,
    etcd: str | None = None,
) -> int:
    """``ftrun status [RUN_ID]``: list jobs, or show (and with ``watch`` follow) one job.

    The coordinator is found at ``endpoint``, else in the etcd cluster at ``etcd`` (HOST:PORT
    list), else through the job file; a job file of a job on etcd sends the look-up to etcd
    (the role may have changed hands since the file was written).

    ``select`` (all | problems | none), ``match``, ``offset`` and ``limit`` choose the nodes
    listed (see :func:`_fetch`); the summary always covers every node."""
    if select is not None and select not in ("all", "problems", "none"):
        return _fail(ConfigError(f"--nodes {select!r}: use all, problems or none"))
    pick = {"select": select, "match": match, "offset": offset, "limit": limit,
            "table": not json_out}
    try:
        if not run_id and not endpoint:
            return list_jobs(json_out=json_out, no_headers=no_headers, state_dir=state_dir)
        if not run_id:
            run_id = knobs.RUN_ID.get()
            if not run_id:
                raise ConfigError(
                    "--endpoint needs the job's run id too: ftrun status RUN_ID --endpoint H:P"
                )
        if not endpoint and not etcd:
            # An ended job answers from its job file and event log: its coordinator is gone.
            ended = ended_status(run_id, state_dir)
            if ended is not None:
                emit_ended(ended, json_out=json_out)
                return exit_code_for(ended)
        if not endpoint:
            endpoint = _find_coordinator(run_id, etcd, state_dir, timeout_s)
        secret = jobs.load_secret(run_id, state_dir, create=False)
    except FtrunError as e:
        return _fail(e)
    history = (lambda: live_history(run_id, state_dir)) if run_id else (lambda: None)
    if not watch:
        try:
            doc = _fetch(endpoint, secret, run_id, timeout_s, **pick)
        except FtrunError as e:
            return _fail(e)
        _emit(_with_history(doc, history()), json_out=json_out, no_headers=no_headers,
              compact=False)
        return exit_code_for(doc)
    return _watch(endpoint, secret, run_id, json_out=json_out, no_headers=no_headers,
                  interval_s=interval_s, timeout_s=timeout_s, pick=pick, history=history)


def _with_history(doc: dict[str, Any], history: dict[str, Any] | None) -> dict[str, Any]:
    """The live document with the job's history (faults, recoveries, resumed steps) from its
    event log on this host, under ``history``; as it was without one."""
    return {**doc, "history": history} if history is not None else doc


def _find_coordinator(run_id: str, etcd: str | None, state_dir: str | None,
                      timeout_s: float) -> str:
    from ftrun.launcher import etcd as etcd_client

    if not etcd:
        job = jobs.read_job_file(run_id, state_dir)
        if not job.rdzv_endpoint.startswith(etcd_client.URL_SCHEME):
            return job.endpoint
        etcd = job.rdzv_endpoint[len(etcd_client.URL_SCHEME):]
    return etcd_client.coordinator_endpoint(etcd, run_id, timeout_s)


def _emit(doc: dict[str, Any], *, json_out: bool, no_headers: bool, compact: bool) -> None:
    if json_out:
        text = json.dumps(doc, separators=(",", ":")) if compact else json.dumps(doc)
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    else:
        _console().print(render_status(doc, no_headers=no_headers))


def _watch(endpoint: str, secret: bytes, run_id: str, *, json_out: bool, no_headers: bool,
           interval_s: float, timeout_s: float, pick: dict[str, Any],
           history: Callable[[], dict[str, Any] | None]) -> int:
    interval_s = max(0.1, interval_s)
    code = exit_codes.UNREACHABLE
    console = _console()
    live: Live | None = None
    if not json_out and console.is_terminal:
        live = Live(Text("contacting the coordinator…"), console=console,
                    refresh_per_second=4, transient=False)
        live.start()
    try:
        while True:
            started = time.monotonic()
            try:
                doc = _with_history(_fetch(endpoint, secret, run_id, timeout_s, **pick),
                                    history())
            except FtrunError as e:
                code = exit_codes.for_error(e)
                if live is not None:
                    live.update(Text(f"ftrun status: {e}", style="red"))
                else:
                    sys.stderr.write(f"ftrun status: {e}\n")
                    sys.stderr.flush()
            else:
                code = exit_code_for(doc)
                if live is not None:
                    stamp = Text(f"every {interval_s:g}s, {_fmt_time(time.time())}", style="dim")
                    live.update(Group(render_status(doc, no_headers=no_headers), stamp))
                else:
                    _emit(doc, json_out=json_out, no_headers=no_headers, compact=True)
            time.sleep(max(0.0, interval_s - (time.monotonic() - started)))
    except KeyboardInterrupt:
        pass
    finally:
        if live is not None:
            live.stop()
    return code


# -- an ended job, and every job's history (ftrun.cli.history: its event log) -------------------


def _s(value: float | None, unit: str = " s") -> str:
    return hist.NOT_RECORDED if value is None else f"{value:.2f}{unit}"


def _clock(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%H:%M:%S")


def health_of(history: dict[str, Any]) -> str:
    """The status document's health word for an ended job (finished or failed)."""
    return JobHealth.FINISHED.value if history["outcome"] == "succeeded" \
        else JobHealth.FAILED.value


def ended_status(run_id: str, state_dir: str | None) -> dict[str, Any] | None:
    """The status document of an ended job, from its job file and event log; None when the
    job may still run (its coordinator process is alive, or cannot be told and no
    ``job_end`` closed the log)."""
    job = jobs.read_job_file(run_id, state_dir)
    live = _liveness(job)
    if live:
        return None
    try:
        events = hist.read_events(run_id, state_dir)
    except hist.HistoryError:
        if live is None:
            return None  # no log here, and its coordinator (elsewhere) may run: ask it
        raise
    history = hist.job_history(events, gone=live is False)
    if not history["ended"]:
        return None
    return {"version": hist.HISTORY_VERSION, "run_id": run_id, "ended": True,
            "health": health_of(history), "history": history, "missing": hist.missing(history)}


def live_history(run_id: str, state_dir: str | None) -> dict[str, Any] | None:
    """A live job's history from its event log on this host; None without one (the
    coordinator runs on another host or with another state directory)."""
    try:
        return hist.job_history(hist.read_events(run_id, state_dir))
    except FtrunError:
        return None


def _fault_lines(f: dict[str, Any], started_at: float) -> list[Text]:
    """A fault in three lines: what and where; detection and recovery; where it resumed."""
    rec = f.get("recovery") or {}
    who = (f"rank {_ranks_text(f['ranks'])}" if f["ranks"] else f"node {f.get('node')}") + \
        (f" on {f['host']}" if f.get("host") else "")
    how = str(rec.get("how") or "")
    phases = ", ".join(f"{name} {rec[key]:.2f} s" for key, name in hist.PHASES
                       if key != "detect_s" and isinstance(rec.get(key), (int, float)))
    first = (f"fault {f['n']} at {_clock(f['at'])} (+{f['at'] - started_at:.1f} s): {who}, "
             f"{f['kind']}: {_truncate(f['what'], 2 * ERROR_CHARS)}")
    second = ("    detection time not recorded" if f["detected_after_s"] is None
              else f"    detected in {_s(f['detected_after_s'])}")
    if rec:
        second += (f"; recovered {_HOW.get(how, how)} in {_s(f['recovery_s'])}"
                   + (f" ({phases})" if phases else ""))
        if rec.get("new_processes"):
            second += f"; new process for rank(s) {_ranks_text(rec['new_processes'])}"
        if rec.get("fallback_reason"):
            second += f"; in place failed: {_truncate(str(rec['fallback_reason']))}"
    else:
        second += "; no recovery recorded"
    lost = f["steps_lost"]
    third = (f"    training again {f['recovered_after_s']:.2f} s after the fault, resumed from "
             f"step {f['resumed_from']} ({f['restored_from']})"
             if f["recovered_after_s"] is not None else "    no restore recorded after it")
    third += f"; steps recomputed: {lost if lost is not None else hist.NOT_RECORDED}"
    style = "yellow" if how == "fallback" or not rec else ""
    # Wrapped, not cut: what a fault cost is the point of an ended job's status.
    return [Text(line, style=style) for line in (first, second, third)]


def history_lines(history: dict[str, Any], run_id: str, live: bool = False) -> list[Text]:
    """The history section: outcome, steps, every fault with its recovery, skips. ``live``:
    below a live status, which shows the committed step and the skips itself."""
    outcome = history["outcome"]
    style = {"succeeded": "green", "running": ""}.get(outcome, "bold red")
    code = history.get("exitcode")
    head = Text.assemble(
        ("job ", ""), (run_id, "bold"), (": ", ""),
        (("ended, " if history["ended"] else "") + outcome, style),
        (f" (exit code {code})" if code is not None else "", ""),
        (f" after {history['wall_s']:.1f} s" if history["ended"]
         else f" for {history['wall_s']:.1f} s", ""),
        (f" | {len(history['faults'])} fault(s), {history['restarts']} restart(s)", ""),
        (f", {history['nodes_lost']} node(s) lost" if history["nodes_lost"] else "", ""),
    )
    if outcome == "killed":
        head.append(" (no job_end recorded: its launcher was killed)", style="bold red")
    restored = history.get("last_restored_step")
    lines = [head]
    if not live:
        trained = history.get("steps_trained")
        lines.append(Text(f"steps trained: {trained if trained is not None else hist.NOT_RECORDED}"
                          + (f" (last restored step {restored})" if restored is not None
                             else ""), style="dim"))
    for f in history["faults"]:
        lines += _fault_lines(f, history["started_at"])
    skips = history["persist_skipped"]
    if skips or not live:
        skipped = history.get("snapshots_skipped")
        lines.append(Text(("" if live else "snapshots skipped: "
                           f"{skipped if skipped is not None else hist.NOT_RECORDED}"
                           f"{hist.reasons_text(history.get('snapshot_skip_reasons') or {})}; ")
                          + (f"persists skipped at step(s) {skips}" if skips
                             else "no persist skipped"), style="dim"))
    if history["hosts_isolated"]:
        lines.append(Text(f"hosts isolated: {', '.join(map(str, history['hosts_isolated']))}",
                          style="bold red"))
    return lines


def emit_ended(doc: dict[str, Any], *, json_out: bool) -> None:
    """An ended job's status: its history section only (no coordinator to ask)."""
    if json_out:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()
    else:
        _console().print(Group(*history_lines(doc["history"], doc["run_id"])))
