"""The status document ``ftrun status`` shows: the job's health, a summary, and nodes by page.

The document (version :data:`STATUS_VERSION`, fields in docs/operations.md) always carries the
job's health and a summary over every node; its ``nodes`` are one *page* of the nodes a
request selects (all, or only those with a problem; optionally those whose node id or host
contains a text), in node order, cut at :data:`PAGE_BYTES` of JSON so that a reply never
nears the message size cap. ``page.next`` is the offset of the next page (null at the end).

What needs every node (the order, the health, the summary) is computed from each node's
derived fields (:class:`ftrun.coordinator.membership.NodeRecord`) and cached until the
membership changes, so a status request at thousands of nodes costs the serving thread a
page's worth of work, not the whole job's.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from ftrun.coordinator.api import JobHealth, NodeState, RankHealth
from ftrun.coordinator.membership import (
    NodeRecord,
    suspect_ranks,
    worker_bad,
)

STATUS_VERSION = 1
EVENTS_TAIL = 20
# A page of nodes holds at most this many, and about this much JSON: far below the 1 MiB
# message cap, and little enough for the serving thread to build between heartbeats.
PAGE_NODES = 1024
PAGE_BYTES = 256 * 1024
# Which nodes a status request lists (``nodes`` in status_request).
SELECT_ALL, SELECT_PROBLEMS, SELECT_NONE = "all", "problems", "none"
SELECTIONS = (SELECT_ALL, SELECT_PROBLEMS, SELECT_NONE)

# States the launcher reports for its node while it recovers.
NODE_RECOVERING = frozenset({NodeState.RESTARTING, NodeState.RENDEZVOUS})
# The verdict fields of a worker in the status document (see ftrun.launcher.suspect).
WORKER_VERDICT_DEFAULTS: dict[str, Any] = {
    "health": RankHealth.OK.value, "cause": None, "reason": None, "step": None,
    "progress_age_s": None, "step_interval_s": None, "progress_limit_s": None,
}


def health_of(nodes: list[dict[str, Any]], expected_min_nodes: int | None = None) -> JobHealth:
    """The job's health from the ``nodes`` of a status document.

    Rules, first match wins:

    * ``starting``: no node has reported yet, or fewer than the expected minimum of nodes
      joined and none reached ``healthy``;
    * ``failed``: a node reports state ``failed``, or a node has a failed worker (state
      failed/unhealthy or a non-zero exit code) and no restarts left;
    * ``finished``: every node reports ``succeeded``, or left (``bye``) with exit code 0;
    * ``degraded``: a node left ``isolated`` (the coordinator isolated its host: the job
      goes on without it, so this is neither ``failed`` nor, once the others are done,
      ``finished``), or a node is lost (silent for the node timeout), or a node is in
      ``restarting``/``rendezvous`` after at least one restart, or a worker failed while
      restarts remain, or a node left with a non-zero exit code, or a running node has a
      suspect rank (stopped, or silent past its progress limit: ftrun.launcher.suspect);
    * ``healthy``: otherwise.

    A node dict needs ``state``, ``restarts``, ``max_restarts``, ``lost``, ``left``,
    ``exitcode`` and either ``workers`` or the derived ``bad_worker`` and ``suspect_ranks``.
    Suspects of the collective analysis are not node fields: :func:`with_detection` makes a
    ``healthy`` job ``degraded`` while the analysis has any.
    """
    if not nodes:
        return JobHealth.STARTING
    if (expected_min_nodes and len(nodes) < expected_min_nodes
            and not any(n["state"] == NodeState.HEALTHY for n in nodes)):
        return JobHealth.STARTING
    isolated = False
    for n in nodes:
        if n["state"] == NodeState.ISOLATED:
            isolated = True
            continue
        if n["state"] == NodeState.FAILED:
            return JobHealth.FAILED
        if _has_bad_worker(n) and n["restarts"] >= n["max_restarts"] and not n["left"]:
            return JobHealth.FAILED
    if isolated:
        return JobHealth.DEGRADED
    if all(n["state"] == NodeState.SUCCEEDED or (n["left"] and n["exitcode"] == 0)
           for n in nodes):
        return JobHealth.FINISHED
    for n in nodes:
        if n["lost"]:
            return JobHealth.DEGRADED
        if n["state"] in NODE_RECOVERING and n["restarts"] > 0:
            return JobHealth.DEGRADED
        if _has_bad_worker(n) and n["restarts"] < n["max_restarts"]:
            return JobHealth.DEGRADED
        if n["left"] and n["exitcode"] not in (None, 0):
            return JobHealth.DEGRADED
        if not n["left"] and _suspects(n):
            return JobHealth.DEGRADED
    return JobHealth.HEALTHY


def detection_suspects(detection: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The active findings of a status document's ``detection`` section ([] without one:
    no detection, or a coordinator older than it)."""
    if not isinstance(detection, dict):
        return []
    inner = detection.get("suspects")
    found = inner.get("suspects") if isinstance(inner, dict) else None
    return [f for f in found or [] if isinstance(f, dict)]


def with_detection(doc: dict[str, Any], detection: dict[str, Any] | None) -> dict[str, Any]:
    """Put the detection service's section into ``doc``; a job the nodes call ``healthy``
    is ``degraded`` while the collective analysis names a suspect (a hung or slow rank, a
    slow host or link). ``starting``, ``failed`` and ``finished`` stay as they are."""
    doc["detection"] = detection
    if doc.get("health") == JobHealth.HEALTHY and detection_suspects(detection):
        doc["health"] = JobHealth.DEGRADED.value
    return doc


def _has_bad_worker(node: dict[str, Any]) -> bool:
    if "bad_worker" in node:
        return bool(node["bad_worker"])
    return any(worker_bad(w) for w in node["workers"])


def _suspects(node: dict[str, Any]) -> list[int]:
    if "workers" in node:
        return suspect_ranks(node["workers"])
    return list(node.get("suspect_ranks") or [])


def _light(node: NodeRecord) -> dict[str, Any]:
    """What health and the summary need of a node, without its workers."""
    return {
        "state": node.state, "restarts": node.fields.get("restarts") or 0,
        "max_restarts": node.fields.get("max_restarts") or 0, "lost": node.lost,
        "left": node.left, "exitcode": node.exitcode, "bad_worker": node.bad_worker,
        "suspect_ranks": [] if node.left else node.suspect,
    }


def is_problem(light: dict[str, Any]) -> bool:
    """A node ``ftrun status`` lists by default at scale: lost, failed, restarting, with a
    failed or suspect worker, or gone with a non-zero exit code."""
    if light["left"]:
        return light["exitcode"] not in (None, 0)
    return bool(light["lost"] or light["state"] in (NodeState.FAILED, NodeState.RESTARTING)
                or light["bad_worker"] or light["suspect_ranks"])


def node_doc(node: NodeRecord, mono: float) -> dict[str, Any]:
    """One node of the status document."""
    hb = node.fields
    # Launchers that report no verdict (older ones, or ranks not running) read as ok.
    workers = [{**WORKER_VERDICT_DEFAULTS, **w} for w in node.workers]
    # Keep-alives do not carry the workers: their progress ages have grown since.
    since_s = max(0.0, mono - node.full_mono) if node.full_mono else 0.0
    if since_s >= 0.001:
        for w in workers:
            if isinstance(w.get("progress_age_s"), float):
                w["progress_age_s"] = round(w["progress_age_s"] + since_s, 3)
    return {
        "node_id": node.node_id,
        "host": node.host,
        "pid": node.pid,
        "group_rank": hb.get("group_rank"),
        "group_world_size": hb.get("group_world_size"),
        "state": node.state,
        "ranks": list(node.ranks),
        "workers": workers,
        "workers_stale": node.workers_stale,
        "workers_age_s": round(since_s, 3),
        "restarts": hb.get("restarts") or 0,
        "max_restarts": hb.get("max_restarts") or 0,
        "last_heartbeat_age_s": round(max(0.0, mono - node.last_seen_mono), 3),
        "last_error": hb.get("last_error"),
        "lost": node.lost,
        "left": node.left,
        "exitcode": node.exitcode,
        "suspect_ranks": [] if node.left else list(node.suspect),
    }


def _order(node: NodeRecord) -> tuple[bool, int, str]:
    group_rank = node.fields.get("group_rank")
    return (group_rank is None, group_rank or 0, node.node_id)


@dataclass
class _Overview:
    version: int
    nodes: list[NodeRecord]  # in node order
    lights: list[dict[str, Any]]
    health: JobHealth
    summary: dict[str, Any]


class StatusBuilder:
    """Builds status documents; the overview (order, health, summary) is cached per
    membership version. Called from the serving thread (requests) and from any thread
    (:meth:`Coordinator.status_document`): the cache is replaced whole, never edited."""

    def __init__(self, expected_nodes: tuple[int, int] | None) -> None:
        self._expected_nodes = expected_nodes
        self._overview: _Overview | None = None

    def overview(self, records: list[NodeRecord], version: int) -> _Overview:
        cached = self._overview
        if cached is not None and cached.version == version:
            return cached
        nodes = sorted(records, key=_order)
        lights = [_light(n) for n in nodes]
        min_nodes = self._expected_nodes[0] if self._expected_nodes else None
        by_state: dict[str, int] = {}
        for n in nodes:
            by_state[n.state] = by_state.get(n.state, 0) + 1
        summary = {
            "nodes": len(nodes),
            "nodes_lost": sum(1 for n in nodes if n.lost),
            "nodes_left": sum(1 for n in nodes if n.left),
            "nodes_by_state": by_state,
            "nodes_problem": sum(1 for light in lights if is_problem(light)),
            "nodes_stale": sum(1 for n in nodes if n.workers_stale),
            "ranks": sum(len(n.ranks) for n in nodes),
            "workers_running": sum(n.running for n in nodes if not (n.lost or n.left)),
            "ranks_suspect": sum(len(light["suspect_ranks"]) for light in lights
                                 if not light["lost"]),
            "restarts": max((light["restarts"] for light in lights), default=0),
        }
        out = _Overview(version, nodes, lights, health_of(lights, min_nodes), summary)
        self._overview = out
        return out

    def document(self, records: list[NodeRecord], version: int, *, select: str = SELECT_ALL,
                 match: str | None = None, offset: int = 0, limit: int | None = None,
                 max_bytes: int | None = None) -> dict[str, Any]:
        """The document with one page of the selected nodes (``limit``/``max_bytes`` None:
        no limit). The caller adds ``run_id``, ``coordinator``, events and snapshots."""
        if select not in SELECTIONS:
            from ftrun.errors import ConfigError

            raise ConfigError(f"unknown node selection {select!r}; use one of "
                              f"{', '.join(SELECTIONS)}")
        ov = self.overview(records, version)
        mono = time.monotonic()
        chosen: list[NodeRecord] = []
        if select != SELECT_NONE:
            for node, light in zip(ov.nodes, ov.lights, strict=True):
                if select == SELECT_PROBLEMS and not is_problem(light):
                    continue
                if match and match not in node.node_id and match not in node.host:
                    continue
                chosen.append(node)
        offset = max(0, offset)
        page: list[dict[str, Any]] = []
        size = 0
        nxt: int | None = None
        for i in range(offset, len(chosen)):
            if limit is not None and len(page) >= limit:
                nxt = i
                break
            doc = node_doc(chosen[i], mono)
            if max_bytes is not None:
                size += len(json.dumps(doc, separators=(",", ":"))) + 1
                if size > max_bytes and page:
                    nxt = i
                    break
            page.append(doc)
        return {
            "version": STATUS_VERSION,
            "time": time.time(),
            "health": ov.health.value,
            "nodes": page,
            "page": {"select": select, "match": match, "offset": offset,
                     "matched": len(chosen), "next": nxt},
            "summary": dict(ov.summary),
            # Suspects and evidence of the collective analysis (ftrun.coordinator.detect).
            "detection": None,
        }
