"""The job coordinator: the server every node launcher and store reports to.

It keeps what each node last said (state, workers, restarts), notices nodes that go quiet,
records a structured event log (in memory, bounded, and as JSON lines in the job's
``events.jsonl``), and answers ``ftrun status`` with a versioned status document. Every
message is authenticated with the job secret and dispatched through a handler table (see
:mod:`ftrun.protocol.transport`); bad messages are logged, counted and recorded, never
allowed to crash the loop.

It runs inside the launcher of node 0 (:meth:`Coordinator.start`, a daemon thread) or as a
standalone process that also hosts the job's c10d rendezvous store (:func:`run_standalone`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import zmq

from ftrun import jobs, protocol
from ftrun.coordinator.api import JobHealth, NodeState, RankHealth
from ftrun.coordinator.commits import CommitTracker, StoreState
from ftrun.coordinator.directives import DirectiveBook
from ftrun.errors import FtrunError, UnreachableError
from ftrun.protocol.transport import RateLimiter, Reply, Server
from ftrun.snapshot.placement import group_placement

log = logging.getLogger(__name__)

STATUS_VERSION = 1
ENDPOINT_KEY = "ftrun/coordinator"
MAX_EVENTS = 10_000
EVENTS_TAIL = 20
POLL_INTERVAL_S = 0.1
MAX_MESSAGES_PER_TICK = 1000
WARN_EVERY_S = 10.0
EVENTS_REPLY_MAX = 1000
EVENTS_REPLY_BYTES = protocol.MAX_MESSAGE_BYTES // 2
BIND_TIMEOUT_S = 10.0

# States the launcher reports for its node.
NODE_RECOVERING = frozenset({NodeState.RESTARTING, NodeState.RENDEZVOUS})
# Worker states (lower-cased) that count as running, and as failed.
WORKER_RUNNING = frozenset({"running", "healthy"})
WORKER_BAD = frozenset({"failed", "unhealthy"})
# The verdict fields of a worker in the status document (see ftrun.launcher.suspect).
WORKER_VERDICT_DEFAULTS: dict[str, Any] = {
    "health": RankHealth.OK.value, "cause": None, "reason": None, "step": None,
    "progress_age_s": None, "step_interval_s": None, "progress_limit_s": None,
}


@dataclass
class _Node:
    node_id: str
    host: str
    pid: int
    first_seen: float
    last_seen: float  # unix time of the last message of any kind
    last_seen_mono: float
    state: str = "init"
    heartbeat: dict[str, Any] = field(default_factory=dict)
    lost: bool = False
    left: bool = False
    exitcode: int | None = None


def health_of(nodes: list[dict[str, Any]], expected_min_nodes: int | None = None) -> JobHealth:
    """The job's health from the ``nodes`` of a status document.

    Rules, first match wins:

    * ``starting``: no node has reported yet, or fewer than the expected minimum of nodes
      joined and none reached ``healthy``;
    * ``failed``: a node reports state ``failed``, or a node has a failed worker (state
      failed/unhealthy or a non-zero exit code) and no restarts left;
    * ``finished``: every node reports ``succeeded``, or left (``bye``) with exit code 0;
    * ``degraded``: a node is lost (silent for the node timeout), or a node is in
      ``restarting``/``rendezvous`` after at least one restart, or a worker failed while
      restarts remain, or a node left with a non-zero exit code, or a running node has a
      suspect rank (stopped, or silent past its progress limit: ftrun.launcher.suspect);
    * ``healthy``: otherwise.
    """
    if not nodes:
        return JobHealth.STARTING
    if (expected_min_nodes and len(nodes) < expected_min_nodes
            and not any(n["state"] == NodeState.HEALTHY for n in nodes)):
        return JobHealth.STARTING
    for n in nodes:
        if n["state"] == NodeState.FAILED:
            return JobHealth.FAILED
        if _has_bad_worker(n) and n["restarts"] >= n["max_restarts"] and not n["left"]:
            return JobHealth.FAILED
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
        if not n["left"] and _suspect_ranks(n):
            return JobHealth.DEGRADED
    return JobHealth.HEALTHY


def _suspect_ranks(node: dict[str, Any]) -> list[int]:
    """Ranks of the node's live workers that its launcher judged suspect."""
    return sorted(
        w["rank"] for w in node["workers"]
        if w.get("health") == RankHealth.SUSPECT and w.get("exitcode") is None
    )


def _has_bad_worker(node: dict[str, Any]) -> bool:
    return any(
        str(w.get("state", "")).lower() in WORKER_BAD or w.get("exitcode") not in (None, 0)
        for w in node["workers"]
    )


def _worker_running(worker: dict[str, Any]) -> bool:
    return worker.get("exitcode") is None and str(worker.get("state", "")).lower() in WORKER_RUNNING


class Coordinator:
    """The control-plane server of one job.

    Thread-safety: the ZeroMQ socket is only used by the serving thread; the node table and
    the event log are guarded by a lock so :meth:`status_document` and :meth:`events` can be
    called from anywhere.
    """

    def __init__(
        self,
        run_id: str,
        secret: bytes,
        *,
        bind_host: str = "0.0.0.0",
        port: int = 0,
        advertise_host: str = "127.0.0.1",
        node_timeout_s: float = 10.0,
        events_file: Path | None = None,
        expected_nodes: tuple[int, int] | None = None,
    ) -> None:
        if not secret:
            raise FtrunError("the coordinator needs a non-empty job secret")
        self.run_id = run_id
        self._secret = secret
        self._bind_host = bind_host
        self._port = port
        self._advertise_host = advertise_host
        self.node_timeout_s = node_timeout_s
        self._events_file = events_file
        self._expected_nodes = expected_nodes
        self._lock = threading.Lock()
        self._nodes: dict[str, _Node] = {}
        self._events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        self._seq = 0
        self._events_fh: Any = None
        self._ctx: zmq.Context[Any] | None = None
        self._server: Server | None = None
        self._bound_port: int | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._serving = threading.Event()
        self._started_at = time.time()
        self._warn_limiter = RateLimiter(WARN_EVERY_S)
        self._commits = CommitTracker(
            node_gone=lambda node: self._node_gone(node, time.monotonic()))
        self._directives = DirectiveBook()
        self._store_reports: dict[str, dict[str, Any]] = {}
        self._store_seen: dict[str, float] = {}  # node -> monotonic time of its last report
        self._finalizing: set[str] = set()  # nodes whose store asked for its final target
        # Messages read, and those refused (``auth_failures``, ``bad_messages``).
        self.counters: dict[str, int] = {}
        self._handlers = {
            "status_request": self._on_status_request,
            "events_request": self._on_events_request,
            "hello": self._on_hello,
            "heartbeat": self._on_heartbeat,
            "event": self._on_event,
            "bye": self._on_bye,
            "snap_epoch": self._on_commit,
            "snap_verified": self._on_commit,
            "commit_query": self._on_commit,
            "persist_request": self._on_commit,
            "store_report": self._on_store_report,
            "replica_verified": self._on_replica_verified,
            "stores_request": self._on_stores,
        }

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``advertise_host:port`` with the port actually bound."""
        if self._bound_port is None:
            raise FtrunError("the coordinator is not bound yet; call bind() or start() first")
        return protocol.join_endpoint(self._advertise_host, self._bound_port)

    def bind(self) -> str:
        """Bind the ROUTER socket (idempotent), record ``job_start``; return the endpoint."""
        if self._server is not None:
            return self.endpoint
        ctx: zmq.Context[Any] = zmq.Context()
        server = Server("coordinator", self._secret, self.run_id, self._handlers,
                        sender="coordinator", on_reject=self._rejected)
        host = f"[{self._bind_host}]" if ":" in self._bind_host else self._bind_host
        port = "*" if self._port == 0 else str(self._port)
        try:
            last = server.bind(f"tcp://{host}:{port}", ctx)
        except zmq.ZMQError as e:
            ctx.term()
            raise FtrunError(
                f"coordinator cannot listen on {self._bind_host}:{self._port}: {e}; pick another "
                "port or free this one"
            ) from e
        self._bound_port = int(last.rsplit(":", 1)[1])
        self.counters = server.counters
        self._ctx, self._server = ctx, server
        if self._events_file is not None:
            self._open_events_file(self._events_file)
        self._stop.clear()
        log.info("coordinator of job %s listening on %s (bound %s:%s)", self.run_id,
                 self.endpoint, self._bind_host, self._bound_port)
        self._record("job_start", None, {"run_id": self.run_id, "endpoint": self.endpoint,
                                         "pid": os.getpid()})
        return self.endpoint

    def start(self) -> None:
        """Bind and serve in a daemon thread; returns once the socket is bound."""
        if self._thread is not None and self._thread.is_alive():
            return
        self.bind()
        self._thread = threading.Thread(
            target=self._serve, args=(self._stop,), name=f"ftrun-coordinator-{self.run_id}",
            daemon=True,
        )
        self._thread.start()

    def serve_forever(self, stop_event: threading.Event) -> None:
        """Bind if needed and serve in the calling thread until ``stop_event`` is set."""
        self.bind()
        self._serving.set()
        try:
            self._serve(stop_event)
        finally:
            self._close()
            self._serving.clear()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving (bounded by ``timeout_s``) and release the socket."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("coordinator thread did not stop within %.1f s; abandoning it",
                            timeout_s)
                return
            self._thread = None
        if self._serving.is_set():  # serve_forever() in another thread closes on its way out
            deadline = time.monotonic() + timeout_s
            while self._serving.is_set() and time.monotonic() < deadline:
                time.sleep(0.01)
            return
        self._close()

    def _close(self) -> None:
        server, ctx = self._server, self._ctx
        self._server, self._ctx = None, None
        if server is not None:
            server.close()
        if ctx is not None:
            ctx.term()
        with self._lock:
            if self._events_fh is not None:
                try:
                    self._events_fh.close()
                except OSError as e:
                    log.warning("closing the event log failed: %s", e)
                self._events_fh = None

    def _open_events_file(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self._events_fh = os.fdopen(fd, "a", encoding="utf-8")
        except OSError as e:
            log.error("cannot open the event log %s (%s); events stay in memory only", path, e)

    # -- serving -----------------------------------------------------------------------------

    def _serve(self, stop_event: threading.Event) -> None:
        server = self._server
        assert server is not None
        while not stop_event.is_set() and not self._stop.is_set():
            try:
                server.serve_once(POLL_INTERVAL_S, MAX_MESSAGES_PER_TICK)
                self._check_lost()
            except zmq.ContextTerminated:
                break
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("coordinator loop error; continuing")
                time.sleep(POLL_INTERVAL_S)
        log.debug("coordinator of job %s stopped serving", self.run_id)

    def _rejected(self, kind: str, address: str, reason: str, suppressed: int) -> None:
        """A refused message (already logged by the server) goes into the event log."""
        data: dict[str, Any] = {"peer": address, "reason": reason}
        if suppressed:
            data["suppressed"] = suppressed
        self._record(kind, None, data)

    # -- handlers (kind -> handler in self._handlers) ----------------------------------------

    def _on_status_request(self, msg: protocol.Message) -> Reply:
        return Reply("status_reply", {"doc": self.status_document()})

    def _on_events_request(self, msg: protocol.Message) -> Reply:
        events, more = self._events_since(int(msg.body.get("since", 0)))
        return Reply("events_reply", {"events": events, "more": more})

    def _on_hello(self, msg: protocol.Message) -> Reply:
        body = msg.body
        self._touch(body["node_id"], body["host"], body["pid"])
        return Reply("ack", {"re": msg.id})

    def _on_heartbeat(self, msg: protocol.Message) -> Reply | None:
        body = msg.body
        node = self._touch(body["node_id"], body["host"], body["pid"])
        with self._lock:
            node.heartbeat = dict(body)
            node.state = body["state"]
        return self._directives_reply(node.node_id, body.get("acked", ()))

    # -- directives (ftrun.coordinator.directives) ---------------------------------------------

    def direct(self, node_id: str, action: str, data: dict[str, Any]) -> str:
        """Order ``node_id``'s launcher to carry out ``action`` (restart | isolate | probe)
        with ``data``; returns the directive id. It is sent in reply to each of the node's
        heartbeats until acked, and dropped when the node is gone or after 120 s."""
        with self._lock:
            node = self._nodes.get(node_id)
            gone = node is None or node.left or node.lost
        if gone:
            raise FtrunError(f"cannot direct node {node_id!r}: it is "
                             f"{'unknown' if node is None else 'gone'}; direct a live node")
        d = self._directives.issue(node_id, action, data, time.monotonic())
        log.info("directive %s to node %s: %s %s", d.id, node_id, action, data)
        self._record("directive", node_id, {"id": d.id, "action": action, "data": data})
        return d.id

    def pending_directives(self, node_id: str | None = None) -> list[dict[str, Any]]:
        """The directives not acked yet (of ``node_id``, or of every node)."""
        return self._directives.pending(node_id)

    def _directives_reply(self, node_id: str, acked: Any) -> Reply | None:
        now = time.monotonic()
        out, done, expired = self._directives.for_heartbeat(node_id, acked, now)
        for d in done:
            self._record("directive_acked", node_id,
                         {"id": d.id, "action": d.action, "after_s": round(now - d.issued_mono, 3),
                          "sent": d.sent})
        for d in expired:
            log.warning("directive %s (%s) to node %s expired unacknowledged after %.0f s",
                        d.id, d.action, node_id, now - d.issued_mono)
            self._record("directive_expired", node_id,
                         {"id": d.id, "action": d.action, "sent": d.sent})
        return Reply("directives", {"directives": out}) if out else None

    def _drop_directives(self, node_id: str, why: str) -> None:
        for d in self._directives.drop_node(node_id):
            self._record("directive_dropped", node_id,
                         {"id": d.id, "action": d.action, "sent": d.sent, "why": why})

    def _on_event(self, msg: protocol.Message) -> None:
        body = msg.body
        self._touch(body["node_id"], None, None)
        self._record(body["type"], body["node_id"], body["data"])

    def _on_bye(self, msg: protocol.Message) -> Reply:
        body = msg.body
        node = self._touch(body["node_id"], None, None)
        with self._lock:
            node.left = True
            node.state = body["state"]
            node.exitcode = body["exitcode"]
        self._record("node_left", node.node_id,
                     {"state": body["state"], "exitcode": body["exitcode"]})
        self._drop_directives(node.node_id, "node left")
        return Reply("ack", {"re": msg.id})

    def _on_commit(self, msg: protocol.Message) -> Reply:
        return Reply("commit_info", self._commit(msg.kind, msg.body))

    def _on_store_report(self, msg: protocol.Message) -> Reply:
        body = msg.body
        with self._lock:
            self._store_reports[body["node_id"]] = dict(body)
            self._commits.persisted[body["node_id"]] = body["persisted_step"]
            self._commits.stores[body["node_id"]] = StoreState(
                bool(body.get("persist")), body.get("epoch"),
                body.get("target_done", -1), body.get("writing"))
            self._store_seen[body["node_id"]] = time.monotonic()
            if body.get("replicas", 1) > 1 and body.get("replica_addr"):
                self._commits.replicas = body["replicas"]
                return Reply("replica_plan", self._replica_plan(body["node_id"]))
        return Reply("ack", {"re": msg.id})

    def _on_stores(self, msg: protocol.Message) -> Reply:
        """The shard services of the live stores (ftrun.snapshot.shards): where a restore
        looks for the shards its node does not hold."""
        mono = time.monotonic()
        with self._lock:
            stores = [{"node_id": node, "addr": r["shard_addr"]}
                      for node, r in sorted(self._store_reports.items())
                      if r.get("shard_addr") and not r.get("final")
                      and not self._node_gone(node, mono)]
        return Reply("stores_reply", {"stores": stores})

    # -- replicas (ftrun.snapshot.replica) ----------------------------------------------------

    def _replica_members(self) -> dict[str, str]:
        """node -> replica address, for the live stores that take replicas. Caller holds
        the lock."""
        mono = time.monotonic()
        return {
            node: r["replica_addr"] for node, r in self._store_reports.items()
            if r.get("replica_addr") and not r.get("final") and not self._node_gone(node, mono)
            and mono - self._store_seen.get(node, 0.0) <= self.node_timeout_s
        }

    def _placement(self) -> tuple[dict[str, list[str]], dict[str, str]]:
        """Group placement over the live stores (recomputed from the membership each time).
        Caller holds the lock."""
        members = self._replica_members()
        # Fewer live members than m: fewer replicas can exist, and durable counts those.
        self._commits.set_replica_nodes(len(members))
        return group_placement(sorted(members), self._commits.replicas), members

    def _replica_plan(self, node_id: str) -> dict[str, Any]:
        placement, members = self._placement()
        peers = [{"node_id": p, "addr": members[p]} for p in placement.get(node_id, [])]
        plan: dict[str, Any] = {"replicas": self._commits.replicas, "members": len(members),
                                "peers": peers}
        off = self._commits.durable_off()
        if off:
            plan["off"] = off  # the store says once that it replicates nothing, and why
        return plan

    def _on_replica_verified(self, msg: protocol.Message) -> Reply:
        b = msg.body
        with self._lock:
            ep = self._commits.get(b["epoch"])
            before = ep.durable if ep is not None else -1
            ep = self._commits.replica_verified(b["epoch"], b["node_id"], b["origin"],
                                                b["rank"], b["step"])
            durable = ep.durable if ep is not None else -1
        if durable > before:
            log.debug("step %d is durable (every shard has %d verified replica(s))", durable,
                      self._commits.replicas - 1)
        return Reply("ack", {"re": msg.id})

    def _commit(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if kind == "persist_request" and body["final"]:
                self._finalizing.add(body["node_id"])
            reply, began = self._commits.handle(kind, body)
            if reply.get("known") and self._commits.replicas > 1 and \
                    len(self._replica_members()) > 1:
                ep = self._commits.get(reply["epoch"])
                reply["durable"] = ep.durable if ep is not None else -1
            targets, self._commits.new_targets = self._commits.new_targets, []
            skipped, self._commits.skipped = self._commits.skipped, []
        if began is not None:
            self._record("restore", body["node_id"], began)
        for step, writing in skipped:
            log.warning("step %d is due for disk but node(s) %s still write the previous "
                        "target: skipped, the next commit after that write is due instead",
                        step, ", ".join(writing))
            self._record("persist_skipped", body.get("node_id"),
                         {"step": step, "writing": writing})
        for t in targets:
            log.info("persist target: step %d of epoch %s (%s%s)", t.step, t.epoch, t.reason,
                     ", final" if t.final else "")
            self._record("persist_target", body.get("node_id"),
                         {"epoch": t.epoch, "step": t.step, "reason": t.reason,
                          "final": t.final})
        return reply

    def wait_final_persists(self, timeout_s: float, start_grace_s: float,
                            exclude: str | None = None) -> list[str]:
        """Wait until every node whose store persists has written its final step, left, or
        gone silent. Returns the nodes given up on.

        A node whose store has asked for the final target is waited for up to ``timeout_s``
        in all; one that has not asked yet only up to ``start_grace_s`` (it may not be
        stopping at all). The launcher that runs the coordinator calls this before stopping
        it: the other nodes' stores ask it which step to write as they stop.
        """
        t0 = time.monotonic()
        while True:
            now = time.monotonic()
            with self._lock:
                waiting = [
                    node for node, r in self._store_reports.items()
                    if node != exclude and r.get("persist") and not r.get("final")
                    and not self._node_gone(node, now)
                ]
                started = [n for n in waiting if n in self._finalizing]
            if not waiting or now - t0 >= timeout_s or (
                    not started and now - t0 >= start_grace_s):
                return waiting
            time.sleep(0.1)

    def _node_gone(self, node_id: str, mono: float) -> bool:
        node = self._nodes.get(node_id)
        if node is None:
            return False
        return node.left or node.lost or mono - node.last_seen_mono > self.node_timeout_s

    def _touch(self, node_id: str, host: str | None, pid: int | None) -> _Node:
        now, mono = time.time(), time.monotonic()
        joined: dict[str, Any] | None = None
        with self._lock:
            node = self._nodes.get(node_id)
            if node is None:
                default_host = node_id.rsplit("/", 1)[0] if "/" in node_id else ""
                node = _Node(node_id, host or default_host, pid or 0, now, now, mono)
                self._nodes[node_id] = node
                joined = {"host": node.host, "pid": node.pid}
            else:
                if node.lost or node.left:
                    joined = {"host": host or node.host, "pid": pid or node.pid,
                              "rejoined": True}
                    node.lost = node.left = False
                    node.exitcode = None
                node.last_seen, node.last_seen_mono = now, mono
                if host:
                    node.host = host
                if pid:
                    node.pid = pid
        if joined is not None:
            log.info("node %s joined (%s)", node_id, joined)
            self._record("node_joined", node_id, joined)
        return node

    def _check_lost(self) -> None:
        mono = time.monotonic()
        lost: list[tuple[str, float]] = []
        with self._lock:
            for node in self._nodes.values():
                silent_s = mono - node.last_seen_mono
                if not node.lost and not node.left and silent_s > self.node_timeout_s:
                    node.lost = True
                    lost.append((node.node_id, silent_s))
        for node_id, silent_s in lost:
            log.warning("node %s lost: no message for %.1f s (timeout %.1f s)", node_id,
                        silent_s, self.node_timeout_s)
            self._record("node_lost", node_id, {"silent_s": round(silent_s, 3),
                                                "node_timeout_s": self.node_timeout_s})
            self._drop_directives(node_id, "node lost")

    # -- events ------------------------------------------------------------------------------

    def record_event(self, type: str, node: str | None = None, **data: Any) -> dict[str, Any]:
        """Record an event from inside this process (thread-safe)."""
        return self._record(type, node, data)

    def _record(self, type_: str, node: str | None, data: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self._seq += 1
            event = dict(data)
            event.update(seq=self._seq, ts=time.time(), type=type_, node=node)
            self._events.append(event)
            fh = self._events_fh
            if fh is not None:
                try:
                    fh.write(json.dumps(event, separators=(",", ":")) + "\n")
                    fh.flush()
                except (OSError, TypeError, ValueError) as e:
                    allowed, _ = self._warn_limiter.allow(("events_file", type(e)))
                    if allowed:
                        log.error("writing the event log failed: %s", e)
        return event

    def events(self, since: int = 0) -> list[dict[str, Any]]:
        """Every event kept in memory with ``seq > since``, oldest first."""
        with self._lock:
            return [dict(e) for e in self._events if e["seq"] > since]

    def _events_since(self, since: int) -> tuple[list[dict[str, Any]], bool]:
        out: list[dict[str, Any]] = []
        size = 0
        for event in self.events(since):
            size += len(json.dumps(event, separators=(",", ":"))) + 1
            if len(out) >= EVENTS_REPLY_MAX or size > EVENTS_REPLY_BYTES:
                return out, True
            out.append(event)
        return out, False

    # -- status ------------------------------------------------------------------------------

    def status_document(self) -> dict[str, Any]:
        """The versioned status document ``ftrun status`` shows (see the README)."""
        now, mono = time.time(), time.monotonic()
        with self._lock:
            nodes = [self._node_doc(n, mono) for n in self._nodes.values()]
            tail = [dict(e) for e in list(self._events)[-EVENTS_TAIL:]]
            n_events = self._seq
        nodes.sort(key=lambda n: (n["group_rank"] is None, n["group_rank"] or 0, n["node_id"]))
        min_nodes = self._expected_nodes[0] if self._expected_nodes else None
        return {
            "version": STATUS_VERSION,
            "run_id": self.run_id,
            "coordinator": {
                "endpoint": self.endpoint if self._bound_port is not None else None,
                "pid": os.getpid(),
                "started_at": self._started_at,
                "expected_nodes": list(self._expected_nodes) if self._expected_nodes else None,
            },
            "time": now,
            "health": health_of(nodes, min_nodes).value,
            "nodes": nodes,
            "summary": {
                "nodes": len(nodes),
                "nodes_lost": sum(1 for n in nodes if n["lost"]),
                "ranks": sum(len(n["ranks"]) for n in nodes),
                "workers_running": sum(
                    1 for n in nodes if not (n["lost"] or n["left"])
                    for w in n["workers"] if _worker_running(w)
                ),
                "ranks_suspect": sum(len(n["suspect_ranks"]) for n in nodes if not n["lost"]),
                "restarts": max((n["restarts"] for n in nodes), default=0),
                "events": n_events,
            },
            "events_tail": tail,
            "snapshots": self._snapshot_summary(),
        }

    def _snapshot_summary(self) -> dict[str, Any] | None:
        with self._lock:
            summary = self._commits.summary()
            stores = {n: {"bytes": r["bytes"], "segments": r["segments"],
                          "persisted_step": r["persisted_step"], "ranks": r["ranks"],
                          "skipped": r.get("skipped", 0), "every": r.get("every")}
                      for n, r in self._store_reports.items()}
        if summary is None and not stores:
            return None
        out: dict[str, Any] = dict(summary or {})
        out["stores"] = stores
        # Snapshots the ranks gave up (the store had not released a buffer in time), and the
        # interval they snapshot at (the largest any node reports).
        out["skipped"] = sum(s["skipped"] for s in stores.values())
        out["every"] = max((s["every"] for s in stores.values() if s["every"]), default=None)
        with self._lock:
            if self._commits.replicas > 1:
                out["replica_coverage"] = self._replica_coverage()
        return out

    def _replica_coverage(self) -> dict[str, dict[str, Any]]:
        """Per node: the peers holding its replicas, and the newest step whose shards of its
        ranks all have m - 1 verified replicas. Caller holds the lock."""
        placement, _ = self._placement()
        return {
            node: {"peers": placement.get(node, []),
                   "replicated_step": self._commits.covered(list(r.get("ranks") or [])),
                   "sent": r.get("replica_sent", 0), "superseded": r.get("replica_superseded", 0),
                   "abandoned": r.get("replica_abandoned", 0),
                   # why this node's store last refused to hold a peer's replica (full /dev/shm)
                   "refused": r.get("replica_refused")}
            for node, r in sorted(self._store_reports.items())
        }

    def _node_doc(self, node: _Node, mono: float) -> dict[str, Any]:
        hb = node.heartbeat
        # Launchers that report no verdict (older ones, or ranks not running) read as ok.
        workers = [{**WORKER_VERDICT_DEFAULTS, **w} for w in hb.get("workers", [])]
        doc = {
            "node_id": node.node_id,
            "host": node.host,
            "pid": node.pid,
            "group_rank": hb.get("group_rank"),
            "group_world_size": hb.get("group_world_size"),
            "state": node.state,
            "ranks": sorted(w["rank"] for w in workers),
            "workers": workers,
            "restarts": hb.get("restarts", 0),
            "max_restarts": hb.get("max_restarts", 0),
            "last_heartbeat_age_s": round(max(0.0, mono - node.last_seen_mono), 3),
            "last_error": hb.get("last_error"),
            "lost": node.lost,
            "left": node.left,
            "exitcode": node.exitcode,
        }
        doc["suspect_ranks"] = [] if node.left else _suspect_ranks(doc)
        return doc


# -- the rendezvous store handshake -----------------------------------------------------------


def publish_endpoint(store: Any, endpoint: str) -> None:
    """Announce the coordinator endpoint in the job's rendezvous store."""
    store.set(ENDPOINT_KEY, endpoint.encode())


def lookup_endpoint(store: Any, timeout_s: float) -> str:
    """The coordinator endpoint from the rendezvous store, waiting at most ``timeout_s``."""
    try:
        store.wait([ENDPOINT_KEY], timedelta(seconds=timeout_s))
        raw = store.get(ENDPOINT_KEY)
    except Exception as e:  # noqa: BLE001 - torch raises several types for a timeout
        raise UnreachableError(
            f"no coordinator endpoint under {ENDPOINT_KEY!r} in the rendezvous store within "
            f"{timeout_s:g} s ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            "is node 0's launcher or `ftrun coordinator` running for this job?"
        ) from None
    endpoint = raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)
    protocol.split_endpoint(endpoint)  # validate
    return endpoint


# -- standalone coordinator -------------------------------------------------------------------


def _install_stop_handlers(stop: threading.Event) -> dict[int, Any]:
    previous: dict[int, Any] = {}

    def _on_signal(signum: int, _frame: Any) -> None:
        log.info("coordinator got signal %s; stopping", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            previous[sig] = signal.signal(sig, _on_signal)
        except ValueError:  # not the main thread
            log.warning("cannot install a %s handler outside the main thread", sig)
    return previous


def _restore_handlers(previous: Iterable[tuple[int, Any]]) -> None:
    for sig, handler in previous:
        try:
            signal.signal(sig, handler)
        except (ValueError, TypeError):
            pass


def run_standalone(
    run_id: str,
    rdzv_endpoint: str,
    *,
    state_dir: str | None,
    node_timeout_s: float,
    bind_host: str,
) -> int:
    """Host the job's c10d rendezvous store and its coordinator until SIGTERM/SIGINT.

    Launchers started with ``--rdzv-endpoint`` pointing here find the coordinator through the
    store key :data:`ENDPOINT_KEY`. Returns the exit code (0 after a clean stop).
    """
    from torch.distributed import TCPStore  # lazily: torch is heavy

    host, port = protocol.split_endpoint(rdzv_endpoint)
    secret = jobs.load_secret(run_id, state_dir, create=True)
    try:
        store = TCPStore(host, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30))
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError/DistNetworkError
        raise UnreachableError(
            f"cannot host the rendezvous store on {rdzv_endpoint}: {e}; is the port in use?"
        ) from e
    coordinator = Coordinator(
        run_id, secret, bind_host=bind_host, advertise_host=host,
        node_timeout_s=node_timeout_s, events_file=jobs.events_path(run_id, state_dir),
    )
    stop = threading.Event()
    previous = _install_stop_handlers(stop)
    try:
        endpoint = coordinator.bind()
        publish_endpoint(store, endpoint)
        path = jobs.write_job_file(jobs.JobFile(
            run_id=run_id, endpoint=endpoint, host=socket.gethostname(), pid=os.getpid(),
            started_at=time.time(), rdzv_endpoint=rdzv_endpoint,
        ), state_dir)
        log.info("job %s: rendezvous store on %s, coordinator on %s, job file %s", run_id,
                 rdzv_endpoint, endpoint, path)
        coordinator.serve_forever(stop)
    finally:
        coordinator.stop()
        _restore_handlers(previous.items())
        del store
    return 0
