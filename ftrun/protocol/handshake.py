"""Who may connect: every ftrun connection opens with a handshake keyed from the job secret.

Signing each message (:mod:`ftrun.protocol.codec`) proves who sent it, but only once ZeroMQ
has received the whole message: it assembles every frame of a multi-part message before the
server reads the first, so a peer without the secret could make a server hold a message of
any size (ZeroMQ's size limit is per frame). The handshake closes that door: a server socket
is a ZeroMQ PLAIN server whose connections are vetted by a ZAP handler of ftrun's own (one per
ZeroMQ context, :class:`Gate`), and a client presents the job's *handshake token*, derived
from the secret (:func:`token`). A peer that does not present it is disconnected during the
handshake, before any message of its is read: what it sends costs the server nothing beyond
the connection. The refusal is logged with the peer's address, rate-limited per address; the
client sees it as :class:`~ftrun.errors.AuthError` (its socket's monitor reports the refused
handshake), not as a silent timeout.

The token is not the secret: it is a keyed hash of it, and it crosses the network in clear at
each connection (PLAIN). Someone who can read the job's traffic can learn it and connect, but
not sign a message (that takes the secret); messages stay signed, numbered and checked as
before. What a connection costs (one ZAP round-trip in-process) is paid once per connection;
messages cost what they did.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from ftrun.errors import AuthError, FtrunError, ProtocolError

log = logging.getLogger(__name__)

USER = b"ftrun"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
# Refused handshakes logged per peer address and per server, at most once per this long.
WARN_EVERY_S = 10.0
JOIN_TIMEOUT_S = 5.0
BIND_RETRY_S = 2.0

# Called for each refused handshake: (peer address, why, None or the count held back).
Refused = Callable[[str, str, int | None], None]

# Events a client's monitor reports when a server refused its handshake.
_REFUSED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


def token(secret: bytes) -> bytes:
    """The handshake token of a job: a keyed hash of its secret (hex, 64 bytes)."""
    return hmac.new(secret, b"ftrun handshake v1", hashlib.sha256).hexdigest().encode()


# -- the client's side --------------------------------------------------------------------------


def join(sock: zmq.Socket[Any], secret: bytes) -> None:
    """Make ``sock`` (before it connects) present the job's token at each handshake."""
    sock.setsockopt(zmq.PLAIN_USERNAME, USER)
    sock.setsockopt(zmq.PLAIN_PASSWORD, token(secret))


class Refusals:
    """A client socket's monitor, read for refused handshakes only (see :meth:`check`)."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self._monitor: zmq.Socket[Any] | None = sock.get_monitor_socket(_REFUSED)

    def check(self, peer: str) -> None:
        """Raise for a handshake ``peer`` (its name) refused since the last check: AuthError
        for a wrong token, ProtocolError for a peer that speaks no ftrun handshake."""
        monitor = self._monitor
        if monitor is None:
            return
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                raise AuthError(
                    f"{peer} refused our secret at its handshake (status "
                    f"{event['value']}): it belongs to another job or we have the wrong "
                    "secret; set FTRUN_SECRET or --state-dir to the job's (the secret is "
                    "<state dir>/jobs/<run id>/secret where the job started)")
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                raise ProtocolError(
                    f"{peer} does not speak ftrun's handshake (ZeroMQ protocol error "
                    f"{event['value']}): not an ftrun {peer.split(' at ')[0]}, or an ftrun "
                    "release from before handshakes; check the address and run one release")

    @property
    def socket(self) -> zmq.Socket[Any] | None:
        """The monitor socket, to poll beside the client's own."""
        return self._monitor

    def close(self, sock: zmq.Socket[Any]) -> None:
        """Stop monitoring ``sock`` (before it closes) and close the monitor."""
        if self._monitor is None:
            return
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(0)
        self._monitor = None


# -- the server's side --------------------------------------------------------------------------


class Mismatches:
    """A server socket's monitor, for the connections it dropped before any ZAP request: a
    peer that presented no token at all (no PLAIN handshake: a protocol error). ZeroMQ does
    not say which address those came from. A handshake cut short (the peer went away, or this
    process was stopped meanwhile) is no refusal and is not counted (NO_DETAIL)."""

    EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL

    def __init__(self, sock: zmq.Socket[Any], name: str) -> None:
        self.socket: zmq.Socket[Any] = sock.get_monitor_socket(self.EVENTS)
        self._name = name
        self._last_warn = float("-inf")
        self._suppressed = 0

    def drain(self) -> tuple[int, int | None]:
        """Read what the monitor reported: (connections dropped, None when not logged
        (rate limit) else the count held back before this line)."""
        from zmq.utils.monitor import recv_monitor_message

        dropped = 0
        while True:
            try:
                recv_monitor_message(self.socket, zmq.NOBLOCK)
            except zmq.Again:
                break
            dropped += 1
        if not dropped:
            return 0, None
        now = time.monotonic()
        if now - self._last_warn < WARN_EVERY_S:
            self._suppressed += dropped
            return dropped, None
        self._last_warn, more = now, self._suppressed
        self._suppressed = 0
        log.warning("%s: dropped %d connection(s) at the handshake: a peer without ftrun's "
                    "handshake (no token), or not speaking ZeroMQ; nothing it sent was read "
                    "(ZeroMQ does not name the address of such a peer)%s", self._name, dropped,
                    f" ({more} more since, not logged)" if more else "")
        return dropped, more

    def close(self, sock: zmq.Socket[Any]) -> None:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.socket.close(0)


class Gate:
    """The ZAP handler of one ZeroMQ context: vets every handshake on the server sockets of
    that context that :func:`serve` registered, on a daemon thread of its own.

    Each registered socket has a ZAP domain of its own, and with it the token its peers must
    present, the name it logs under and a counter of refusals. The thread stops (and closes
    its socket, so that the context can be terminated) when the last socket is released.
    """

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self._ctx = ctx
        self._lock = threading.Lock()
        self._domains: dict[bytes, tuple[bytes, str, Refused]] = {}
        self._last_warn: dict[tuple[bytes, bytes], float] = {}
        self._suppressed: dict[tuple[bytes, bytes], int] = {}
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            # The endpoint of a gate just stopped is freed by ZeroMQ's own thread: retried.
            deadline = time.monotonic() + BIND_RETRY_S
            while True:
                try:
                    self._sock.bind(ZAP_ENDPOINT)
                    break
                except zmq.ZMQError as e:
                    if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                        raise
                    time.sleep(0.005)
        except zmq.ZMQError as e:
            self._sock.close(0)
            raise FtrunError(f"cannot vet connections: {ZAP_ENDPOINT} is taken in this "
                             f"ZeroMQ context ({e}); is another ZAP handler running in this "
                             "process on ZeroMQ's shared context?") from e
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="ftrun-handshakes", daemon=True)
        self._thread.start()

    def add(self, domain: bytes, tok: bytes, name: str, on_refused: Refused) -> None:
        with self._lock:
            self._domains[domain] = (tok, name, on_refused)

    def remove(self, domain: bytes) -> bool:
        """Forget ``domain``; True when no domain is left (stop the gate)."""
        with self._lock:
            self._domains.pop(domain, None)
            return not self._domains

    def stop(self) -> None:
        os.write(self._wake_w, b"x")
        self._thread.join(JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("the handshake thread did not stop within %.0f s", JOIN_TIMEOUT_S)
            return  # its socket and pipe stay: closing them under it could crash it
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._wake_r in ready:
                    return
                if self._sock in ready:
                    try:
                        request = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        continue
                    self._sock.send_multipart(self._answer(request))
        except zmq.ZMQError as e:
            if e.errno != zmq.ETERM:
                log.exception("the handshake thread failed: new connections will be refused")
        finally:
            try:
                self._sock.unbind(ZAP_ENDPOINT)
            except zmq.ZMQError:
                pass
            self._sock.close(0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        # RFC 27: version, request id, domain, address, routing id, mechanism, credentials.
        if len(request) < 6 or request[0] != b"1.0":
            return [b"1.0", request[1] if len(request) > 1 else b"", b"500",
                    b"malformed ZAP request", b"", b""]
        _, request_id, domain, address, _, mechanism, *credentials = request
        with self._lock:
            entry = self._domains.get(domain)
        if entry is not None:
            tok, name, on_refused = entry
            if (mechanism == b"PLAIN" and len(credentials) == 2 and credentials[0] == USER
                    and hmac.compare_digest(credentials[1], tok)):
                return [b"1.0", request_id, b"200", b"OK", USER, b""]
            why = ("no token (a peer without ftrun's handshake)" if mechanism != b"PLAIN"
                   else "a wrong token (another job's peer, or the wrong secret)")
            suppressed = self._warn(domain, address, name, why)
            try:
                on_refused(address.decode(errors="replace"), why, suppressed)
            except Exception:  # noqa: BLE001 - a hook's bug must not stop the vetting
                log.exception("%s: reporting a refused handshake failed", name)
        else:
            log.debug("handshake for unknown domain %r refused", domain)
        return [b"1.0", request_id, b"400", b"refused", b"", b""]

    def _warn(self, domain: bytes, address: bytes, name: str, why: str) -> int | None:
        """Log a refusal, at most once per WARN_EVERY_S per server and peer address; the
        number of refusals not logged since the last line, or None when not logged."""
        key = (domain, address)
        now = time.monotonic()
        if now - self._last_warn.get(key, float("-inf")) < WARN_EVERY_S:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return None
        if len(self._last_warn) > 4096:
            self._last_warn.clear()
        self._last_warn[key] = now
        more = self._suppressed.pop(key, 0)
        log.warning("%s: refused a connection from %s at the handshake: %s; nothing it sends "
                    "is read%s", name, address.decode(errors="replace") or "a local process",
                    why, f" ({more} more refused since, not logged)" if more else "")
        return more


_GATES: dict[zmq.Context[Any], Gate] = {}
_GATES_LOCK = threading.Lock()
_DOMAINS = itertools.count(1)


def _forget_after_fork() -> None:
    # A forked child has none of its parent's threads (nor a usable copy of its contexts).
    global _GATES, _GATES_LOCK
    _GATES, _GATES_LOCK = {}, threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


class Served:
    """One server socket's registration with its context's :class:`Gate`; :meth:`release`
    it when the socket closes."""

    def __init__(self, ctx: zmq.Context[Any], domain: bytes) -> None:
        self._ctx = ctx
        self._domain = domain

    def release(self) -> None:
        with _GATES_LOCK:
            gate = _GATES.get(self._ctx)
            if gate is None or not gate.remove(self._domain):
                return
            del _GATES[self._ctx]
        gate.stop()


def _ignore(address: str, why: str, suppressed: int | None) -> None:
    pass


def serve(sock: zmq.Socket[Any], secret: bytes, name: str,
          on_refused: Refused = _ignore) -> Served:
    """Make ``sock`` (before it binds) accept only connections that present the job's token;
    ``name`` says who serves in the log. ``on_refused(address, why, suppressed)`` is called
    on the gate's thread for each refused connection: ``suppressed`` is None when its log
    line was held back (rate limit), else how many were held back before it."""
    ctx = sock.context
    domain = f"ftrun-{os.getpid()}-{next(_DOMAINS)}".encode()
    with _GATES_LOCK:
        gate = _GATES.get(ctx)
        if gate is None:
            gate = _GATES[ctx] = Gate(ctx)
        gate.add(domain, token(secret), name, on_refused)
    sock.setsockopt(zmq.PLAIN_SERVER, 1)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain)
    return Served(ctx, domain)
