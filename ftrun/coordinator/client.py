"""Clients of the coordinator: one-shot requests (``ftrun status``) and the node reporter.

:func:`request` opens a fresh DEALER socket per call, so a reply can only be the answer to
that request. :class:`NodeReporter` is what each node launcher runs: a thread that owns one
DEALER socket, says ``hello``, sends a ``heartbeat`` every interval, forwards events in order
and finally says ``bye``. It never blocks its caller: when the coordinator is down or
restarting, ZeroMQ reconnects in the background, heartbeats are dropped rather than queued
without bound, and events wait in a bounded queue.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from ftrun import errors, protocol
from ftrun.errors import AuthError, FtrunError, ProtocolError, UnreachableError

log = logging.getLogger(__name__)

MAX_PENDING_EVENTS = 10_000
REPORTER_POLL_S = 0.02
RECONNECT_IVL_MS = 200
RECONNECT_IVL_MAX_MS = 2000
AUTH_WARN_EVERY_S = 30.0

_ERRORS: dict[str, type[FtrunError]] = {
    cls.__name__: cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, FtrunError)
}


def _dealer(ctx: zmq.Context[Any], endpoint: str, *, sndhwm: int) -> zmq.Socket[Any]:
    url = protocol.zmq_url(endpoint)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    sock.setsockopt(zmq.RCVHWM, 1000)
    sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES + 1024)
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    if url.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    sock.connect(url)
    return sock


def _auth_refused(endpoint: str) -> AuthError:
    return AuthError(
        f"the coordinator at {endpoint} refused our secret; set FTRUN_SECRET or --state-dir "
        "to the job's (the secret is <state dir>/jobs/<run id>/secret where the job started)"
    )


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
    frames = protocol.encode(kind, body, secret=secret, job=job, sender=sender)
    deadline = time.monotonic() + timeout_s
    sock = _dealer(zmq.Context.instance(), endpoint, sndhwm=16)
    try:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            raise _unreachable(endpoint, timeout_s) from None
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not sock.poll(remaining_ms, zmq.POLLIN):
                raise _unreachable(endpoint, timeout_s)
            reply = sock.recv_multipart()
            if reply == [protocol.AUTH_REFUSED]:
                raise _auth_refused(endpoint)
            try:
                msg = protocol.decode(reply, secret=secret, job=job)
            except AuthError:
                raise AuthError(
                    f"the reply from {endpoint} is not signed with our secret: another job's "
                    "coordinator, or not a coordinator; check the endpoint and FTRUN_SECRET"
                ) from None
            if msg.kind == "error":
                cls = _ERRORS.get(str(msg.body.get("error", "")), FtrunError)
                raise cls(f"coordinator at {endpoint}: {msg.body['message']}")
            return msg
    finally:
        sock.close(0)


def _unreachable(endpoint: str, timeout_s: float) -> UnreachableError:
    return UnreachableError(
        f"coordinator at {endpoint} did not answer within {timeout_s:g} s; is the job running? "
        "(check the endpoint, firewalls, and that the job's launchers are alive)"
    )


_HEARTBEAT_DEFAULTS: dict[str, Any] = {
    "state": "init",
    "group_rank": None,
    "group_world_size": None,
    "restarts": 0,
    "max_restarts": 0,
    "workers": [],
    "last_error": None,
}


class NodeReporter:
    """Reports one node launcher's state to the coordinator from a background thread.

    ``state_fn`` returns the heartbeat fields (``state``, ``group_rank``,
    ``group_world_size``, ``restarts``, ``max_restarts``, ``workers``, ``last_error`` and
    optionally ``extra``); missing ones get defaults, ``node_id``/``host``/``pid`` are added.
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
    ) -> None:
        protocol.split_endpoint(endpoint)  # fail early on a malformed endpoint
        self.endpoint = endpoint
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
        self.sent = {"hello": 0, "heartbeat": 0, "event": 0, "bye": 0, "dropped": 0}

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._run, name=f"ftrun-reporter-{self.node_id}", daemon=True
        )
        self._thread.start()

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
        sock = _dealer(ctx, self.endpoint, sndhwm=100)
        pending: deque[tuple[str, dict[str, Any]]] = deque()
        pending.append(("hello", {"node_id": self.node_id, "host": self.host,
                                  "pid": os.getpid()}))
        next_hb = time.monotonic()
        bye_id: str | None = None
        try:
            while True:
                try:
                    self._drain_queue(pending)
                    bye_id = self._flush(sock, pending) or bye_id
                    if not self._stop.is_set() and time.monotonic() >= next_hb:
                        next_hb = time.monotonic() + self.interval_s
                        self._heartbeat(sock)
                    acked = self._receive(sock, REPORTER_POLL_S)
                    if bye_id is not None and bye_id in acked:
                        break
                    if self._stop.is_set() and time.monotonic() >= self._bye_deadline:
                        log.debug("bye to %s not acknowledged in time", self.endpoint)
                        break
                except Exception:  # noqa: BLE001 - the reporter must survive anything
                    log.exception("node reporter loop error; continuing")
                    time.sleep(REPORTER_POLL_S)
        finally:
            sock.close(0)
            ctx.term()

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

    def _flush(self, sock: zmq.Socket[Any],
               pending: deque[tuple[str, dict[str, Any]]]) -> str | None:
        """Send queued hello/events/bye in order, keeping them while the socket is full.

        Returns the message id of the ``bye`` when it was sent.
        """
        bye_id: str | None = None
        while pending:
            kind, body = pending[0]
            try:
                frames = protocol.encode(kind, body, secret=self._secret, job=self.job,
                                         sender=self.node_id)
            except ProtocolError as e:
                log.error("dropping invalid %s message: %s", kind, e)
                pending.popleft()
                continue
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                self._warn("again", 10.0, "coordinator at %s not accepting messages; %d queued",
                           self.endpoint, len(pending))
                return bye_id
            pending.popleft()
            self.sent[kind] += 1
            if kind == "bye":
                bye_id = json.loads(frames[0])["id"]
        return bye_id

    def _heartbeat(self, sock: zmq.Socket[Any]) -> None:
        try:
            state = dict(self._state_fn())
        except Exception:  # noqa: BLE001 - a broken state_fn must not stop the reporter
            log.exception("state_fn failed; heartbeat skipped")
            return
        body = {**_HEARTBEAT_DEFAULTS, **state}
        body.update(node_id=self.node_id, host=self.host, pid=os.getpid())
        error = body.get("last_error")
        if isinstance(error, str) and len(error) > protocol.MAX_STRING_CHARS:
            body["last_error"] = "..." + error[-(protocol.MAX_STRING_CHARS - 3):]
        try:
            frames = protocol.encode("heartbeat", body, secret=self._secret, job=self.job,
                                     sender=self.node_id)
        except ProtocolError as e:
            # Stay alive in the coordinator's eyes: send what is certainly valid.
            self._warn("bad_heartbeat", 30.0, "state_fn returned an invalid heartbeat: %s", e)
            minimal = {**_HEARTBEAT_DEFAULTS, "node_id": self.node_id, "host": self.host,
                       "pid": os.getpid(), "last_error": f"invalid heartbeat: {e}"[:4096]}
            for key in ("state", "group_rank", "group_world_size", "restarts", "max_restarts"):
                candidate = {**minimal, key: body.get(key)}
                try:
                    protocol.validate(protocol.SCHEMAS["heartbeat"], candidate)
                except ProtocolError:
                    continue
                minimal = candidate
            frames = protocol.encode("heartbeat", minimal, secret=self._secret, job=self.job,
                                     sender=self.node_id)
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
            self.sent["heartbeat"] += 1
        except zmq.Again:
            self.sent["dropped"] += 1
            self._warn("hb_again", 10.0, "coordinator at %s unreachable; heartbeat dropped",
                       self.endpoint)

    def _receive(self, sock: zmq.Socket[Any], wait_s: float) -> set[str]:
        """Read replies for up to ``wait_s``; return the ids of the messages acknowledged."""
        acked: set[str] = set()
        if not sock.poll(int(wait_s * 1000), zmq.POLLIN):
            return acked
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return acked
            if frames == [protocol.AUTH_REFUSED]:
                self._warn("auth", AUTH_WARN_EVERY_S, "%s", _auth_refused(self.endpoint))
                continue
            try:
                msg = protocol.decode(frames, secret=self._secret, job=self.job)
            except ProtocolError as e:
                self._warn("bad_reply", 30.0, "bad reply from coordinator at %s: %s",
                           self.endpoint, e)
                continue
            if msg.kind == "ack":
                acked.add(str(msg.body.get("re", "")))
            elif msg.kind == "error":
                self._warn("error_reply", 10.0, "coordinator at %s: %s", self.endpoint,
                           msg.body.get("message"))
