"""Clients of the coordinator: one-shot requests (``ftrun status``) and the node reporter.

:func:`request` sends one request over a fresh connection. :class:`NodeReporter` is what each
node launcher runs: a thread that owns one connection, says ``hello``, sends a ``heartbeat``
every interval, forwards events in order and finally says ``bye``. The coordinator's replies
to heartbeats carry its directives (:mod:`ftrun.coordinator.directives`): the reporter hands
each new one to ``on_directive`` once and acks its id in the following heartbeats. It never blocks its
caller: when the coordinator is down or restarting, ZeroMQ reconnects in the background,
heartbeats are dropped rather than queued without bound, and events wait in a bounded queue.
Both speak through :class:`ftrun.protocol.transport.Client`.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from ftrun import protocol
from ftrun.coordinator.api import Action
from ftrun.coordinator.directives import REPORT_ACTION
from ftrun.coordinator.relay import CollRelay, GroupRelay, UpstreamLink, local_address
from ftrun.errors import AuthError, ConfigError, ProtocolError
from ftrun.protocol import messages as m
from ftrun.protocol.transport import Client

log = logging.getLogger(__name__)

MAX_PENDING_EVENTS = 10_000
# Directive ids remembered (never delivered twice), and heartbeats that ack each one.
ACKED_KEPT = 256
ACK_HEARTBEATS = 10
REPORTER_POLL_S = 0.02
# ZeroMQ's reconnect interval to a coordinator that went away: first, and at most.
RECONNECT_S = (0.2, 2.0)
AUTH_WARN_EVERY_S = 30.0
HINT = ("is the job running? (check the endpoint, firewalls, and that the job's launchers "
        "are alive)")


def _summary_ranks() -> int:
    """``FTRUN_COLL_SUMMARY_RANKS``: the world size from which collective reports go on
    summarised (ftrun.coordinator.collsum)."""
    from ftrun import knobs

    raw = knobs.COLL_SUMMARY_RANKS.get()
    value = knobs.whole_number(raw)
    if value is None:
        raise ConfigError(f"{knobs.COLL_SUMMARY_RANKS.name}={raw!r} is not a world size: give "
                          "a whole number of ranks >= 0 (0: always summarise; default "
                          f"{knobs.COLL_SUMMARY_RANKS.default})")
    return value


def coordinator_client(endpoint: str, secret: bytes, job: str, sender: str, *,
                       sndhwm: int = 16, context: zmq.Context[Any] | None = None,
                       on_reply: Callable[[protocol.Message], None] | None = None,
                       term: int = 0) -> Client:
    """A client of the coordinator at ``endpoint`` (``host:port``), of coordinator ``term``
    (0: a coordinator that does not fail over)."""
    protocol.split_endpoint(endpoint)  # fail early on a malformed endpoint
    return Client(endpoint, secret, job, sender, peer="coordinator", hint=HINT,
                  on_reply=on_reply, send_timeout_s=0.0, sndhwm=sndhwm,
                  reconnect_s=RECONNECT_S, max_frame_bytes=protocol.MAX_MESSAGE_BYTES,
                  context=context, term=term, resend_stale=True)


def request(
    endpoint: str,
    secret: bytes,
    job: str,
    kind: str,
    body: dict[str, Any],
    *,
    timeout_s: float = 5.0,
    sender: str = "cli",
) -> protocol.Message:
    """Send one request to the coordinator and return its authenticated reply.

    Raises UnreachableError on timeout, AuthError when the coordinator refuses our secret or
    its reply is not signed with it, and the FtrunError named by an ``error`` reply.
    """
    client = coordinator_client(endpoint, secret, job, sender)
    try:
        return client.request(kind, body, None, timeout_s)
    finally:
        client.close()


# A launcher sends its workers at least this often even when nothing about them changed (their
# step and progress age move on), and a keep-alive otherwise (ftrun.coordinator.membership).
FULL_EVERY_S = 30.0
# Worker fields that change without anything happening: a change in them alone does not make a
# heartbeat full.
VOLATILE_WORKER_FIELDS = frozenset({"step", "progress_age_s", "step_interval_s"})

_HEARTBEAT_DEFAULTS: dict[str, Any] = {
    "state": "init",
    "group_rank": None,
    "group_world_size": None,
    "restarts": 0,
    "max_restarts": 0,
    "workers": [],
    "last_error": None,
}


class HeartbeatComposer:
    """Builds one node's heartbeats: full when its state changed, else keep-alives.

    A full heartbeat carries ``serial`` (counting up); a keep-alive (kind ``keepalive``, a
    few dozen bytes) carries ``same`` = the serial of the last full one. A full one goes out when
    anything but the volatile worker fields changed, every :data:`FULL_EVERY_S`, after a send
    failed, and when the coordinator asks (:meth:`want_full`).
    """

    def __init__(self, node_id: str, host: str, pid: int,
                 full_every_s: float = FULL_EVERY_S) -> None:
        self.node_id, self.host, self.pid = node_id, host, pid
        self.full_every_s = full_every_s
        self.serial = 0
        self._last_sig: Any = None
        self._last_full = float("-inf")
        self.full = 0  # full heartbeats composed
        self.keepalives = 0

    def want_full(self) -> None:
        """The next heartbeat is a full one (the coordinator asked, or a send failed)."""
        self._last_sig = None

    @staticmethod
    def _signature(body: dict[str, Any]) -> Any:
        workers = tuple(tuple(sorted((k, repr(v)) for k, v in w.items()
                                     if k not in VOLATILE_WORKER_FIELDS))
                        for w in body.get("workers") or ())
        top = tuple(sorted((k, repr(v)) for k, v in body.items() if k != "workers"))
        return top, workers

    def compose(self, state: dict[str, Any], now: float,
                acked: list[str] | None = None) -> tuple[str, dict[str, Any]]:
        """The message (``heartbeat`` or ``keepalive``, and its body) for ``state`` (the
        launcher's fields) at ``now`` (monotonic)."""
        body = {**_HEARTBEAT_DEFAULTS, **state}
        body.update(node_id=self.node_id, host=self.host, pid=self.pid)
        error = body.get("last_error")
        if isinstance(error, str) and len(error) > protocol.MAX_STRING_CHARS:
            body["last_error"] = "..." + error[-(protocol.MAX_STRING_CHARS - 3):]
        sig = self._signature(body)
        if sig != self._last_sig or now - self._last_full >= self.full_every_s:
            self._last_sig, self._last_full = sig, now
            self.serial += 1
            self.full += 1
            body["serial"] = self.serial
            kind = "heartbeat"
        else:
            self.keepalives += 1
            body = {"node_id": self.node_id, "same": self.serial}
            kind = "keepalive"
        if acked:
            body["acked"] = acked
        return kind, body


def policy_mismatch(answer: dict[str, Any], on_hang: str, on_slow: str,
                    on_corruption: str = "restart") -> str | None:
    """What a launcher says when its own ``--on-hang``/``--on-slow``/``--on-corruption``
    differ from the policy in the coordinator's answer to its hello: the coordinator decides for the whole job, so
    a launcher's differing flag would otherwise be ignored without a word. None when they
    agree, or when the coordinator runs no detection (no policy in its answer)."""
    diffs = [f"--{flag} {own} here, {theirs} at the coordinator"
             for flag, own, theirs in (("on-hang", on_hang, answer.get("on_hang")),
                                       ("on-slow", on_slow, answer.get("on_slow")),
                                       ("on-corruption", on_corruption,
                                        answer.get("on_corruption")))
             if theirs and str(theirs) != str(own)]
    if not diffs:
        return None
    return (f"this launcher's detection policy differs from the job coordinator's "
            f"({'; '.join(diffs)}): the coordinator decides for every node, so its policy "
            "applies; give the launcher that hosts the coordinator (or `ftrun coordinator`) "
            "the flags you want, or drop them here")


class NodeReporter:
    """Reports one node launcher's state to the coordinator from a background thread.

    ``state_fn`` returns the heartbeat fields (``state``, ``group_rank``,
    ``group_world_size``, ``restarts``, ``max_restarts``, ``workers``, ``last_error`` and
    optionally ``extra``); missing ones get defaults, ``node_id``/``host``/``pid`` are added.

    ``on_directive`` is called from the reporter thread with each new directive
    (``{"id", "action", "data"}``), once per id even when the coordinator sends it again; it
    must return quickly (queue the work). Its id is acked in the next
    :data:`ACK_HEARTBEATS` heartbeats, and again whenever the coordinator resends it.

    ``on_hello`` is called from the reporter thread with the coordinator's answer to
    ``hello`` (``{"re", "detect", "on_hang", "on_slow"}``); :meth:`wait_hello` waits for it.

    ``term`` is the coordinator's term (``--rdzv-backend etcd``; 0: none). When the
    coordinator fails over, :meth:`retarget` moves the reporter to the new one: it says
    ``hello`` there and sends a full heartbeat at once (the new coordinator rebuilds the
    job's membership from them); replies of the old term, directives above all, are
    dropped from then on.

    **Aggregation** (:mod:`ftrun.coordinator.aggregation`). The coordinator may tell the
    reporter (an ``aggregate`` directive) to aggregate its group, or to send its heartbeats
    and keep-alives through another launcher; hello, events and bye always go directly.
    As an aggregator it runs a :class:`~ftrun.coordinator.relay.GroupRelay` on the interface
    of its probe service (``probe_addr`` in the state; else the one that reaches the
    coordinator) and names it in its heartbeats (``aggr_addr``); as a member it reports
    through an :class:`~ftrun.coordinator.relay.UpstreamLink`, and directly whenever that
    link is down. Every report names the plan it follows (``plan``).
    """

    def __init__(
        self,
        endpoint: str,
        secret: bytes,
        job: str,
        node_id: str,
        host: str,
        state_fn: Callable[[], dict[str, Any]],
        interval_s: float = 1.0,
        on_directive: Callable[[dict[str, Any]], None] | None = None,
        on_hello: Callable[[dict[str, Any]], None] | None = None,
        term: int = 0,
        coll_summary_ranks: int | None = None,
    ) -> None:
        protocol.split_endpoint(endpoint)  # fail early on a malformed endpoint
        self.endpoint = endpoint
        self.term = term
        self._moved: tuple[str, int] | None = None  # (endpoint, term) to move to
        self._moved_lock = threading.Lock()
        self._secret = secret
        self.job = job
        self.node_id = node_id
        self.host = host
        self._state_fn = state_fn
        self.interval_s = interval_s
        self._queue: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_warn: dict[str, float] = {}
        self._bye_deadline = float("inf")
        self._on_directive = on_directive
        self._on_hello = on_hello
        self._hello_answered = threading.Event()
        self._composer = HeartbeatComposer(node_id, host, os.getpid())
        # id -> heartbeats that still ack it; insertion order is delivery order.
        self._acks: dict[str, int] = {}
        self.sent = {"hello": 0, "heartbeat": 0, "event": 0, "bye": 0, "dropped": 0,
                     "via_aggregator": 0, "aggregate": 0}
        self.directives = 0  # directives delivered to on_directive
        # The aggregation plan followed (0: none told: report directly), and the part it
        # gives this launcher: an aggregator's relay, or a member's link (reporter thread).
        self.plan = 0
        self._plan_next: dict[str, Any] | None = None  # told, not yet taken up
        self.relay: GroupRelay | None = None
        self.upstream: UpstreamLink | None = None
        self._ctx: zmq.Context[Any] | None = None
        self._bind_host: str | None = None
        # The relay of this node's ranks' collective reports (ftrun.coordinator.collsum),
        # made by the reporter thread as it starts: ``coll_ready`` is set once it is made
        # (``coll`` stays None when it could not listen).
        if coll_summary_ranks is None:
            coll_summary_ranks = _summary_ranks()
        self._coll_summary_ranks = coll_summary_ranks
        self.coll: CollRelay | None = None
        self.coll_ready = threading.Event()

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._run, name=f"ftrun-reporter-{self.node_id}", daemon=True
        )
        self._thread.start()

    def retarget(self, endpoint: str, term: int) -> None:
        """Report to the coordinator at ``endpoint`` of ``term`` from now on (thread-safe;
        the reporter thread moves at its next turn)."""
        protocol.split_endpoint(endpoint)
        with self._moved_lock:
            self._moved = (endpoint, term)

    def wait_hello(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the coordinator's answer to ``hello``."""
        return self._hello_answered.wait(timeout_s)

    def event(self, type: str, **data: Any) -> None:
        """Queue an event for the coordinator (thread-safe, never blocks)."""
        self._queue.put(("event", {"node_id": self.node_id, "type": type, "data": data}))

    def stop(self, final_state: str, exitcode: int, timeout_s: float = 2.0) -> None:
        """Flush queued events, send ``bye`` and wait (bounded) for its acknowledgement."""
        self._bye_deadline = time.monotonic() + timeout_s
        self._queue.put(("bye", {"node_id": self.node_id, "state": final_state,
                                 "exitcode": int(exitcode)}))
        self._stop.set()
        thread = self._thread
        if thread is None:
            return
        thread.join(timeout_s + 0.5)
        if thread.is_alive():
            log.warning("node reporter did not finish within %.1f s", timeout_s)
        self._thread = None

    # -- the reporter thread -----------------------------------------------------------------

    def _warn(self, key: str, every_s: float, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last_warn.get(key, float("-inf")) >= every_s:
            self._last_warn[key] = now
            log.warning(msg, *args)

    def _run(self) -> None:
        ctx: zmq.Context[Any] = zmq.Context()
        self._ctx = ctx
        try:
            self.coll = CollRelay(self._secret, self.job, self.node_id, ctx,
                                  self._coll_summary_ranks)
        except zmq.ZMQError as e:
            log.error("cannot listen for this node's ranks' collective reports (%s): they "
                      "report to the coordinator directly", e)
        self.coll_ready.set()
        acked: set[str] = set()
        client = coordinator_client(self.endpoint, self._secret, self.job, self.node_id,
                                    sndhwm=100, context=ctx,
                                    on_reply=lambda msg: self._on_reply(msg, acked),
                                    term=self.term)
        pending: deque[tuple[str, dict[str, Any]]] = deque()
        pending.append(("hello", {"node_id": self.node_id, "host": self.host,
                                  "pid": os.getpid()}))
        seen_term = client.term
        next_hb = time.monotonic()
        bye_id: str | None = None
        try:
            while True:
                try:
                    if self._move(client, pending):
                        next_hb = time.monotonic()
                    self._take_plan()
                    self._serve_group()
                    self._pump_coll()
                    self._drain_queue(pending)
                    bye_id = self._flush(client, pending) or bye_id
                    if not self._stop.is_set() and time.monotonic() >= next_hb:
                        next_hb = time.monotonic() + self.interval_s
                        self._heartbeat(client)
                    try:
                        client.poll(REPORTER_POLL_S)
                    except AuthError as e:
                        self._warn("auth", AUTH_WARN_EVERY_S, "%s", e)
                        time.sleep(REPORTER_POLL_S)
                    if client.term != seen_term:
                        # The coordinator restarted (a new incarnation refused a message of
                        # the old one, and the client follows it): it knows nothing of us.
                        if seen_term:
                            log.warning("the coordinator at %s restarted; saying hello again",
                                        self.endpoint)
                        seen_term = client.term
                        self._start_over(pending)
                        next_hb = time.monotonic()
                    if bye_id is not None and bye_id in acked:
                        break
                    if self._stop.is_set() and time.monotonic() >= self._bye_deadline:
                        log.debug("bye to %s not acknowledged in time", self.endpoint)
                        break
                except Exception:  # noqa: BLE001 - the reporter must survive anything
                    log.exception("node reporter loop error; continuing")
                    time.sleep(REPORTER_POLL_S)
        finally:
            self._set_part(None, None)
            if self.coll is not None:
                self.coll.close()
            client.close()
            ctx.term()

    def _move(self, client: Client, pending: deque[tuple[str, dict[str, Any]]]) -> bool:
        """Move to the coordinator :meth:`retarget` named, if any: hello first, then a full
        heartbeat at once. Returns whether it moved."""
        with self._moved_lock:
            moved, self._moved = self._moved, None
        if moved is None or moved == (self.endpoint, self.term):
            return False
        self.endpoint, self.term = moved
        client.retarget(*moved)
        self._start_over(pending)
        return True

    def _start_over(self, pending: deque[tuple[str, dict[str, Any]]]) -> None:
        """A new coordinator (failover, or a restart): hello first, then a full heartbeat."""
        # The directives seen so far are not acked to the new coordinator, but stay known:
        # one the same coordinator sends again (a start-over as its term is first learned,
        # or a retarget to where it already was) must not run twice (seen in CI, loaded:
        # a probe and an isolate each delivered twice).
        for i in self._acks:
            self._acks[i] = 0
        self._set_part(None, None)  # the new coordinator plans the groups again
        self.plan, self._plan_next = 0, None
        if not pending or pending[0][0] != "hello":
            pending.appendleft(("hello", {"node_id": self.node_id, "host": self.host,
                                          "pid": os.getpid()}))
        self._composer.want_full()

    def _on_reply(self, msg: protocol.Message, acked: set[str]) -> None:
        if msg.kind == "ack" and msg.re is not None:
            acked.add(msg.re)
            if msg.body.get("detect") and self.coll is not None:
                # Every hello's answer (a new coordinator's too) says where reports go.
                self.coll.set_detect(str(msg.body["detect"]))
            if "detect" in msg.body and not self._hello_answered.is_set():
                if self._on_hello is not None:
                    try:
                        self._on_hello(dict(msg.body))
                    except Exception:  # noqa: BLE001 - a failing callback must not stop us
                        log.exception("handling the coordinator's answer to hello failed")
                self._hello_answered.set()
        elif msg.kind == "directives":
            self._directives(msg.body["directives"])
        elif msg.kind == "aggregate_reply" and self.relay is not None:
            self._directives(self.relay.deliver(msg.body))

    def _directives(self, directives: list[dict[str, Any]]) -> None:
        for d in directives:
            if d["action"] == REPORT_ACTION:
                self._composer.want_full()
            elif d["action"] == Action.AGGREGATE:
                self._plan_next = dict(d["data"])
            else:
                self._directive(d)

    # -- aggregation ----------------------------------------------------------------------------

    def _take_plan(self) -> None:
        """Take up the plan the coordinator told (see the class docstring)."""
        told, self._plan_next = self._plan_next, None
        if told is None or int(told["plan"]) == self.plan:
            return
        self.plan = int(told["plan"])
        via, addr = str(told.get("via") or ""), str(told.get("addr") or "")
        log.info("aggregation plan %d: %s", self.plan,
                 "this launcher aggregates its group" if via == self.node_id else
                 f"reporting through {via} ({addr})" if via and addr else "reporting directly")
        self._set_part(via, addr)

    def _set_part(self, via: str | None, addr: str | None) -> None:
        """Become the aggregator (``via`` is this node), a member reporting through ``via``
        at ``addr``, or neither."""
        if via == self.node_id:
            if self.upstream is not None:
                self.upstream.close()
                self.upstream = None
            if self.relay is None and self._ctx is not None:
                host = self._bind_host or local_address(self.endpoint)
                try:
                    self.relay = GroupRelay(
                        self._secret, self.job, self.node_id, host, self._ctx,
                        self.interval_s, on_summary=(self.coll.add_member_summary
                                                     if self.coll is not None else None))
                except zmq.ZMQError as e:
                    log.error("cannot listen for this group's reports on %s (%s): reporting "
                              "directly", host, e)
            return
        if self.relay is not None:
            self.relay.close()
            self.relay = None
            self._composer.want_full()  # aggr_addr is gone from the heartbeat
        if self.upstream is not None and (self.upstream.via, self.upstream.addr) != (via, addr):
            self.upstream.close()
            self.upstream = None
        if via and addr and self.upstream is None and self._ctx is not None:
            self.upstream = UpstreamLink(via, addr, self._secret, self.job, self.node_id,
                                         self._ctx, self.interval_s, self._on_member_reply)
            self._composer.want_full()  # the aggregator starts from a full heartbeat

    def _on_member_reply(self, msg: protocol.Message) -> None:
        if msg.kind == "directives":
            self._directives(msg.body["directives"])

    def _serve_group(self) -> None:
        """Take the members' reports (aggregator), read the aggregator's answers (member);
        a failure here is logged and never stops the node's own heartbeats."""
        try:
            if self.relay is not None:
                self.relay.serve()
            if self.upstream is not None:
                self.upstream.poll()
        except Exception as e:  # noqa: BLE001 - the reporter's own beats come first
            self._warn("group", 10.0, "aggregation: %s: %s", type(e).__name__, e)

    def _pump_coll(self) -> None:
        """Pass this node's ranks' collective reports on (as they came, or summarised);
        a failure here is logged and never stops the node's own heartbeats."""
        if self.coll is None:
            return
        try:
            self.coll.pump(time.monotonic(), self.relay is not None, self.upstream)
        except Exception as e:  # noqa: BLE001 - the reporter's own beats come first
            self._warn("coll", 10.0, "collective reports: %s: %s", type(e).__name__, e)

    def _send_report(self, client: Client, kind: str, body: dict[str, Any]) -> str | None:
        """Send one heartbeat or keep-alive the way the plan says; the message id (or
        "relayed"), or None when it could not be sent."""
        now = time.monotonic()
        if self.plan:
            body["plan"] = self.plan
        relay = self.relay
        if relay is not None:
            # While the coordinator does not answer the relay, its own report goes directly
            # too, and what it sends on (members' reports, or nothing) asks whether it
            # answers again.
            ok = relay.upstream_ok(now)
            if ok:
                relay.add_own(kind, body)
            sent: str | None = None
            for batch in relay.batches() or [m.Aggregate(node_id=self.node_id, heartbeats=[],
                                                         keepalives=[])]:
                sent = client.send("aggregate", batch)
                if sent is None:
                    break
                relay.sent(now)
                self.sent["aggregate"] += 1
            if ok:
                return sent
        link = self.upstream
        if link is not None and link.usable(now) and link.send(kind, body, now):
            self.sent["via_aggregator"] += 1
            if link.confirmed:
                return "relayed"
        return client.send(kind, body)

    def _directive(self, d: dict[str, Any]) -> None:
        """Deliver a directive once; (re)start acking it either way (the coordinator sent it
        again: our acks did not reach it yet)."""
        new = d["id"] not in self._acks
        self._acks.pop(d["id"], None)
        self._acks[d["id"]] = ACK_HEARTBEATS
        while len(self._acks) > ACKED_KEPT:
            del self._acks[next(iter(self._acks))]
        if not new:
            return
        self.directives += 1
        log.info("directive %s from the coordinator: %s %s", d["id"], d["action"], d["data"])
        if self._on_directive is None:
            log.warning("directive %s (%s) ignored: this launcher takes no directives",
                        d["id"], d["action"])
            return
        try:
            self._on_directive(dict(d))
        except Exception:  # noqa: BLE001 - a failing callback must not stop the reporter
            log.exception("handling directive %s (%s) failed", d["id"], d["action"])

    def _acked(self) -> list[str]:
        """The ids this heartbeat acks; each ack counts down one heartbeat."""
        out = [i for i, left in self._acks.items() if left > 0]
        for i in out:
            self._acks[i] -= 1
        return out

    def _drain_queue(self, pending: deque[tuple[str, dict[str, Any]]]) -> None:
        while True:
            try:
                pending.append(self._queue.get_nowait())
            except queue.Empty:
                break
        while len(pending) > MAX_PENDING_EVENTS:
            kind, _ = pending.popleft()
            self.sent["dropped"] += 1
            self._warn("overflow", 10.0, "coordinator unreachable: dropping queued %s messages",
                       kind)

    def _flush(self, client: Client,
               pending: deque[tuple[str, dict[str, Any]]]) -> str | None:
        """Send queued hello/events/bye in order, keeping them while the socket is full.

        Returns the message id of the ``bye`` when it was sent.
        """
        bye_id: str | None = None
        while pending:
            kind, body = pending[0]
            try:
                msg_id = client.send(kind, body)
            except ProtocolError as e:
                log.error("dropping invalid %s message: %s", kind, e)
                pending.popleft()
                continue
            if msg_id is None:
                self._warn("again", 10.0, "coordinator at %s not accepting messages; %d queued",
                           self.endpoint, len(pending))
                return bye_id
            pending.popleft()
            self.sent[kind] += 1
            if kind == "bye":
                bye_id = msg_id
        return bye_id

    def _heartbeat(self, client: Client) -> None:
        try:
            state = dict(self._state_fn())
        except Exception:  # noqa: BLE001 - a broken state_fn must not stop the reporter
            log.exception("state_fn failed; heartbeat skipped")
            return
        acked = self._acked()
        if self._bind_host is None and isinstance(state.get("probe_addr"), str):
            self._bind_host = protocol.split_endpoint(state["probe_addr"])[0]
        if self.relay is not None:
            state["aggr_addr"] = self.relay.address
        kind, body = self._composer.compose(state, time.monotonic(), acked)
        try:
            sent = self._send_report(client, kind, body)
        except ProtocolError as e:
            # Stay alive in the coordinator's eyes: send what is certainly valid.
            self._warn("bad_heartbeat", 30.0, "state_fn returned an invalid heartbeat: %s", e)
            minimal = {**_HEARTBEAT_DEFAULTS, "node_id": self.node_id, "host": self.host,
                       "pid": os.getpid(), "last_error": f"invalid heartbeat: {e}"[:4096]}
            if acked:
                minimal["acked"] = acked
            for key in ("state", "group_rank", "group_world_size", "restarts", "max_restarts"):
                candidate = {**minimal, key: body.get(key)}
                try:
                    protocol.validate("heartbeat", candidate)
                except ProtocolError:
                    continue
                minimal = candidate
            sent = client.send("heartbeat", minimal)
        if sent is not None:
            self.sent["heartbeat"] += 1
        else:
            self._composer.want_full()
            self.sent["dropped"] += 1
            self._warn("hb_again", 10.0, "coordinator at %s unreachable; heartbeat dropped",
                       self.endpoint)
