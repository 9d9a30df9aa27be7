"""Request/reply over ZeroMQ: one client and one server for every control-plane peer.

- :class:`Client` (a DEALER socket): ranks to their node's store, the store and the launcher's
  reporter to the coordinator, ``ftrun status``. A request waits for the reply that carries
  its id (``re``); a reply to an earlier request that timed out is dropped, never taken for
  the current one. Replies to messages sent without waiting (:meth:`Client.send`) go to an
  ``on_reply`` callback, each at most once.
- :class:`Server` (a ROUTER socket): the coordinator and the store. It runs a handler table
  (kind -> handler); an unknown kind, an invalid message or a handler that raises is
  answered with an ``error`` and logged, and the loop goes on.

One error mapping on both ends: a wrong secret is :class:`AuthError` (the server answers the
fixed, unsigned :data:`~ftrun.protocol.codec.AUTH_REFUSED` and logs an auth failure), a peer
that does not answer is :class:`UnreachableError` naming the address and what to check, a
malformed or oversized message is :class:`ProtocolError`, and an ``error`` reply is raised as
the error class it names. Every wait is bounded; sockets never linger at close.

Coordinator terms (``--rdzv-backend etcd``, where the coordinator fails over): a client's
:attr:`Client.term` is signed into every message it sends, and a client with a term drops
replies of another one (but errors, which order nothing; a client without a term, such as
``ftrun status``, takes any); :meth:`Client.retarget` points it at a new coordinator and term. A server with a
:attr:`Server.term` refuses messages of another term (``stale_term``, answered with an
error) but for the read-only kinds in ``term_free`` (``ftrun status``), and signs its replies
with its term.

Hostile input. A server takes each client session's message numbers once and in order
(:class:`~ftrun.protocol.codec.ReplayGuard`: a replayed message is refused), caps the size of
a whole message as well as of each frame, and logs refused messages, and reports them to its
``on_reject`` hook, at most once per :data:`WARN_EVERY_S` per peer address (over ipc: the peer
process, by its credentials; by connection where ZeroMQ gives none) and :data:`MAX_REFUSAL_REPORTS` times per
:data:`WARN_EVERY_S` in all, with the count of those suppressed in between. Refused frames
are dropped at once; ZeroMQ queues at most ``hwm`` messages per connection.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Union

import zmq

from ftrun import errors
from ftrun.errors import AuthError, FtrunError, ProtocolError, UnreachableError
from ftrun.protocol import codec, handshake
from ftrun.protocol.codec import AUTH_REFUSED, Buffer, Typed
from ftrun.protocol.endpoints import zmq_url
from ftrun.protocol.messages import Body, Message

log = logging.getLogger(__name__)

# Ids of messages sent without waiting whose replies are still welcome (to ``on_reply``).
SENT_IDS_KEPT = 4096
# Messages sent without waiting kept to be sent again when a restarted server refuses them as
# stale (Client._follow): those ZeroMQ may have queued while it was down.
RESENDABLE_KEPT = 256  # more than a coordinator client's send queue (sndhwm)
WARN_EVERY_S = 10.0
MAX_AUTH_REFUSALS_PER_S = 5
# Refused messages logged and reported (on_reject) per WARN_EVERY_S, all peers together, and
# peers whose refusals are counted (the least recently reported are forgotten first).
MAX_REFUSAL_REPORTS = 20
MAX_PEERS_TRACKED = 1024
MAX_ERROR_CHARS = 4000
# A refused message that made the server read at least this many bytes hands the freed heap
# back to the OS (at most once per TRIM_EVERY_S): a flood must not leave its peak resident.
TRIM_AFTER_BYTES = 8 << 20
TRIM_EVERY_S = 1.0

_ERRORS: dict[str, type[FtrunError]] = {
    cls.__name__: cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, FtrunError)
}


def _url(address: str) -> str:
    """A ZeroMQ URL as is, or ``host:port`` as ``tcp://host:port``."""
    return address if "://" in address else zmq_url(address)


def _frame_cap(max_frame_bytes: int, max_message_bytes: int | None = None) -> int:
    # ZeroMQ's own limit, per frame: the largest header or data frame (no larger than a whole
    # message), with room for framing.
    total = codec.total_cap(max_frame_bytes, max_message_bytes)
    return min(total, max(codec.MAX_MESSAGE_BYTES, max_frame_bytes)) + 1024


def error_from_reply(msg: Message, peer: str) -> FtrunError:
    """The error an ``error`` reply stands for: the class it names, else FtrunError."""
    cls = _ERRORS.get(str(msg.body.get("error", "")), FtrunError)
    return cls(f"{peer}: {msg.body['message']}")


class RateLimiter:
    """Let through the first of each key per ``every_s``; count what was held back.

    At most ``max_keys`` keys are tracked: the one let through longest ago is forgotten
    first, and what it held back is reported with the next one let through, so memory stays
    bounded and no count is lost. With ``max_per_window``, at most that many are let through
    per ``every_s``, all keys together.
    """

    def __init__(self, every_s: float, max_keys: int = 1024,
                 max_per_window: int | None = None) -> None:
        self.every_s = every_s
        self.max_keys = max_keys
        self.max_per_window = max_per_window
        self.forgotten = 0  # held back for keys forgotten since, not yet reported
        self._last: OrderedDict[Any, list[Any]] = OrderedDict()  # key -> [time let through, held]
        self._window = (float("-inf"), 0)  # (start, let through in it)

    def allow(self, key: Any) -> tuple[bool, int]:
        """(allowed, number suppressed since the last allowed one: for this key, plus those
        of forgotten keys when allowed)."""
        now = time.monotonic()
        entry = self._last.get(key)
        if entry is not None and now - entry[0] < self.every_s:
            entry[1] += 1
            return False, entry[1]
        if self.max_per_window is not None:
            start, count = self._window
            if now - start >= self.every_s:
                start, count = now, 0
            if count >= self.max_per_window:
                if entry is None:
                    entry = [float("-inf"), 0]
                    self._add(key, entry)
                entry[1] += 1
                return False, entry[1]
            self._window = (start, count + 1)
        suppressed = 0 if entry is None else entry[1]
        if entry is None:
            self._add(key, [now, 0])
        else:
            entry[0], entry[1] = now, 0
            self._last.move_to_end(key)
        suppressed += self.forgotten
        self.forgotten = 0
        return True, suppressed

    def _add(self, key: Any, entry: list[Any]) -> None:
        while len(self._last) >= self.max_keys:
            self.forgotten += self._last.popitem(last=False)[1][1]
        self._last[key] = entry


class Client:
    """One peer's end of request/reply: a DEALER socket, made on first use.

    ``address`` is ``host:port`` or a ZeroMQ URL (``ipc://...``). ``peer`` names the other
    end in errors ("coordinator", "snapshot store") and ``hint`` says what to check when it
    does not answer. Thread-safe; a process forked after first use makes a fresh socket
    instead of touching its parent's.
    """

    def __init__(
        self,
        address: str,
        secret: bytes,
        job: str,
        sender: str,
        *,
        peer: str = "peer",
        hint: str = "",
        on_reply: Callable[[Message], None] | None = None,
        send_timeout_s: float = 1.0,
        sndhwm: int = 1000,
        reconnect_s: tuple[float, float] | None = None,
        max_frame_bytes: int = codec.MAX_FRAME_BYTES,
        max_message_bytes: int | None = None,
        context: zmq.Context[Any] | None = None,
        term: int = 0,
        resend_stale: bool | int = False,
        follow_on_send: bool = False,
    ) -> None:
        self.address = address
        # The coordinator term messages are bound to, and replies must carry (0: none).
        self.term = term
        # A client made without a term follows the one its server names when it refuses a
        # message as stale: a coordinator without failover takes a new term (an incarnation)
        # each time it starts, so messages captured before a restart are refused after it,
        # while its clients move to the new one with their next message (see _follow).
        self._follows = term == 0
        # With ``resend_stale`` (a coordinator's clients): messages sent without waiting and
        # without data frames, while following, are sent again under the new term when the
        # restarted server refuses them as stale (a launcher's events, queued by ZeroMQ while
        # the server was down, are not lost to its restart); the newest RESENDABLE_KEPT, or
        # as many as ``resend_stale`` says when it is a number (for a server that does not
        # answer them, they are kept until newer ones push them out).
        self._resend_kept = (RESENDABLE_KEPT if resend_stale is True else int(resend_stale))
        self._resend_stale = self._resend_kept > 0
        # With ``follow_on_send`` (a client that only sends, such as a rank's collective
        # reports to the detection service): each send also reads what has arrived, so that
        # a restarted server's refusal teaches it the new term (the refused message is lost,
        # unless ``resend_stale`` keeps it to be sent again then).
        self._follow_on_send = follow_on_send
        self._resendable: OrderedDict[str, tuple[str, Mapping[str, Any], int]] = OrderedDict()
        self.url = _url(address)
        self.peer = peer
        self._hint = hint
        self._secret = secret
        self._job = job
        self._sender = sender
        self._on_reply = on_reply
        self._send_timeout_s = send_timeout_s
        self._sndhwm = sndhwm
        self._reconnect_s = reconnect_s
        self._max_frame_bytes = max_frame_bytes
        self._max_message_bytes = max_message_bytes
        self._ctx = context
        self._lock = threading.Lock()
        self._sock: zmq.Socket[Any] | None = None
        self._refusals: handshake.Refusals | None = None
        self._poller: zmq.Poller | None = None
        self._pid = os.getpid()
        # Every message is numbered in this client's session (the server refuses a number it
        # has seen: a replay); reconnecting keeps both, a forked child starts its own.
        self._session = codec.new_session()
        self._counter = 0
        self._sent: deque[str] = deque(maxlen=SENT_IDS_KEPT)
        self._sent_set: set[str] = set()
        self._warn = RateLimiter(WARN_EVERY_S)

    def __str__(self) -> str:
        return f"{self.peer} at {self.address}"

    # -- the socket --------------------------------------------------------------------------

    def _socket(self) -> zmq.Socket[Any]:
        if self._pid != os.getpid():
            # Inherited through fork: the parent's socket is never used here, and the parent
            # goes on numbering its session, so the child takes a session of its own.
            self._sock, self._refusals, self._pid = None, None, os.getpid()
            self._session, self._counter = codec.new_session(), 0
            self._sent.clear()
            self._sent_set.clear()
        if self._sock is None:
            ctx = self._ctx if self._ctx is not None else zmq.Context.instance()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self._sndhwm)
            sock.setsockopt(zmq.RCVHWM, 1000)
            sock.setsockopt(zmq.SNDTIMEO, max(0, int(self._send_timeout_s * 1000)))
            sock.setsockopt(zmq.MAXMSGSIZE, _frame_cap(self._max_frame_bytes,
                                                       self._max_message_bytes))
            if self._reconnect_s is not None:
                sock.setsockopt(zmq.RECONNECT_IVL, int(self._reconnect_s[0] * 1000))
                sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(self._reconnect_s[1] * 1000))
            if self.url.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            handshake.join(sock, self._secret)
            self._refusals = handshake.Refusals(sock)
            self._poller = zmq.Poller()
            self._poller.register(sock, zmq.POLLIN)
            if self._refusals.socket is not None:
                self._poller.register(self._refusals.socket, zmq.POLLIN)
            sock.connect(self.url)
            self._sock, self._pid = sock, os.getpid()
        return self._sock

    def _reset(self) -> None:
        """Drop the connection: a fresh one reconnects at once (to a restarted peer)."""
        if self._sock is not None:
            if self._pid == os.getpid():
                if self._refusals is not None:
                    self._refusals.close(self._sock)
                self._sock.close(0)
            self._sock = self._refusals = self._poller = None  # the session goes on

    def close(self, linger_s: float = 0.0) -> None:
        """Close the connection; ``linger_s`` > 0 gives what is queued that long to go out
        (a last message before the process exits), else it is dropped."""
        with self._lock:
            if linger_s > 0 and self._sock is not None and self._pid == os.getpid():
                if self._refusals is not None:
                    self._refusals.close(self._sock)
                self._sock.close(int(linger_s * 1000))
                self._sock = self._refusals = self._poller = None
            self._reset()

    def _follow(self, msg: Message, want: str | None) -> bool:
        """Take the term a server names in its refusal of one of our messages as stale (its
        reply is signed and answers a message of ours: not a replay), and send again, under
        it, a message sent without waiting that it refused. True when it was taken care of
        here (nothing to deliver)."""
        if (not self._follows or msg.kind != "error" or not msg.term
                or msg.body.get("error") != "StaleTermError"
                or (msg.re != want and msg.re not in self._sent_set)):
            return False
        if msg.term != self.term:
            (log.info if self.term else log.debug)(
                "%s runs under term %d%s", self, msg.term,
                f" (it restarted: was {self.term}); following it" if self.term else "")
            self.term = msg.term
        again = self._resendable.pop(msg.re, None) if msg.re is not None else None
        if again is None or again[2] == self.term:
            return False
        kind, body, _ = again
        self._sent_set.discard(msg.re)
        self._send_locked(kind, body, ())
        return True

    def _check_refused(self) -> None:
        """Raise AuthError (ProtocolError) when the server refused our handshake."""
        if self._refusals is not None:
            self._refusals.check(str(self))

    def retarget(self, address: str, term: int) -> None:
        """Talk to ``address`` under coordinator ``term`` from now on (the coordinator failed
        over). The session and its numbers go on; replies of another term are dropped."""
        url = _url(address)
        with self._lock:
            self._reset()
            self.address, self.url, self.term = address, url, term
            self._follows = term == 0  # told a term: it comes from the role's holder

    # -- sending -----------------------------------------------------------------------------

    def _encode(self, kind: str, body: Mapping[str, Any], msg_id: str,
                data: Sequence[Buffer]) -> list[Buffer]:
        """Number and sign a message; called under the lock, right before it is sent, so
        that the numbers go out in order."""
        self._socket()  # a forked child takes its own session first
        self._counter += 1
        return codec.encode(kind, body, secret=self._secret, job=self._job,
                            sender=self._sender, id=msg_id, data=data,
                            session=self._session, counter=self._counter, term=self.term)

    def send(self, kind: str, body: Mapping[str, Any],
             frames: Sequence[Buffer] = ()) -> str | None:
        """Send without waiting; a reply to it goes to ``on_reply`` when one is read.

        Returns the message id, or None when the message could not be queued within the send
        timeout (nobody connected, or the peer not reading).
        """
        with self._lock:
            sent = self._send_locked(kind, body, frames)
            if self._follow_on_send and self._follows:
                try:
                    self._read(None, 0.0)  # what has arrived only: never waits
                except FtrunError as e:  # told again by the next send; never raised here
                    allowed, _ = self._warn.allow(type(e))
                    (log.warning if allowed else log.debug)("%s: %s", self, e)
            return sent

    def _send_locked(self, kind: str, body: Mapping[str, Any],
                     frames: Sequence[Buffer]) -> str | None:
        msg_id = codec.new_id()
        out = self._encode(kind, body, msg_id, frames)
        try:
            self._socket().send_multipart(out, copy=False)
        except zmq.Again:
            self._check_refused()
            return None
        if len(self._sent) == self._sent.maxlen:
            self._sent_set.discard(self._sent[0])
        self._sent.append(msg_id)
        self._sent_set.add(msg_id)
        if self._resend_stale and self._follows and not frames:
            self._resendable[msg_id] = (kind, body, self.term)
            while len(self._resendable) > self._resend_kept:
                self._resendable.popitem(last=False)
        return msg_id

    def request(self, kind: str, body: Mapping[str, Any], expect: str | None,
                timeout_s: float, *, attempts: int = 1,
                frames: Sequence[Buffer] = ()) -> Message:
        """Send and wait up to ``timeout_s`` for the reply to this very message; resend
        (``attempts`` in all) on a fresh connection after each timeout.

        ``expect`` is the kind the reply must have (None: any). Raises UnreachableError when
        no attempt is answered, AuthError when the peer refuses our secret or its reply is not
        signed with it, ProtocolError for a reply of the wrong kind, and the error an
        ``error`` reply names.
        """
        msg_id = codec.new_id()
        with self._lock:
            moved = False
            attempt = 0
            while attempt < attempts:
                # Each attempt under a new number (the server refuses one it has seen), with
                # the same id (a late reply to an earlier attempt answers this request too).
                attempt += 1
                out = self._encode(kind, body, msg_id, frames)
                try:
                    self._socket().send_multipart(out, copy=False)
                except zmq.Again:  # not even queued within the send timeout
                    self._check_refused()  # no connection: was it refused at the handshake?
                    self._reset()
                    continue
                term = self.term
                reply = self._read(msg_id, time.monotonic() + timeout_s)
                if reply is not None and self.term != term and not moved:
                    # Refused as stale by a server that restarted: sent again, once, under
                    # the term it named (not counted as an attempt).
                    moved = True
                    attempt -= 1
                    continue
                if reply is not None:
                    break
                log.debug("%s to %s: no reply after %.1f s (attempt %d of %d)", kind, self,
                          timeout_s, attempt, attempts)
                self._reset()
            else:
                tries = f"{attempts} x {timeout_s:g} s" if attempts > 1 else f"{timeout_s:g} s"
                hint = f"; {self._hint}" if self._hint else ""
                raise UnreachableError(f"{self} did not answer within {tries} ({kind}){hint}")
        if reply.kind == "error":
            raise error_from_reply(reply, str(self))
        if expect is not None and reply.kind != expect:
            raise ProtocolError(f"{self} answered {kind} with {reply.kind}, not {expect}")
        return reply

    # -- receiving ---------------------------------------------------------------------------

    def poll(self, timeout_s: float, *, first: bool = False) -> int:
        """Read what arrives within ``timeout_s``: replies to :meth:`send` go to ``on_reply``.

        With ``first``, return as soon as one reply was delivered (and whatever else had
        already arrived), not at the timeout: a sender with messages in flight wakes on its
        first ack. Returns how many replies were delivered. Raises AuthError when the peer
        refused our secret.
        """
        with self._lock:
            delivered = [0]
            self._read(None, time.monotonic() + timeout_s, delivered if first else None)
            return delivered[0]

    def _read(self, want: str | None, deadline: float,
              stop_after: list[int] | None = None) -> Message | None:
        """Read until the reply to ``want`` arrives (returned) or ``deadline`` passes; with
        ``stop_after``, also once a reply was delivered and nothing more is waiting (its one
        item counts the deliveries)."""
        sock = self._socket()
        assert self._poller is not None and self._refusals is not None
        while True:
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            ready = dict(self._poller.poll(remaining_ms))
            if self._refusals.socket in ready:
                self._check_refused()
            if sock not in ready:
                if remaining_ms == 0 or not ready:
                    return None
                continue
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            msg = self._decode(frames, want)
            if msg is None:
                continue
            if self._follow(msg, want):
                continue
            if self.term and msg.term != self.term and msg.kind != "error":
                # A coordinator of an earlier (or later) term: whatever it says, a directive
                # above all, is not this term's.
                log.info("dropped a %s of coordinator term %d from %s (this client is on term "
                         "%d)", msg.kind, msg.term, self, self.term)
                continue
            if want is not None and msg.re == want:
                return msg
            if msg.re is not None and msg.re in self._sent_set:
                self._sent_set.discard(msg.re)  # one reply each: a replayed one is dropped
                self._resendable.pop(msg.re, None)
                self._deliver(msg)
                if stop_after is not None:
                    stop_after[0] += 1
                    deadline = 0.0  # take what is already here, then return
            else:
                log.debug("dropped a stale %s from %s (reply to %s)", msg.kind, self, msg.re)

    def _decode(self, frames: list[Any], want: str | None) -> Message | None:
        if len(frames) == 1 and frames[0].bytes == AUTH_REFUSED:
            raise AuthError(
                f"{self} refused our secret; set FTRUN_SECRET or --state-dir to the job's "
                "(the secret is <state dir>/jobs/<run id>/secret where the job started). With "
                "the right secret, a data frame was altered on the way"
            )
        payload = [bytes(f.bytes) for f in frames[:2]] + [f.buffer for f in frames[2:]]
        try:
            header = codec.verify(payload, secret=self._secret,
                                  max_frame_bytes=self._max_frame_bytes,
                                  max_message_bytes=self._max_message_bytes)
        except AuthError:
            raise AuthError(
                f"the reply from {self} is not signed with our secret: another job's "
                f"{self.peer}, or not an ftrun {self.peer}; check the address and FTRUN_SECRET"
            ) from None
        except ProtocolError as e:
            log.warning("dropped a bad message from %s: %s", self, e)
            return None
        try:
            return codec.parse(header, job=self._job, data=payload[2:])
        except ProtocolError as e:
            # Authentic but invalid (another ftrun release, another job): fatal to the
            # request it answers, dropped otherwise.
            if want is not None and codec.peek(header, "re") == want:
                raise ProtocolError(f"the reply from {self} is invalid: {e}") from None
            log.warning("dropped a bad message from %s: %s", self, e)
            return None

    def _deliver(self, msg: Message) -> None:
        """A reply to a message sent without waiting: errors are logged here (nobody waits
        to raise them), the rest go to ``on_reply``."""
        if msg.kind == "error":
            allowed, suppressed = self._warn.allow(msg.body.get("message"))
            if allowed:
                more = f" ({suppressed} more like it)" if suppressed else ""
                log.warning("%s answered with an error: %s%s", self, msg.body.get("message"),
                            more)
        elif self._on_reply is not None:
            self._on_reply(msg)


class Reply(NamedTuple):
    """What a handler answers: a message kind, its body (the kind's typed
    :class:`~ftrun.protocol.messages.Body` or the plain object), and binary frames beside
    it."""

    kind: str
    body: Mapping[str, Any] | Body
    frames: Sequence[Buffer] = ()


# A handler answers a request with a Reply, a typed body (its kind is the body's), a
# (kind, body) pair, or None for no reply.
Handler = Callable[[Message], Union[Reply, Body, tuple[str, Mapping[str, Any]], None]]
# Told of refused messages (kind "auth_failure", "bad_message" or "replay", the peer's
# address, reason, how many refused messages were suppressed since the last one told: this
# peer's, and those of peers no longer tracked): the coordinator records them as events.
# Called at most once per WARN_EVERY_S per peer, MAX_REFUSAL_REPORTS times in all.
RejectHook = Callable[[str, str, str, int], None]


class Server:
    """A ROUTER socket that answers through a handler table; the caller runs the loop.

    ``name`` says who serves (in logs and error replies). :meth:`serve_once` handles what
    arrives within a timeout, so a server loop can do its own periodic work between calls.

    ``max_frame_bytes`` caps each data frame, ``max_message_bytes`` a whole message (header,
    MAC and data frames; default :func:`~ftrun.protocol.codec.total_cap`: a header alone for
    a server of small messages such as the coordinator). ``hwm``: the messages ZeroMQ queues
    per connection, each way. ``typed``: the kinds (True: all) whose handlers take the
    kind's typed body; the others get the plain object.

    What an unauthenticated peer can cost: a message is read frame by frame, and only its
    first ``2 + MAX_DATA_FRAMES`` frames and ``max_message_bytes`` are kept: the rest are
    dropped as they are read, so a message of any number of frames costs the server at most
    one message's worth of memory on top of ZeroMQ's own queue (``hwm`` messages of frames of
    at most the frame cap, per connection, plus the one being received), and the heap a
    large refused message used is handed back to the OS (:data:`TRIM_AFTER_BYTES`).
    """

    def __init__(
        self,
        name: str,
        secret: bytes,
        job: str,
        handlers: Mapping[str, Handler],
        *,
        sender: str,
        max_frame_bytes: int = codec.MAX_MESSAGE_BYTES,
        max_message_bytes: int | None = None,
        on_reject: RejectHook | None = None,
        hwm: int = 1000,
        typed: Typed = False,
        term: int = 0,
        term_free: frozenset[str] = frozenset(),
    ) -> None:
        if not secret:
            raise FtrunError(f"the {name} needs a non-empty job secret")
        # The coordinator term this server takes messages of (0: any), and the read-only
        # kinds it takes of any term.
        self.term = term
        self.term_free = term_free
        self._typed = typed
        self.name = name
        self._secret = secret
        self._job = job
        self.handlers = dict(handlers)
        self._sender = sender
        self._max_frame_bytes = max_frame_bytes
        self._max_message_bytes = codec.total_cap(max_frame_bytes, max_message_bytes)
        self._on_reject = on_reject
        self._hwm = hwm
        self._sock: zmq.Socket[Any] | None = None
        self._served: handshake.Served | None = None
        self._mismatches: handshake.Mismatches | None = None
        self._poller: zmq.Poller | None = None
        self._warn = RateLimiter(WARN_EVERY_S, MAX_PEERS_TRACKED, MAX_REFUSAL_REPORTS)
        self._refusals: OrderedDict[Any, tuple[float, int]] = OrderedDict()
        self.replays = codec.ReplayGuard()
        self._next_trim = 0.0
        self._trim_pending = False
        # Replies are numbered in a session of this server's own, like a client's messages.
        self._session = codec.new_session()
        self._counter = 0
        self.counters: dict[str, int] = {"messages": 0, "auth_failures": 0, "bad_messages": 0,
                                         "replays": 0, "stale_terms": 0, "handler_errors": 0}

    def bind(self, url: str, context: zmq.Context[Any] | None = None) -> str:
        """Bind to ``url`` (tcp://host:port, port * for any; ipc://path); return the URL
        actually bound."""
        ctx = context if context is not None else zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, _frame_cap(self._max_frame_bytes,
                                                       self._max_message_bytes))
            sock.setsockopt(zmq.SNDHWM, self._hwm)
            sock.setsockopt(zmq.RCVHWM, self._hwm)
            if url.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            served = handshake.serve(sock, self._secret, self.name, self._count_refused)
            try:
                sock.bind(url)
            except zmq.ZMQError:
                served.release()
                raise
        except zmq.ZMQError:
            sock.close(0)
            raise
        self._sock, self._served = sock, served
        self._mismatches = handshake.Mismatches(sock, self.name)
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._mismatches.socket, zmq.POLLIN)
        return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))

    def bind_tcp(self, host: str, context: zmq.Context[Any] | None = None) -> str:
        """Bind ``host`` on a port the OS picks; returns the ``host:port`` peers use."""
        from ftrun.protocol.endpoints import join_endpoint

        bound = self.bind(f"tcp://{join_endpoint(host, 0).rsplit(':', 1)[0]}:*", context)
        return join_endpoint(host, int(bound.rsplit(":", 1)[1]))

    def close(self) -> None:
        if self._sock is not None:
            if self._mismatches is not None:
                self._mismatches.close(self._sock)
                self._mismatches = self._poller = None
            self._sock.close(0)
            self._sock = None
        if self._served is not None:
            self._served.release()
            self._served = None

    def _count_refused(self, address: str, why: str, suppressed: int | None) -> None:
        """A connection refused at the handshake (on the gate's thread, which logged it):
        counted, and reported to ``on_reject`` when it was logged."""
        self.counters["auth_failures"] += 1
        if suppressed is not None and self._on_reject is not None:
            self._on_reject("auth_failure", address, f"refused at the handshake: {why}",
                            suppressed)

    def serve_once(self, timeout_s: float, max_messages: int = 1000) -> int:
        """Handle the messages that arrive within ``timeout_s`` (at most ``max_messages``);
        return how many were read."""
        sock = self._sock
        if sock is None:
            raise FtrunError(f"the {self.name} is not bound; call bind() first")
        assert self._poller is not None and self._mismatches is not None
        ready = dict(self._poller.poll(int(timeout_s * 1000)))
        if self._mismatches.socket in ready:
            dropped, suppressed = self._mismatches.drain()
            self.counters["auth_failures"] += dropped
            if suppressed is not None and self._on_reject is not None:
                self._on_reject("auth_failure", "", "dropped at the handshake: no token, or "
                                "not ZeroMQ", suppressed)
        if sock not in ready:
            if self._trim_pending:  # a flood ended: give its heap back now
                self._trim(TRIM_AFTER_BYTES)
            return 0
        n = 0
        while n < max_messages:
            try:
                first = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            n += 1
            self._handle(first, *self._read_rest(sock, first))
        return n

    def _read_rest(self, sock: zmq.Socket[Any], first: Any) -> tuple[list[Any], int, int]:
        """The frames of the message ``first`` opens, read one by one: those within the caps
        are kept, the rest dropped at once. Returns (kept, frames read, bytes read)."""
        kept: list[Any] = []
        limit = 2 + codec.MAX_DATA_FRAMES
        cap = self._max_message_bytes
        count = nbytes = 0
        more = first.more
        while more:
            frame = sock.recv(copy=False)
            more = frame.more
            count += 1
            nbytes += len(frame)
            if count <= limit and nbytes <= cap:
                kept.append(frame)
        return kept, count, nbytes

    # -- one message -------------------------------------------------------------------------

    def _handle(self, first: Any, frames: list[Any], count: int, nbytes: int) -> None:
        identity = first.bytes
        self.counters["messages"] += 1
        if len(frames) < count:
            self.counters["bad_messages"] += 1
            del frames
            limit = 2 + codec.MAX_DATA_FRAMES
            why = (f"expected 2 to {limit} frames (header, MAC, data), got {count}"
                   if count > limit else f"message of {count} frames is {nbytes} bytes in all "
                   f"(max {self._max_message_bytes} here)")
            self._reject("bad_message", first, identity, f"{why}: dropped as it was read")
            self._trim(nbytes)
            return
        payload = [f.bytes for f in frames[:2]] + [f.buffer for f in frames[2:]]
        del frames  # nothing of a refused message is kept
        try:
            header = codec.verify(payload, secret=self._secret,
                                  max_frame_bytes=self._max_frame_bytes,
                                  max_message_bytes=self._max_message_bytes)
        except AuthError as e:
            self.counters["auth_failures"] += 1
            address = self._reject("auth_failure", first, identity, str(e))
            if self._may_refuse(address or identity):
                self._send(identity, [AUTH_REFUSED])
            self._trim(nbytes)
            return
        except ProtocolError as e:
            self.counters["bad_messages"] += 1
            self._reject("bad_message", first, identity, str(e))
            self._trim(nbytes)
            return
        try:
            msg = codec.parse(header, job=self._job, data=payload[2:], typed=self._typed)
        except ProtocolError as e:
            self.counters["bad_messages"] += 1
            self._reject("bad_message", first, identity, str(e))
            # The header is authentic: its id, if readable, tells the client what failed.
            self._reply(identity, codec.peek(header, "id"), Reply("error", {
                "message": str(e)[:MAX_ERROR_CHARS], "error": type(e).__name__}))
            return
        if self.term and msg.term != self.term and msg.kind not in self.term_free:
            # Signed for another coordinator (a capture from before a failover, or a peer
            # that has not heard of it yet): refused, and answered so the peer can tell.
            self.counters["stale_terms"] += 1
            why = (f"{msg.kind} signed for coordinator term {msg.term or 'none'}; this "
                   f"{self.name} is term {self.term}"
                   + (": it was replaced (failover)" if msg.term > self.term
                      else ": refused (sent to an earlier coordinator, or a replay)"))
            if msg.term:
                self._reject("stale_term", first, identity, why)
            else:
                # A client that has not learnt the term yet (its first message after this
                # server started): the answer below tells it; nothing to warn about.
                log.debug("%s: %s", self.name, why)
            self._reply(identity, msg.id, Reply("error", {"message": why,
                                                          "error": "StaleTermError"}))
            return
        try:
            self.replays.check(msg)
        except ProtocolError as e:
            # Authentic, so answered: the answer goes to the connection it came on (the
            # replayer's), never to the sender it names.
            self.counters["replays"] += 1
            self._reject("replay", first, identity, str(e))
            self._reply(identity, msg.id, Reply("error", {"message": str(e)[:MAX_ERROR_CHARS],
                                                          "error": "ProtocolError"}))
            return
        self._reply(identity, msg.id, self._answer(msg, first))

    def _trim(self, nbytes: int) -> None:
        """After a large refused message, hand the freed heap back to the OS (glibc keeps
        freed small blocks, such as a flood's many frames, resident otherwise)."""
        now = time.monotonic()
        if nbytes < TRIM_AFTER_BYTES:
            return
        if now < self._next_trim:
            self._trim_pending = True  # done when the server is next idle
            return
        self._next_trim = now + TRIM_EVERY_S
        self._trim_pending = False
        _malloc_trim()

    def _answer(self, msg: Message, first: Any) -> Reply | None:
        handler = self.handlers.get(msg.kind)
        if handler is None:
            log.warning("%s: unexpected %s message from %s; answered with an error", self.name,
                        msg.kind, msg.sender)
            return Reply("error", {"message": f"the {self.name} does not accept "
                                              f"{msg.kind!r} messages", "error": "ProtocolError"})
        try:
            answer = handler(msg)
        except FtrunError as e:
            log.warning("%s cannot answer %s from %s: %s", self.name, msg.kind,
                        _peer(_address(first), first.bytes), e)
            return Reply("error", {"message": str(e)[:MAX_ERROR_CHARS],
                                   "error": type(e).__name__})
        except Exception as e:  # noqa: BLE001 - a handler's bug must not end the loop
            self.counters["handler_errors"] += 1
            log.exception("%s: handling %s from %s failed", self.name, msg.kind,
                          _peer(_address(first), first.bytes))
            return Reply("error", {
                "message": f"the {self.name} failed on {msg.kind}: {type(e).__name__}: "
                           f"{e}"[:MAX_ERROR_CHARS], "error": "FtrunError"})
        if answer is None or isinstance(answer, Reply):
            return answer
        if isinstance(answer, Body):
            return Reply(answer.KIND, answer)
        return Reply(*answer)

    def _reply(self, identity: bytes, re: str | None, answer: Reply | None) -> None:
        if answer is None:
            return
        self._counter += 1
        try:
            out = codec.encode(answer.kind, answer.body, secret=self._secret, job=self._job,
                               sender=self._sender, re=re, data=answer.frames,
                               session=self._session, counter=self._counter, term=self.term)
        except ProtocolError as e:
            log.error("%s cannot encode its %s reply: %s", self.name, answer.kind, e)
            out = codec.encode("error", {"message": f"the {self.name} cannot reply: "
                                                    f"{e}"[:MAX_ERROR_CHARS],
                                         "error": "ProtocolError"},
                               secret=self._secret, job=self._job, sender=self._sender, re=re,
                               session=self._session, counter=self._counter, term=self.term)
        self._send(identity, out)

    def _send(self, identity: bytes, frames: list[Buffer]) -> None:
        assert self._sock is not None
        try:
            self._sock.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            log.warning("%s: reply to %s dropped: peer not reading", self.name, identity.hex())

    def _reject(self, kind: str, first: Any, identity: bytes, reason: str) -> str:
        """Log and report a refused message, rate-limited per peer (its address, over ipc
        its process; its connection where it has none), whatever the reason says: a sender
        that varies its garbage gets no more lines than one that repeats it. Returns the
        peer's address ("" where ZeroMQ gives none)."""
        address = _address(first)
        allowed, suppressed = self._warn.allow(address or identity)
        if not allowed:
            return address
        more = f" ({suppressed} more refused since, not logged)" if suppressed else ""
        log.warning("%s: %s from peer %s: %s%s", self.name, kind.replace("_", " "),
                    _peer(address, identity), reason, more)
        if self._on_reject is not None:
            self._on_reject(kind, address, reason, suppressed)
        return address

    def _may_refuse(self, peer: Any) -> bool:
        """At most a few refusals per second per peer: a flood is not echoed."""
        now = time.monotonic()
        start, count = self._refusals.get(peer, (now, 0))
        if now - start >= 1.0:
            start, count = now, 0
        if count >= MAX_AUTH_REFUSALS_PER_S:
            return False
        self._refusals[peer] = (start, count + 1)
        self._refusals.move_to_end(peer)
        while len(self._refusals) > MAX_PEERS_TRACKED:
            self._refusals.popitem(last=False)
        return True


def _peer(address: str, identity: bytes) -> str:
    return f"{address or '?'} (id {identity.hex()})"


def _address(frame: Any) -> str:
    """The peer address ZeroMQ gives a received frame ("" where it has none); read only
    when needed (a refusal, a log line), not for every message."""
    try:
        return str(frame.get("Peer-Address") or "")
    except zmq.ZMQError:
        return ""


_LIBC: Any = None


def _malloc_trim() -> None:
    """glibc's malloc_trim(0), where there is one."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 - probe: AttributeError off glibc
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)

