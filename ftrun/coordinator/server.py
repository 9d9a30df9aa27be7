"""The job coordinator: the server every node launcher and store reports to.

This module is the wiring: the ROUTER socket, the handler table (message kind -> the part
that handles it), the serving loop and the lifecycle. The parts, each owning its data:

- :mod:`~ftrun.coordinator.membership`: which nodes are in the job, what each launcher last
  said (heartbeats), which left and which went quiet (lost);
- :mod:`~ftrun.coordinator.events`: the structured event log, in memory and ``events.jsonl``;
- :mod:`~ftrun.coordinator.snapshots`: commits, persist targets and replicas of snapshots;
- :mod:`~ftrun.coordinator.directives`: orders to launchers, sent in heartbeat replies;
- :mod:`~ftrun.coordinator.status`: the status document, paged, with the job's health;
- detection (the collective analysis) plugs in as ``Coordinator(detection=...)``.

Every message is authenticated with the job secret (:mod:`ftrun.protocol.transport`); bad
messages are logged, counted and recorded, never allowed to crash the loop.

It runs inside the launcher of node 0 (:meth:`Coordinator.start`, a daemon thread) or as a
standalone process that also hosts the job's c10d rendezvous store (:func:`run_standalone`).

**Failover** (``--rdzv-backend etcd``). The coordinator then runs in whichever launcher holds
the role in etcd (a :class:`~ftrun.coordinator.api.CoordinatorRole`) and is bound to its
*term*: it takes only messages signed for that term (but ``ftrun status``'s read-only
requests), so nothing captured before a failover is accepted after it. Every decision (a
message that changes state: a heartbeat, a commit, a store's report; a lost node; a
directive; the detection service's isolations) first asks the role whether its lease still
holds; once it does not, the coordinator *steps down*: it refuses everything, records
``coordinator_stepped_down`` and decides nothing more; the launcher then stops it. What the
job's launchers and stores report rebuilds a new coordinator's picture (they re-send
everything on a new term); what no report carries lives with the role: the event log's
position (saved every :data:`STATE_SAVE_S`; a successor numbers on from
:data:`EVENT_SEQ_GAP` past it) and the detection service's exclude list.

**Where it listens.** By default the coordinator binds the address its advertised host (the
job's rendezvous host) resolves to, not every interface: it is reachable where the job
reaches the rendezvous store and nowhere else. A name that resolves to a loopback address
on this host only (a ``127.0.1.1`` line in /etc/hosts) cannot be what other hosts use, so
then it binds every interface and says so; ``bind_host`` (``--bind-host``) overrides both.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import signal
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from ftrun import jobs, knobs, protocol
from ftrun.coordinator.aggregation import Groups, parse_group_size
from ftrun.coordinator.api import Action, CoordinatorRole
from ftrun.coordinator.directives import REPORT_ACTION, DirectiveBook
from ftrun.coordinator.events import EventLog
from ftrun.coordinator.membership import Membership
from ftrun.coordinator.snapshots import SnapshotControl
from ftrun.coordinator.status import (
    EVENTS_TAIL,
    PAGE_BYTES,
    PAGE_NODES,
    SELECT_ALL,
    STATUS_VERSION,
    StatusBuilder,
    health_of,
    with_detection,
)
from ftrun.errors import ConfigError, FtrunError, StaleTermError, UnreachableError
from ftrun.protocol import messages as m
from ftrun.protocol.messages import UNSET, given
from ftrun.protocol.service import Service
from ftrun.protocol.transport import RateLimiter, Reply, Server
from ftrun.sigrelay import SignalRelay

log = logging.getLogger(__name__)

__all__ = ["ENDPOINT_KEY", "STATUS_VERSION", "Coordinator", "health_of", "lookup_endpoint",
           "publish_endpoint", "run_standalone"]

ENDPOINT_KEY = "ftrun/coordinator"
DETECT_KEY = "ftrun/detect"
# A launcher's events that say its workers' world is ending (the detection service holds its
# findings about that world's ranks until the new one reports).
RESTART_EVENTS = frozenset({"worker_failure", "restart"})
# Events before which the snapshot commits batched so far are recorded (the failures and
# recoveries the report places among the commits, a node's end and the job's).
FLUSH_COMMITS_BEFORE = frozenset({
    "worker_failure", "hang_detected", "node_lost", "corruption_detected", "detection",
    "restart", "recovery", "job_end", "node_left", "host_isolated"})
POLL_INTERVAL_S = 0.1
MAX_MESSAGES_PER_TICK = 1000
# The serving thread reads what queued up at most this often: at thousands of messages a
# second, waking for each one would cost more than handling it. Adds at most this much to a
# reply's latency.
BATCH_INTERVAL_S = 0.01
# How often the serving thread looks for lost nodes (a scan of the whole node table).
LOST_CHECK_S = 0.25
# How often it plans aggregation groups again, when the node table changed.
PLAN_EVERY_S = 0.5
# Behind by more than this (messages queued unread), the coordinator says so.
BEHIND_WARN_S = 1.0
WARN_EVERY_S = 10.0
EVENTS_REPLY_MAX = 1000
EVENTS_REPLY_BYTES = protocol.MAX_MESSAGE_BYTES // 2
ALL_INTERFACES = "0.0.0.0"
# Read-only requests a coordinator with a term takes whatever term they are signed for:
# `ftrun status` from a login shell need not know the term (a replay of one changes nothing).
TERM_FREE = frozenset({"status_request", "events_request"})
# A coordinator that holds a role saves the event log's position this often, and its
# successor numbers on this far past the last saved one (the events of its last second).
STATE_SAVE_S = 1.0
EVENT_SEQ_GAP = 100_000


def default_bind_host(advertise_host: str) -> str:
    """The address to bind when none is given: the one ``advertise_host`` resolves to (see
    the module docstring), or every interface when that is a loopback address of this host
    only."""
    try:
        ip = ipaddress.ip_address(advertise_host)
    except ValueError:
        pass
    else:
        return str(ip)
    try:
        infos = socket.getaddrinfo(advertise_host, None, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ConfigError(f"cannot resolve the coordinator host {advertise_host!r} ({e}); "
                          "pass --bind-host ADDRESS") from None
    addr = str(infos[0][4][0])
    if ipaddress.ip_address(addr).is_loopback and advertise_host != "localhost":
        log.warning("the coordinator host %s resolves to %s, a loopback address of this host "
                    "only: binding every interface (pass --bind-host to choose)",
                    advertise_host, addr)
        return ALL_INTERFACES
    return addr


class Coordinator:
    """The control-plane server of one job.

    Thread-safety: the ZeroMQ socket is only used by the serving thread; every part guards
    its own data, so :meth:`status_document`, :meth:`events`, :meth:`direct` and
    :meth:`record_event` can be called from any thread.
    """

    def __init__(
        self,
        run_id: str,
        secret: bytes,
        *,
        bind_host: str | None = None,
        port: int = 0,
        advertise_host: str = "127.0.0.1",
        node_timeout_s: float = 10.0,
        events_file: Path | None = None,
        expected_nodes: tuple[int, int] | None = None,
        detection: Any = None,
        role: CoordinatorRole | None = None,
        aggregate_group: int | None = None,
    ) -> None:
        if not secret:
            raise FtrunError("the coordinator needs a non-empty job secret")
        self.run_id = run_id
        self._secret = secret
        self._bind_host = bind_host
        self._port = port
        self._advertise_host = advertise_host
        self._events_file = events_file
        self._expected_nodes = expected_nodes
        # The role this coordinator holds when it can fail over (None: it is the job's only
        # one), its term (0: none), and why it stepped down (None: it did not).
        self._role = role
        self.term = role.term if role is not None else 0
        # What messages must be signed for: the role's term, or (no failover) an incarnation
        # of its own, new each time a coordinator starts: a message captured before a restart
        # is refused after it (stale_term), and the launchers and stores follow the new one
        # (ftrun.protocol.transport.Client follows a term it was not given).
        self.incarnation = self.term or secrets.randbits(62) + 1
        self.stepped_down: str | None = None
        self._state_thread: threading.Thread | None = None
        self._state_stop = threading.Event()
        # The collective analysis (ftrun.coordinator.detect_service), when the job runs one:
        # ``detection`` is its DetectConfig.
        self._detection: Any = None
        self._detection_config = detection
        self._membership = Membership(node_timeout_s)
        # Which launchers report through which (ftrun.coordinator.aggregation); the group
        # size from FTRUN_AGGREGATE_GROUP unless given.
        if aggregate_group is None:
            try:
                aggregate_group = parse_group_size(knobs.AGGREGATE_GROUP.get(),
                                                   knobs.AGGREGATE_GROUP.name)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        self._groups = Groups(aggregate_group, socket.gethostname())
        self._next_plan = 0.0
        self._events = EventLog(term=self.term)
        self._directives = DirectiveBook()
        self._snapshots = SnapshotControl(self._membership, self._events,
                                          self._corruption_policy(detection))
        self._status = StatusBuilder(expected_nodes)
        self._service: Service | None = None
        self._bound_host: str | None = None
        self._bound_port: int | None = None
        self._started_at = time.time()
        self._warn_limiter = RateLimiter(WARN_EVERY_S)
        # The last time the serving thread had read every queued message (see membership).
        self._caught_up = time.monotonic()
        self._next_lost_check = 0.0
        # Until then a node silent for a few of its heartbeat intervals is lost (set by a
        # node's worker_failure or restart event: a peer may have gone with its host).
        self._early_until = 0.0
        self._behind_max_s = 0.0  # of the current episode of being behind (0: not behind)
        # Messages read, and those refused (``auth_failures``, ``bad_messages``).
        self.counters: dict[str, int] = {}
        handlers = {
            "status_request": self._on_status_request,
            "events_request": self._on_events_request,
            "hello": self._on_hello,
            "heartbeat": self._on_heartbeat,
            "keepalive": self._on_keepalive,
            "aggregate": self._on_aggregate,
            "event": self._on_event,
            "bye": self._on_bye,
            **self._snapshots.handlers(),
        }
        self._handlers = {kind: handler if kind in TERM_FREE else self._guarded(handler)
                          for kind, handler in handlers.items()}
        # The kinds whose handlers take typed bodies (the others, plain objects).
        self._typed = frozenset({"status_request", "events_request", "hello", "keepalive",
                                 "event", "bye", "aggregate"})

    @property
    def node_timeout_s(self) -> float:
        return self._membership.node_timeout_s

    # -- the role (failover) -----------------------------------------------------------------

    def acting(self) -> bool:
        """Whether this coordinator may decide anything now: it holds no role (the job's
        only coordinator), or its role's lease still holds. Steps down on the first False."""
        if self.stepped_down is not None:
            return False
        if self._role is None or self._role.acting():
            return True
        self.step_down(f"its lease on the coordinator role (term {self.term}) ran out")
        return False

    def step_down(self, reason: str) -> None:
        """Decide nothing more: another launcher may hold the role now. Idempotent; the
        launcher stops the coordinator afterwards."""
        if self.stepped_down is not None:
            return
        self.stepped_down = reason
        log.error("coordinator of job %s (term %d) steps down: %s; it decides nothing more",
                  self.run_id, self.term, reason)
        self._record("coordinator_stepped_down", None, {"term": self.term, "reason": reason})

    def _guarded(self, handler: Any) -> Any:
        """``handler``, run only while this coordinator acts (see :meth:`acting`)."""
        def guarded(msg: protocol.Message) -> Any:
            if not self.acting():
                raise StaleTermError(
                    f"the coordinator of term {self.term} stepped down "
                    f"({self.stepped_down}); look up the current one in etcd")
            return handler(msg)

        return guarded

    def _restore_state(self) -> None:
        """Take over what the role keeps: the event log's position."""
        assert self._role is not None
        try:
            seq = self._role.load("events_seq")
        except UnreachableError as e:
            log.warning("cannot read the event log's position from the coordinator role (%s);"
                        " numbering events from %d", e, EVENT_SEQ_GAP)
            seq = 0
        if seq:
            self._events.start_after(int(seq) + EVENT_SEQ_GAP)

    def _save_state(self) -> None:
        """The state thread: save the event log's position while the role holds, at once,
        every STATE_SAVE_S when it moved, and a last time as the coordinator stops."""
        assert self._role is not None
        saved = -1
        while True:
            stopping = self._state_stop.wait(STATE_SAVE_S if saved >= 0 else 0.0)
            count = self._events.count
            if count != saved and self.acting():
                try:
                    if self._role.save("events_seq", count):
                        saved = count
                except Exception as e:  # noqa: BLE001 - logged; the next round tries again
                    log.warning("saving the event log's position failed (%s); retrying", e)
            if stopping:
                return

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``advertise_host:port`` with the port actually bound."""
        if self._bound_port is None:
            raise FtrunError("the coordinator is not bound yet; call bind() or start() first")
        return protocol.join_endpoint(self._advertise_host, self._bound_port)

    def bind(self) -> str:
        """Bind the ROUTER socket (idempotent), record ``job_start``; return the endpoint."""
        if self._service is not None:
            return self.endpoint
        bind_host = self._bind_host or default_bind_host(self._advertise_host)
        server = Server("coordinator", self._secret, self.run_id, self._handlers,
                        sender="coordinator", on_reject=self._rejected, typed=self._typed,
                        term=self.incarnation, term_free=TERM_FREE)
        service = Service(server, poll_s=POLL_INTERVAL_S, max_messages=MAX_MESSAGES_PER_TICK,
                          after=self._after, batch_s=BATCH_INTERVAL_S, own_context=True,
                          thread_name=f"ftrun-coordinator-{self.run_id}")
        host = f"[{bind_host}]" if ":" in bind_host else bind_host
        port = "*" if self._port == 0 else str(self._port)
        try:
            last = service.bind(f"tcp://{host}:{port}")
        except FtrunError as e:
            raise FtrunError(
                f"coordinator cannot listen on {bind_host}:{self._port}: {e.__cause__}; pick "
                "another port or free this one, or another --bind-host"
            ) from e.__cause__
        self._bound_host = bind_host
        self._bound_port = int(last.rsplit(":", 1)[1])
        self.counters = server.counters
        self._service = service
        if self._events_file is not None:
            self._events.open(self._events_file)
        log.info("coordinator of job %s listening on %s (bound %s:%s%s)", self.run_id,
                 self.endpoint, bind_host, self._bound_port,
                 f", term {self.term}" if self.term else "")
        start: dict[str, Any] = {"run_id": self.run_id, "endpoint": self.endpoint,
                                 "pid": os.getpid()}
        if self._role is not None:
            self._restore_state()
            start["term"] = self.term
            self._state_thread = threading.Thread(target=self._save_state, daemon=True,
                                                  name=f"ftrun-coordinator-state-{self.run_id}")
            self._state_thread.start()
        self._record("job_start", None, start)
        if self._detection_config is not None:
            self._start_detection(bind_host)
        return self.endpoint

    def _start_detection(self, bind_host: str) -> None:
        from ftrun.coordinator.detect_service import DetectService

        excluded = (self._events_file.parent / "excluded.json"
                    if self._events_file is not None else None)
        self._detection = DetectService(
            self.run_id, self._secret, self._detection_config, direct=self._direct_quietly,
            record=self._record, nodes=self._live_nodes, coordinator_host=socket.gethostname(),
            excluded_file=excluded, bind_host=bind_host, advertise_host=self._advertise_host,
            acting=self.acting, role=self._role, term=self.incarnation)
        self._detection.start()

    def _corruption_policy(self, detection: Any) -> Any:
        """What to do when replicas disagree (ftrun.coordinator.corruption)."""
        from ftrun.coordinator.corruption import CorruptionPolicy

        def isolate(host: str, reason: str, evidence: dict[str, Any]) -> bool:
            if self._detection is not None:
                self._detection.isolate(host, reason, evidence)
            return self._detection is not None

        def host_of(node_id: str) -> str | None:
            node = self._membership.get(node_id)
            return node.host if node is not None else None

        return CorruptionPolicy(getattr(detection, "on_corruption", "restart"),
                                direct=self._direct_quietly, isolate=isolate, host_of=host_of,
                                record=self._record, coordinator_host=socket.gethostname())

    @property
    def detect_endpoint(self) -> str | None:
        """Where the ranks send their collective reports (None: no detection)."""
        return self._detection.endpoint if self._detection is not None else None

    def _live_nodes(self) -> dict[str, dict[str, Any]]:
        """node -> its host and probe service, for the nodes that are not gone."""
        mono = time.monotonic()
        return {r.node_id: {"host": r.host, "probe_addr": r.fields.get("probe_addr")}
                for r in self._membership.records()
                if not self._membership.gone(r.node_id, mono)}

    def _direct_quietly(self, node_id: str, action: str, data: dict[str, Any]) -> str:
        """:meth:`direct` for the detection service: a node gone meanwhile is logged."""
        try:
            return self.direct(node_id, action, data)
        except FtrunError as e:
            log.warning("%s", e)
            return ""

    def start(self) -> None:
        """Bind and serve in a daemon thread; returns once the socket is bound."""
        self.bind()
        assert self._service is not None
        self._service.start()

    def serve_forever(self, stop_event: threading.Event) -> None:
        """Bind if needed and serve in the calling thread until ``stop_event`` is set."""
        self.bind()
        assert self._service is not None
        try:
            self._service.run(stop_event)
        finally:
            self._close_parts()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving (bounded by ``timeout_s``) and release the socket."""
        service = self._service
        if service is None:
            return
        serving_elsewhere = service.serving and not service.owns_thread
        if service.stop(timeout_s) and not serving_elsewhere:
            self._close_parts()

    def _close_parts(self) -> None:
        self._state_stop.set()
        if self._state_thread is not None:
            self._state_thread.join(timeout=10.0)
            self._state_thread = None
        if self._detection is not None:
            self._detection.stop()
        self._service = None
        self._flush_commits()
        self._events.close()

    # -- serving -----------------------------------------------------------------------------

    def _after(self, n: int) -> None:
        self._tick(n < MAX_MESSAGES_PER_TICK)

    def _tick(self, drained: bool) -> None:
        """Between batches: note whether the queue was drained, look for lost nodes.

        An episode of being behind (messages queued unread for longer than
        :data:`BEHIND_WARN_S`) is logged and recorded when it starts and when it ends."""
        mono = time.monotonic()
        behind_s = mono - self._caught_up
        if drained:
            if self._behind_max_s:
                log.warning("coordinator caught up with its messages (it was up to %.1f s "
                            "behind)", self._behind_max_s)
                self._record("coordinator_caught_up", None,
                             {"behind_max_s": round(self._behind_max_s, 3)})
                self._behind_max_s = 0.0
            self._caught_up = mono
        elif behind_s > BEHIND_WARN_S:
            if not self._behind_max_s:
                log.warning("coordinator is %.1f s behind its messages: no node is declared "
                            "lost until it catches up", behind_s)
                self._record("coordinator_behind", None, {"behind_s": round(behind_s, 3)})
            self._behind_max_s = max(self._behind_max_s, behind_s)
        if mono >= self._next_lost_check:
            self._next_lost_check = mono + LOST_CHECK_S
            if self.acting():
                self._check_lost()
        if mono >= self._next_plan:
            self._next_plan = mono + PLAN_EVERY_S
            self._plan_groups()

    def _plan_groups(self) -> None:
        """Plan the aggregation groups again when the node table changed; a handover (an
        aggregator lost, gone or moved) is logged and recorded."""
        for group, old, new in self._groups.refresh(self._membership.records(),
                                                    self._membership.version):
            log.info("aggregation group %d: %s takes over from %s", group, new, old)
            self._record("aggregator_handover", new, {"group": group, "from": old})

    def _check_lost(self) -> None:
        for node_id, silent_s in self._membership.check_lost(self._caught_up):
            log.warning("node %s lost: no message for %.1f s (timeout %.1f s)", node_id,
                        silent_s, self.node_timeout_s)
            self._record("node_lost", node_id, {"silent_s": round(silent_s, 3),
                                                "node_timeout_s": self.node_timeout_s})
            self._drop_directives(node_id, "node lost")
            self._drop_from_rendezvous(node_id, silent_s,
                                       f"silent for {silent_s:.1f} s (--node-timeout)")
        if time.monotonic() >= self._early_until:
            return
        for node_id, silent_s, limit_s in self._membership.check_lost_early(self._caught_up):
            reason = (f"silent for {silent_s:.1f} s (over {limit_s:.1f} s: a few of its "
                      "heartbeat intervals) while other nodes' workers failed")
            log.warning("node %s lost: %s", node_id, reason)
            self._record("node_lost", node_id, {"silent_s": round(silent_s, 3),
                                                "limit_s": round(limit_s, 3), "early": True,
                                                "reason": reason})
            self._membership.note_error(node_id, f"lost: {reason}")
            self._drop_directives(node_id, "node lost")
            self._drop_from_rendezvous(node_id, silent_s, reason)

    def _drop_from_rendezvous(self, node_id: str, silent_s: float, reason: str) -> None:
        """Order every other live node to take the lost ``node_id`` out of the rendezvous
        round now (:data:`Action.DROP_NODE`): the survivors re-rendezvous without waiting
        for its c10d keep-alives to expire. The first to act removes it; for the others it
        is gone already. Nothing to do for a node that never said its rendezvous name."""
        lost = self._membership.get(node_id)
        extra = lost.fields.get("extra") if lost is not None else None
        rdzv_node = extra.get("rdzv_node") if isinstance(extra, dict) else None
        if not rdzv_node:
            return
        data = {"node": node_id, "rdzv_node": str(rdzv_node), "reason": reason,
                "silent_s": round(silent_s, 3)}
        mono = time.monotonic()
        for other in self._membership.records():
            if other.node_id != node_id and not self._membership.gone(other.node_id, mono):
                self._direct_quietly(other.node_id, Action.DROP_NODE, data)

    def _rejected(self, kind: str, address: str, reason: str, suppressed: int) -> None:
        """A refused message (already logged by the server) goes into the event log."""
        data: dict[str, Any] = {"peer": address, "reason": reason}
        if suppressed:
            data["suppressed"] = suppressed
        self._record(kind, None, data)

    # -- handlers (kind -> handler in self._handlers) ----------------------------------------

    def _on_status_request(self, msg: protocol.Message) -> Reply:
        b: m.StatusRequest = msg.body
        limit = min(PAGE_NODES, max(1, given(b.limit, PAGE_NODES)))
        doc = self.status_document(select=given(b.nodes, SELECT_ALL),
                                   match=given(b.match, None), offset=given(b.offset, 0),
                                   limit=limit, max_bytes=PAGE_BYTES)
        return Reply("status_reply", {"doc": doc})

    def _on_events_request(self, msg: protocol.Message) -> Reply:
        events, more = self._events.page(given(msg.body.since, 0), EVENTS_REPLY_MAX,
                                         EVENTS_REPLY_BYTES)
        return Reply("events_reply", {"events": events, "more": more})

    def _on_hello(self, msg: protocol.Message) -> m.Ack:
        b: m.Hello = msg.body
        self._touch(b.node_id, b.host, b.pid)
        # A launcher given --coordinator has no rendezvous store to read this from; the
        # policy lets a launcher whose --on-hang/--on-slow differ say so (this one decides).
        if self._detection is None:
            return m.Ack(re=msg.id, detect="")
        policy = self._detection.config
        return m.Ack(re=msg.id, detect=self.detect_endpoint or "", on_hang=str(policy.on_hang),
                     on_slow=str(policy.on_slow), on_corruption=str(policy.on_corruption))

    def _on_heartbeat(self, msg: protocol.Message) -> Reply | None:
        out = self._heartbeat(msg.body, None)
        return Reply("directives", {"directives": out}) if out else None

    def _on_keepalive(self, msg: protocol.Message) -> Reply | None:
        out = self._keepalive(msg.body, None)
        return Reply("directives", {"directives": out}) if out else None

    def _on_aggregate(self, msg: protocol.Message) -> m.AggregateReply:
        """A group's reports, sent on by its aggregator (ftrun.coordinator.aggregation):
        each applied as if its launcher had sent it; the reply holds each one's directives."""
        b: m.Aggregate = msg.body
        out: list[m.MemberDirectives] = []
        now, mono = time.time(), time.monotonic()  # one arrival for the whole group
        for hb in b.heartbeats:
            directives = self._heartbeat(m.to_dict(hb), b.node_id, now, mono)
            if directives:
                out.append(m.MemberDirectives(node_id=hb.node_id, directives=directives))
        for ka in b.keepalives:
            directives = self._keepalive(ka, b.node_id, now, mono)
            if directives:
                out.append(m.MemberDirectives(node_id=ka.node_id, directives=directives))
        return m.AggregateReply(members=out)

    def _heartbeat(self, body: dict[str, Any], via: str | None, now: float | None = None,
                   mono: float | None = None) -> list[Any]:
        """Apply one full heartbeat (a plain body, directly or through aggregator ``via``)
        that arrived at ``now``/``mono`` (default: now); returns the directives for its
        node."""
        node, joined = self._membership.heartbeat(
            body, time.time() if now is None else now,
            time.monotonic() if mono is None else mono, via)
        if joined is not None:
            self._joined(node.node_id, joined)
        out = self._directives_for(node.node_id, body.get("acked"))
        plan = self._groups.tell(node.node_id, body.get("plan"))
        return [plan, *out] if plan is not None else out

    def _keepalive(self, b: m.Keepalive, via: str | None, now: float | None = None,
                   mono: float | None = None) -> list[Any]:
        """Apply one keep-alive (as :meth:`_heartbeat`); returns the directives for its node
        (a request for a full heartbeat first, when the coordinator does not hold its
        workers)."""
        node, joined, stale = self._membership.keepalive(
            b.node_id, b.same, time.time() if now is None else now,
            time.monotonic() if mono is None else mono, via)
        if joined is not None:
            self._joined(node.node_id, joined)
        out = self._directives_for(node.node_id, None if b.acked is UNSET else b.acked)
        plan = self._groups.tell(node.node_id, given(b.plan, None))
        if plan is not None:
            out = [plan, *out]
        if stale:
            # A keep-alive for workers this coordinator does not hold: ask for a full one.
            out = [{"id": protocol.new_id(), "action": REPORT_ACTION, "data": {}}, *out]
        return out

    def _on_event(self, msg: protocol.Message) -> None:
        b: m.Event = msg.body
        self._touch(b.node_id, None, None)
        self._record(b.type, b.node_id, b.data)
        if b.type in RESTART_EVENTS:
            self._early_until = time.monotonic() + self.node_timeout_s
        if b.type == "rendezvous_node_dropped" and isinstance(b.data, dict):
            lost = str(b.data.get("lost_node") or "")
            if self._membership.get(lost) is not None:
                self._membership.note_error(lost, f"lost: {b.data.get('reason')}; dropped from "
                                            f"rendezvous round {b.data.get('round')} by "
                                            f"{b.node_id}, before its keep-alives expired")
        if self._detection is not None and b.type in RESTART_EVENTS:
            self._detection.note_restart(b.node_id, b.type)

    def _on_bye(self, msg: protocol.Message) -> m.Ack:
        b: m.Bye = msg.body
        node, joined = self._membership.leave(b.node_id, b.state, b.exitcode, time.time(),
                                              time.monotonic())
        if joined is not None:
            self._joined(node.node_id, joined)
        # With what its store last reported of its ranks' snapshots over the job.
        left = {"state": b.state, "exitcode": b.exitcode,
                **self._snapshots.counts_of(node.node_id)}
        self._record("node_left", node.node_id, left)
        self._drop_directives(node.node_id, "node left")
        self._groups.forget(node.node_id)
        return m.Ack(re=msg.id)

    def _touch(self, node_id: str, host: str | None, pid: int | None) -> None:
        node, joined = self._membership.touch(node_id, host, pid, time.time(), time.monotonic())
        if joined is not None:
            self._joined(node_id, joined)

    def _joined(self, node_id: str, joined: dict[str, Any]) -> None:
        log.info("node %s joined (%s)", node_id, joined)
        self._record("node_joined", node_id, joined)

    # -- directives (ftrun.coordinator.directives) ---------------------------------------------

    def direct(self, node_id: str, action: str, data: dict[str, Any]) -> str:
        """Order ``node_id``'s launcher to carry out ``action`` (restart | isolate | probe)
        with ``data``; returns the directive id. It is sent in reply to each of the node's
        heartbeats until acked, and dropped when the node is gone or after 120 s."""
        if not self.acting():
            raise StaleTermError(f"cannot direct node {node_id!r}: the coordinator of term "
                                 f"{self.term} stepped down ({self.stepped_down})")
        node = self._membership.get(node_id)
        if node is None or node.left or node.lost:
            raise FtrunError(f"cannot direct node {node_id!r}: it is "
                             f"{'unknown' if node is None else 'gone'}; direct a live node")
        d = self._directives.issue(node_id, action, data, time.monotonic())
        log.info("directive %s to node %s: %s %s", d.id, node_id, action, data)
        self._record("directive", node_id, {"id": d.id, "action": action, "data": data})
        return d.id

    def pending_directives(self, node_id: str | None = None) -> list[dict[str, Any]]:
        """The directives not acked yet (of ``node_id``, or of every node)."""
        return self._directives.pending(node_id)

    def _directives_for(self, node_id: str, acked: list[str] | None) -> list[Any]:
        """The directives to send ``node_id`` in reply to its report acking ``acked``."""
        if not self._directives.any_for(node_id):
            return []
        now = time.monotonic()
        out, done, expired = self._directives.for_heartbeat(node_id, acked or (), now)
        for d in done:
            self._record("directive_acked", node_id,
                         {"id": d.id, "action": d.action, "after_s": round(now - d.issued_mono, 3),
                          "sent": d.sent})
        for d in expired:
            log.warning("directive %s (%s) to node %s expired unacknowledged after %.0f s",
                        d.id, d.action, node_id, now - d.issued_mono)
            self._record("directive_expired", node_id,
                         {"id": d.id, "action": d.action, "sent": d.sent})
        return out

    def _drop_directives(self, node_id: str, why: str) -> None:
        for d in self._directives.drop_node(node_id):
            self._record("directive_dropped", node_id,
                         {"id": d.id, "action": d.action, "sent": d.sent, "why": why})

    # -- snapshots (ftrun.coordinator.snapshots) ---------------------------------------------

    def wait_final_persists(self, timeout_s: float, start_grace_s: float,
                            exclude: str | None = None) -> list[str]:
        """Wait until every node whose store persists has written its final step, left, or
        gone silent; returns the nodes given up on (see SnapshotControl)."""
        return self._snapshots.wait_final_persists(timeout_s, start_grace_s, exclude)

    # -- events ------------------------------------------------------------------------------

    def record_event(self, type: str, node: str | None = None, **data: Any) -> dict[str, Any]:
        """Record an event from inside this process (thread-safe)."""
        return self._record(type, node, data)

    def _record(self, type_: str, node: str | None, data: dict[str, Any]) -> dict[str, Any]:
        if type_ in FLUSH_COMMITS_BEFORE:
            # The commits batched so far go first: the report's timeline places them before it.
            self._flush_commits()
        return self._events.record(type_, node, data)

    def _flush_commits(self) -> None:
        # A coordinator that stepped down records nothing but that (its successor learns the
        # commits from the stores again); the batch it held is not the log's any more.
        if self.stepped_down is None:
            self._snapshots.flush_commits()

    def events(self, since: int = 0) -> list[dict[str, Any]]:
        """Every event kept in memory with ``seq > since``, oldest first."""
        return self._events.since(since)

    # -- status ------------------------------------------------------------------------------

    def status_document(self, *, select: str = SELECT_ALL, match: str | None = None,
                        offset: int = 0, limit: int | None = None,
                        max_bytes: int | None = None) -> dict[str, Any]:
        """The versioned status document ``ftrun status`` shows (docs/status.md): the health
        and summary of the whole job, and one page of its nodes (here, by default, all)."""
        doc = self._status.document(self._membership.records(), self._membership.version,
                                    select=select, match=match, offset=offset, limit=limit,
                                    max_bytes=max_bytes)
        mono = time.monotonic()
        behind_s = max(0.0, mono - self._caught_up) if self._service is not None else 0.0
        doc["run_id"] = self.run_id
        doc["coordinator"] = {
            "endpoint": self.endpoint if self._bound_port is not None else None,
            "bind": self._bound_host,
            "pid": os.getpid(),
            "started_at": self._started_at,
            "expected_nodes": list(self._expected_nodes) if self._expected_nodes else None,
            # Seconds of messages queued unread; while > 0, nobody is declared lost.
            "behind_s": round(behind_s, 3) if behind_s > BEHIND_WARN_S else 0.0,
            "messages": dict(self.counters),
            "directives_pending": self._directives.count(),
            "aggregation": self._groups.summary(),
        }
        if self.term:
            doc["coordinator"]["term"] = self.term
            doc["coordinator"]["stepped_down"] = self.stepped_down
        doc["summary"]["events"] = self._events.count
        doc["events_tail"] = self._events.tail(EVENTS_TAIL)
        # How each launcher recovered (in place / new processes / fallback), phase by phase.
        doc["recoveries"] = self._events.recoveries()
        doc["snapshots"] = self._snapshots.summary()
        # The detection service's suspects, findings with their evidence, isolated hosts.
        if self._detection is not None:
            # Active suspects turn a healthy job degraded (ftrun.coordinator.status).
            with_detection(doc, self._detection.status())
        return doc


# -- the rendezvous store handshake -----------------------------------------------------------


def publish_endpoint(store: Any, endpoint: str, detect_endpoint: str | None = None) -> None:
    """Announce the coordinator endpoint in the job's rendezvous store, and where the ranks
    report their collectives (first: a launcher that finds the one finds the other)."""
    store.set(DETECT_KEY, (detect_endpoint or "").encode())
    store.set(ENDPOINT_KEY, endpoint.encode())


def lookup_detect_endpoint(store: Any) -> str:
    """The detection endpoint published beside the coordinator's ("" when the job has
    none). Call after :func:`lookup_endpoint`: it is published first."""
    try:
        if not store.check([DETECT_KEY]):
            return ""
        raw = store.get(DETECT_KEY)
    except Exception as e:  # noqa: BLE001 - torch raises several types
        log.warning("cannot read the detection endpoint from the rendezvous store (%s: %s); "
                    "this node's ranks will not report their collectives", type(e).__name__, e)
        return ""
    endpoint = raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)
    if endpoint:
        protocol.split_endpoint(endpoint)  # validate
    return endpoint


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


def _stop_on_signal(stop: threading.Event) -> SignalRelay:
    def on_signal(signum: int) -> None:
        log.info("coordinator got signal %s; stopping", signal.Signals(signum).name)
        stop.set()

    return SignalRelay(on_signal, signal.SIGTERM, signal.SIGINT).start()


def run_standalone(
    run_id: str,
    rdzv_endpoint: str,
    *,
    state_dir: str | None,
    node_timeout_s: float,
    bind_host: str | None = None,
    detection: Any = None,
) -> int:
    """Host the job's c10d rendezvous store and its coordinator until SIGTERM/SIGINT.

    Launchers started with ``--rdzv-endpoint`` pointing here find the coordinator through the
    store key :data:`ENDPOINT_KEY`. Returns the exit code (0 after a clean stop).
    """
    from ftrun import _torch  # lazily: torch is heavy

    host, port = protocol.split_endpoint(rdzv_endpoint)
    secret = jobs.load_secret(run_id, state_dir, create=True)
    try:
        # Where the coordinator listens (torch's own store would listen on every interface).
        store = _torch.bound_tcp_store(host, port, bind_host or default_bind_host(host), 30)
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError/DistNetworkError
        raise UnreachableError(
            f"cannot host the rendezvous store on {rdzv_endpoint}: {e}; is the port in use?"
        ) from e
    coordinator = Coordinator(
        run_id, secret, bind_host=bind_host, advertise_host=host,
        node_timeout_s=node_timeout_s, events_file=jobs.events_path(run_id, state_dir),
        detection=detection,
    )
    stop = threading.Event()
    relay = _stop_on_signal(stop)
    try:
        endpoint = coordinator.bind()
        publish_endpoint(store, endpoint, coordinator.detect_endpoint)
        path = jobs.write_job_file(jobs.JobFile(
            run_id=run_id, endpoint=endpoint, host=socket.gethostname(), pid=os.getpid(),
            started_at=time.time(), rdzv_endpoint=rdzv_endpoint,
        ), state_dir)
        log.info("job %s: rendezvous store on %s, coordinator on %s, job file %s", run_id,
                 rdzv_endpoint, endpoint, path)
        coordinator.serve_forever(stop)
    finally:
        coordinator.stop()
        relay.close()
        del store
    return 0
