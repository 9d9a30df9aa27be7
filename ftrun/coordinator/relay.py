"""The launcher's side of aggregation: an aggregator's relay, and the link a member reports on.

The coordinator decides who aggregates (:mod:`ftrun.coordinator.aggregation`); a launcher's
:class:`~ftrun.coordinator.client.NodeReporter` plays the part it is given with these two:

- :class:`GroupRelay`, in the aggregator: a socket of its own where its members send their
  heartbeats and keep-alives (each signed by its member and checked here), kept until the
  aggregator's next heartbeat, then sent on with the aggregator's own in one ``aggregate``
  message (split when large). The coordinator's reply holds each member's directives; a
  member gets its own in the relay's reply to its next report. A relay whose aggregates the
  coordinator has not answered for :data:`UPSTREAM_FACTOR` times the members' limit answers
  nobody: its members, who take an answer as
  the sign that their reports reach the coordinator, fall back to reporting directly.
- :class:`UpstreamLink`, in a member: whether its reports reach the coordinator through its
  aggregator. Each report is answered by the relay; when none is answered for
  :data:`SILENT_S` the member reports directly, and tries its aggregator again after
  :data:`RETRY_S` unless the coordinator named another meanwhile. Until an aggregator has
  answered once (a new one, or one tried again), the member's reports also go directly.

Both are used from the reporter's thread only.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

import msgspec
import zmq

from ftrun import protocol
from ftrun.coordinator import collsum
from ftrun.coordinator.api import Action
from ftrun.errors import ProtocolError
from ftrun.protocol import messages as m
from ftrun.protocol.messages import UNSET
from ftrun.protocol.transport import Client, Server

log = logging.getLogger(__name__)

# Reports unanswered this long (at least; see silent_after) mean the way through the
# aggregator is down; after a fall-back, the aggregator is tried again this much later.
SILENT_S = 2.0
SILENT_BEATS = 2.0
RETRY_S = 10.0
# Reports and summaries kept to be sent again when a restarted coordinator's detection
# service refuses them (its first ones, before this relay learnt its incarnation).
RESEND_KEPT = 64
# An aggregator whose aggregates the coordinator has not answered for this many times the
# members' limit stops answering them. Longer than theirs: a coordinator a few seconds behind
# its messages must not get every member's report directly on top.
UPSTREAM_FACTOR = 2.0
# An aggregate message holds at most about this much JSON (far below the coordinator's 1 MiB).
BATCH_BYTES = 512 * 1024
# What a heartbeat's size is reckoned at: this much, and this much per worker.
HEARTBEAT_BYTES, WORKER_BYTES = 600, 320
MAX_MESSAGES_PER_POLL = 256


def silent_after(interval_s: float) -> float:
    """Seconds without an answer after which a way up is taken as down."""
    return max(SILENT_S, SILENT_BEATS * interval_s)


def local_address(peer: str) -> str:
    """The address of this host on the interface that reaches ``peer`` (``host:port``): what
    an aggregator binds when its launcher names no interface."""
    host, port = protocol.split_endpoint(peer)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))  # no packet is sent: this only picks the route
        return str(s.getsockname()[0])


class GroupRelay:
    """An aggregator's relay: takes its members' reports, sends them on together."""

    def __init__(self, secret: bytes, job: str, node_id: str, host: str,
                 context: zmq.Context[Any], interval_s: float,
                 on_summary: Any = None) -> None:
        self.node_id = node_id
        self._on_summary_fn = on_summary  # (body dict, now): a member's collective summary
        self._server = Server("aggregator", secret, job,
                              {"heartbeat": self._on_heartbeat, "keepalive": self._on_keepalive,
                               "coll_summary": self._on_summary},
                              sender=node_id, typed=True)
        self.address = self._server.bind_tcp(host, context)
        self._silent_s = UPSTREAM_FACTOR * silent_after(interval_s)
        self._heartbeats: dict[str, m.Heartbeat] = {}
        self._keepalives: dict[str, m.Keepalive] = {}
        # member -> its directives (by id) to hand on in the reply to its next report
        self._held: dict[str, dict[str, Any]] = {}
        self._unanswered_since: float | None = None  # first aggregate sent since a reply
        self.counters = {"member_reports": 0, "aggregates": 0, "unanswered": 0}
        log.info("aggregating this node's group on %s", self.address)

    def close(self) -> None:
        self._server.close()

    # -- members' reports ---------------------------------------------------------------------

    def serve(self) -> int:
        """Take the members' reports that arrived (never waits)."""
        return self._server.serve_once(0.0, MAX_MESSAGES_PER_POLL)

    def upstream_ok(self, now: float) -> bool:
        """Whether the coordinator answered this relay's aggregates lately."""
        return self._unanswered_since is None or now - self._unanswered_since < self._silent_s

    def _answer(self, node_id: str) -> m.Directives | None:
        self.counters["member_reports"] += 1
        if not self.upstream_ok(time.monotonic()):
            self.counters["unanswered"] += 1
            return None  # the member falls back to reporting directly
        held = list(self._held.pop(node_id, {}).values())
        for d in held:
            if d["action"] not in (Action.AGGREGATE, Action.REPORT):
                log.info("directive %s (%s) handed on to %s", d["id"], d["action"], node_id)
        return m.Directives(directives=held)

    def _on_summary(self, msg: protocol.Message) -> None:
        if self._on_summary_fn is not None:
            self._on_summary_fn(msgspec.to_builtins(msg.body), time.monotonic())

    def _on_heartbeat(self, msg: protocol.Message) -> m.Directives | None:
        b: m.Heartbeat = msg.body
        self._heartbeats[b.node_id] = b
        self._keepalives.pop(b.node_id, None)
        return self._answer(b.node_id)

    def _on_keepalive(self, msg: protocol.Message) -> m.Directives | None:
        b: m.Keepalive = msg.body
        pending = self._heartbeats.get(b.node_id)
        if pending is None:
            self._keepalives[b.node_id] = b
        elif b.acked is not UNSET:
            # A full heartbeat of it still waits to go on: it goes, with these acks.
            self._heartbeats[b.node_id] = msgspec.structs.replace(pending, acked=b.acked)
        return self._answer(b.node_id)

    # -- sending on ---------------------------------------------------------------------------

    def add_own(self, kind: str, body: dict[str, Any]) -> None:
        """The aggregator's own report (checked here: ProtocolError when invalid)."""
        try:
            if kind == "heartbeat":
                self._heartbeats[self.node_id] = msgspec.convert(body, m.Heartbeat)
                self._keepalives.pop(self.node_id, None)
            else:
                self._keepalives[self.node_id] = msgspec.convert(body, m.Keepalive)
        except msgspec.ValidationError as e:
            raise ProtocolError(f"{kind} body: {e}") from e

    def batches(self) -> list[m.Aggregate]:
        """What waits, as ``aggregate`` bodies of at most about :data:`BATCH_BYTES` each;
        the relay is empty afterwards."""
        out: list[m.Aggregate] = []
        hbs: list[m.Heartbeat] = []
        kas: list[m.Keepalive] = []
        size = 0
        items = [*self._heartbeats.values(), *self._keepalives.values()]
        for item in items:
            cost = (HEARTBEAT_BYTES + WORKER_BYTES * len(item.workers)
                    if isinstance(item, m.Heartbeat) else 150)
            if (size + cost > BATCH_BYTES or len(hbs) + len(kas) >= protocol.MAX_LIST_ITEMS) \
                    and (hbs or kas):
                out.append(m.Aggregate(node_id=self.node_id, heartbeats=hbs, keepalives=kas))
                hbs, kas, size = [], [], 0
            (hbs if isinstance(item, m.Heartbeat) else kas).append(item)  # type: ignore[arg-type]
            size += cost
        if hbs or kas:
            out.append(m.Aggregate(node_id=self.node_id, heartbeats=hbs, keepalives=kas))
        self._heartbeats.clear()
        self._keepalives.clear()
        return out

    def sent(self, now: float) -> None:
        """An aggregate went to the coordinator at ``now``."""
        self.counters["aggregates"] += 1
        if self._unanswered_since is None:
            self._unanswered_since = now

    def deliver(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The coordinator's ``aggregate_reply``: members' directives are held for them;
        returns the aggregator's own."""
        self._unanswered_since = None
        own: list[dict[str, Any]] = []
        for entry in body["members"]:
            if entry["node_id"] == self.node_id:
                own += entry["directives"]
                continue
            held = self._held.setdefault(entry["node_id"], {})
            for d in entry["directives"]:
                held[d["id"]] = d
        return own


class UpstreamLink:
    """A member's way to the coordinator through its aggregator at ``addr``."""

    def __init__(self, via: str, addr: str, secret: bytes, job: str, node_id: str,
                 context: zmq.Context[Any], interval_s: float, on_reply: Any) -> None:
        self.via, self.addr = via, addr
        self._silent_s = silent_after(interval_s)

        def answered(msg: protocol.Message) -> None:
            self._unanswered_since = None
            self.confirmed = True
            on_reply(msg)

        self._client = Client(addr, secret, job, node_id, peer=f"aggregator {via}",
                              on_reply=answered, send_timeout_s=0.0, sndhwm=4,
                              reconnect_s=(0.2, 2.0), context=context)
        self._unanswered_since: float | None = None
        self.down_until = 0.0  # reporting directly until then
        # Whether the aggregator answered since this link was (re)opened: until it does, the
        # member's reports go to the coordinator directly as well (a new aggregator, or one
        # tried again after a fall-back, may be dead: no gap in what the coordinator hears).
        self.confirmed = False
        self._created = time.monotonic()
        self._client.poll(0.0)  # connect now: the first report finds the connection made

    def close(self) -> None:
        self._client.close()

    def usable(self, now: float) -> bool:
        return now >= self.down_until

    def poll(self) -> None:
        self._client.poll(0.0)

    def send(self, kind: str, body: dict[str, Any], now: float) -> bool:
        """Send a report through the aggregator; False when the way is down (it is then
        not tried again for :data:`RETRY_S`), and the caller reports directly."""
        if self._unanswered_since is not None and now - self._unanswered_since > self._silent_s:
            log.warning("aggregator %s (%s) has not answered for %.1f s: reporting to the "
                        "coordinator directly", self.via, self.addr, now - self._unanswered_since)
            self._fall_back(now)
            return False
        if self._client.send(kind, body) is None:
            if now - self._created < self._silent_s:
                return False  # still connecting: this one goes directly
            log.warning("aggregator %s (%s) takes no reports: reporting to the coordinator "
                        "directly", self.via, self.addr)
            self._fall_back(now)
            return False
        if self._unanswered_since is None:
            self._unanswered_since = now
        return True

    def forward(self, kind: str, body: Any) -> bool:
        """Send a message that the aggregator does not answer (a collective summary); False
        when it could not be queued."""
        return self._client.send(kind, body) is not None

    def _fall_back(self, now: float) -> None:
        self.down_until = now + RETRY_S
        self._unanswered_since = None
        self.confirmed = False
        self._client.close()  # a fresh connection when tried again


class CollRelay:
    """A launcher's relay for its ranks' collective reports (``FTRUN_DETECT`` points the
    ranks here; see :mod:`ftrun.coordinator.collsum`).

    Below ``summary_ranks`` ranks in the world, each report goes on to the detection service
    as it came. From there on, the launcher sends a summary of its ranks' reports instead
    (every second; four times a second while a rank waits long or falls silent): to its
    group's aggregator when it has one that answers, else to the detection service; an
    aggregator merges its members' summaries (held in :meth:`add_member_summary`) with its
    own into one. Used from the node reporter's thread only; never blocks (a send that
    cannot be queued is dropped and counted)."""

    def __init__(self, secret: bytes, job: str, node_id: str, context: zmq.Context[Any],
                 summary_ranks: int) -> None:
        self.node_id = node_id
        self._secret, self._job, self._ctx = secret, job, context
        self._server = Server("collective relay", secret, job,
                              {"coll_report": self._on_report}, sender=node_id)
        self.address = self._server.bind_tcp("127.0.0.1", context)
        self._collector = collsum.Collector(node_id)
        self.summary_ranks = summary_ranks
        self._world_size = 0
        self._pending: list[dict[str, Any]] = []  # reports to pass on as they came
        # Aggregator: each member's latest summary: (received at, body, not yet sent on).
        self._members: dict[str, tuple[float, dict[str, Any], bool]] = {}
        self._detect: Client | None = None
        self.detect_endpoint = ""
        self._last_summary = float("-inf")
        self._seq = 0
        self.counters = {"reports": 0, "forwarded": 0, "summaries": 0, "via_aggregator": 0,
                         "member_summaries": 0, "dropped": 0}

    def close(self) -> None:
        self._server.close()
        if self._detect is not None:
            self._detect.close()

    @property
    def summarising(self) -> bool:
        return self._world_size >= self.summary_ranks

    def set_detect(self, endpoint: str) -> None:
        """Pass reports and summaries on to the detection service at ``endpoint``."""
        if not endpoint or endpoint == self.detect_endpoint:
            return
        if self._detect is not None:
            self._detect.close()
        self.detect_endpoint = endpoint
        self._detect = Client(endpoint, self._secret, self._job, self.node_id,
                              peer="coordinator's detection endpoint", send_timeout_s=0.0,
                              sndhwm=256, context=self._ctx, follow_on_send=True,
                              resend_stale=RESEND_KEPT)

    def _on_report(self, msg: protocol.Message) -> None:
        body = msg.body
        self.counters["reports"] += 1
        self._world_size = int(body.get("world_size", 0))  # the newest world's
        self._collector.add_report(body, time.monotonic())
        if not self.summarising:
            self._pending.append(body)

    def add_member_summary(self, body: dict[str, Any], now: float) -> None:
        """A member launcher's summary (this launcher aggregates its group)."""
        self.counters["member_summaries"] += 1
        self._members[str(body["node_id"])] = (now, body, True)

    def _to_detect(self, kind: str, body: Any) -> None:
        if self._detect is None or self._detect.send(kind, body) is None:
            self.counters["dropped"] += 1
        else:
            self.counters["forwarded" if kind == "coll_report" else "summaries"] += 1

    def pump(self, now: float, aggregating: bool, upstream: UpstreamLink | None) -> None:
        """Take the ranks' reports and pass on what is due (the reporter's every turn)."""
        self._server.serve_once(0.0, MAX_MESSAGES_PER_POLL)
        if not self.summarising:
            pending, self._pending = self._pending, []
            for body in pending:
                self._to_detect("coll_report", body)
            self._members.clear()
            return
        self._pending.clear()
        since = now - self._last_summary
        if since < collsum.SUMMARY_S:
            return
        if since < collsum.QUIET_SUMMARY_S and not self._collector.urgent(now) and not (
                aggregating and any(fresh and collsum.urgent(body)
                                    for _, body, fresh in self._members.values())):
            return
        self._last_summary = now
        own = self._collector.summary(now)
        if aggregating:
            parts = [own] if own is not None else []
            for node, (at, body, fresh) in list(self._members.items()):
                if now - at > collsum.STALE_S:
                    del self._members[node]  # gone quiet: its ranks' silence shows
                    continue
                # Its latest until stale, but it speaks for its launcher (``nodes``: seen
                # now) only when it came since the last summary.
                part = collsum.age(body, now - at)
                parts.append(part if fresh else {**part, "nodes": []})
                self._members[node] = (at, body, False)
            self._seq += 1
            merged = collsum.merge(self.node_id, self._seq, parts)
            if merged is not None:
                self._to_detect("coll_summary", merged)
            return
        if own is None:
            return
        if upstream is not None and upstream.confirmed and upstream.usable(now) \
                and upstream.forward("coll_summary", own):
            self.counters["via_aggregator"] += 1
            return
        self._to_detect("coll_summary", own)
