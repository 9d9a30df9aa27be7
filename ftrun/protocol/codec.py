"""The wire format of one message: a signed, versioned, size-limited JSON header, and binary
frames beside it bound to that signature by their digests.

A message is a ZeroMQ multipart::

    [header: UTF-8 JSON object, MAC: 32 raw bytes, data frame 1, ..., data frame n]

``MAC = HMAC-SHA256(job secret, header)``. A message with data frames carries in its header
``fd``: one digest per frame, in order, ``xxh3-128(frame, seed)`` as 32 hex digits, where
``seed`` is the first 8 bytes of ``HMAC-SHA256(job secret, "ftrun-frame-seed" || id)`` (``id``
is the message's random id). The receiver checks the MAC, then every frame against its digest;
the frames, their number, order and boundaries are thus covered by the signature without
passing their bytes through SHA-256, which runs at about 1-2 GB/s per core, while xxh3 runs at
tens of GB/s (snapshot replicas are gigabytes, sent in 4 MiB frames). Nothing is ever
unpickled.

Threat model, precisely:

- Anyone without the job secret (another job, a stray or misconfigured process, a port scan,
  a peer of a previous run) cannot have any message accepted: the header needs the secret's
  MAC, and the data frames beside a header are only those whose digests it carries. Pasting
  other data frames beside a captured authentic header requires frames with the same keyed
  xxh3-128: the key is derived from the secret and the message id, so it is unknown to them.
- Corruption on the way (a NIC, a switch, memory, a buffer that changed while it was sent) is
  refused like a forgery: a 128-bit digest misses it with probability 2^-128.
- Replays: every message carries its sender's session (``sn``, random per
  :class:`~ftrun.protocol.transport.Client` and per process) and a counter (``n``) in the
  signed header; a server takes each (sender, session) counter once and in increasing order
  (:class:`ReplayGuard`), and the clock check refuses what is older than the guard remembers.
  The guard lives in the server's memory: a coordinator that fails over to another launcher
  (``--rdzv-backend etcd``) starts with an empty one. So a message to the coordinator also
  carries, signed, the coordinator *term* it was sent to (``tm``: the etcd revision at which
  that coordinator took its role, growing with every holder); a coordinator with a term takes
  only messages of its own term (:class:`~ftrun.protocol.transport.Server`), and a client
  only replies of the term it talks to. A message captured before a failover is refused
  after it.
- Not protected: confidentiality (nothing is encrypted; anyone on the path reads snapshots
  and messages); an active attacker on the path who can find, for a frame, another one with the same xxh3-128
  under a key they do not know. xxh3 is fast, not cryptographic: it has no proof of being a
  pseudo-random function, so integrity of *data frames* against a determined active attacker
  rests on that unproven property (headers, and so every control decision, rest on
  HMAC-SHA256). A network where such attackers sit needs an encrypted, authenticated tunnel
  (WireGuard, IPsec) under ftrun. Every holder of the secret (every node of the job) is
  trusted.

The header carries ``v`` (protocol version), ``kind``, ``job`` (run id), ``sender``, ``ts``
(unix time, float), ``id`` (random hex), ``sn`` (the sender's session, random hex), ``n``
(the session's message counter, from 1), ``tm`` (the coordinator term, when there is one),
``body`` (an object, see
:mod:`ftrun.protocol.messages`), ``fd`` when there are data frames and, in a reply, ``re``:
the id of the request it answers.

:func:`decode` checks, in order: frame count and sizes, MAC, frame digests, JSON, version,
kind, header fields, job, body schema (every number finite), clock skew. :func:`verify` (the
first three) and :func:`parse` (the rest) are exposed separately so a server can tell
unauthenticated garbage (never answered) from an authentic but invalid message (answered with
an ``error``); a server then refuses replays (:class:`ReplayGuard`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from typing import Annotated, Any, Union

import msgspec
import msgspec.inspect as mi
import xxhash

from ftrun.errors import AuthError, ProtocolError
from ftrun.protocol import messages
from ftrun.protocol.messages import (
    BODIES,
    UNSET,
    Body,
    Float,
    Item,
    Message,
    Str,
    UnsetType,
    _short,
    _walk,
    validate,
)

# 2: replies carry ``re``; binary frames may follow the MAC.
# 3: the MAC covers the header only; data frames are bound to it by keyed digests (``fd``).
# 4: the header carries the sender's session ``sn`` and counter ``n`` (replays are refused).
# (Typed bodies, decoded with msgspec, kept version 4: the bytes on the wire and what is
# accepted are the same.)
# 5: launchers report through aggregators (``aggregate``/``aggregate_reply``; ``plan`` and
#    ``aggr_addr`` in heartbeats and keep-alives) and ranks ask their store for the job's
#    holdings (``survey_request``/``survey_reply``).
VERSION = 5
# The largest JSON header (with its MAC), and the most and largest binary frames a message may
# carry. An endpoint also caps a whole message (header, MAC and data frames together, see
# :func:`total_cap`): the coordinator takes MAX_MESSAGE_BYTES in all; an endpoint that takes
# data frames of up to F bytes takes F + MAX_MESSAGE_BYTES in all, which holds every
# snapshot message (a 4 MiB replica chunk; 4 such chunks in one shard read; a manifest and
# its hash table).
MAX_MESSAGE_BYTES = 1 << 20
MAX_DATA_FRAMES = 64
MAX_FRAME_BYTES = 64 << 20
MAX_CLOCK_SKEW_S = 300.0
# A server remembers a session's highest counter this long after its last message: a replay
# of an older message of it carries a timestamp at most MAX_CLOCK_SKEW_S ahead of the server's
# clock when it first came, so the clock check refuses it once twice the skew has passed.
SESSION_KEPT_S = 2 * MAX_CLOCK_SKEW_S + 60.0
MAX_SESSIONS = 1 << 17
MAC_BYTES = 32
FRAME_SEED_LABEL = b"ftrun-frame-seed"
# The fixed, unsigned, one-frame answer a server gives a message whose MAC is wrong. It
# carries no information beyond "not accepted" and lets a client say "wrong secret" instead of
# waiting for a timeout.
AUTH_REFUSED = b"ftrun-auth-refused"

Buffer = Union[bytes, bytearray, memoryview]

_HEX = re.compile(r"^[0-9a-f]{1,64}$")
_HEX_DIGITS = "0123456789abcdef"
# 1 to 64 lower-case hex digits: the length checked at decode, the digits after it (a regex
# in the decoder costs more than the rest of the header together).
Hex = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class HeaderFields(Item):
    """The header's fields but ``body`` (whose kind decides its type)."""

    v: int
    kind: Str
    job: Str
    sender: Str
    ts: Float
    id: Hex
    sn: Hex
    n: Annotated[int, msgspec.Meta(ge=1)]
    re: Hex | UnsetType = UNSET
    tm: Annotated[int, msgspec.Meta(ge=1)] | UnsetType = UNSET
    fd: Annotated[list[Str], messages.Items] | UnsetType = UNSET


class Header(HeaderFields, kw_only=True):
    """A header as decoded: the body left as raw JSON for its kind's decoder."""

    body: msgspec.Raw


class _FrameDigests(msgspec.Struct):
    id: str
    fd: list[str]


_HEADER_DECODER = msgspec.json.Decoder(Header)
_DIGESTS_DECODER = msgspec.json.Decoder(_FrameDigests)
_PLAIN_DECODER = msgspec.json.Decoder()


def _builtin(obj: Any) -> Any:
    """A subclass of a JSON type (a float subclass of a unit, say) as that type."""
    for base in (bool, int, float, str):
        if isinstance(obj, base):
            return base(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON")


_ENCODER = msgspec.json.Encoder(enc_hook=_builtin)
_HEADER_NAMES = frozenset(f.encode_name for f in mi.type_info(Header).fields)  # type: ignore[attr-defined]
# Which kinds a receiving end takes as typed bodies: all, or those named.
Typed = Union[bool, Collection[str]]


def total_cap(max_frame_bytes: int, max_message_bytes: int | None = None) -> int:
    """The most a whole message may carry at an endpoint taking data frames of up to
    ``max_frame_bytes``: ``max_message_bytes`` when given, else a header alone when its
    frames are no larger than a header (the coordinator), else one largest frame's worth of
    data beside a header."""
    if max_message_bytes is not None:
        return max_message_bytes
    if max_frame_bytes <= MAX_MESSAGE_BYTES:
        return MAX_MESSAGE_BYTES
    return max_frame_bytes + MAX_MESSAGE_BYTES


def new_session() -> str:
    """A fresh session id (random, 16 hex digits)."""
    return secrets.token_hex(8)


def new_id() -> str:
    """A fresh message id (random, 16 hex digits)."""
    return secrets.token_hex(8)


_PADS: dict[bytes, tuple[Any, Any]] = {}


def _mac(secret: bytes, header: Buffer) -> bytes:
    """HMAC-SHA256 (RFC 2104) from the secret's inner and outer hash states, computed once
    per secret: half the cost of keying an HMAC for every message."""
    pads = _PADS.get(secret)
    if pads is None:
        key = hashlib.sha256(secret).digest() if len(secret) > 64 else secret
        key = key.ljust(64, b"\0")
        pads = (hashlib.sha256(bytes(b ^ 0x36 for b in key)),
                hashlib.sha256(bytes(b ^ 0x5C for b in key)))
        if len(_PADS) >= 64:  # a process knows one or two secrets; tests make more
            _PADS.clear()
        _PADS[secret] = pads
    inner, outer = pads[0].copy(), pads[1].copy()
    inner.update(header)
    outer.update(inner.digest())
    return outer.digest()


def frame_digests(secret: bytes, msg_id: str, data: Sequence[Buffer]) -> list[str]:
    """The ``fd`` of a message: each data frame's xxh3-128 under a key from the secret and
    the message id."""
    key = hmac.new(secret, FRAME_SEED_LABEL + msg_id.encode(), hashlib.sha256).digest()
    seed = int.from_bytes(key[:8], "big")
    return [xxhash.xxh3_128_hexdigest(frame, seed) for frame in data]


def _nbytes(frame: Buffer) -> int:
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)


def encode(kind: str, body: Mapping[str, Any] | Body, *, secret: bytes, job: str,
           sender: str, id: str | None = None, re: str | None = None,
           data: Sequence[Buffer] = (), session: str | None = None,
           counter: int = 1, term: int = 0) -> list[Buffer]:
    """Build the signed frames of one message; the body (the kind's :class:`Body`, or the
    plain object it stands for) is validated like on receipt.

    ``id`` defaults to a fresh one; ``re`` is the id of the request this replies to; ``data``
    are binary frames sent (uncopied) after the MAC, bound to it by their digests: they
    must not change until sent. ``session`` and ``counter`` are the sender's session and this
    message's number in it (a server takes each number once, in increasing order); without a
    session, the message is alone in a fresh one. ``term``: the coordinator term the message
    is bound to (0: none).
    """
    cls = BODIES.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}; known: {', '.join(sorted(BODIES))}")
    if isinstance(body, Body):
        if type(body) is not cls:
            raise ProtocolError(f"a {type(body).__name__} is not the body of {kind!r} "
                                f"(that is {cls.__name__})")
        validate(cls, messages.to_dict(body), f"{kind} body")
    else:
        validate(cls, body, f"{kind} body")
    if len(data) > MAX_DATA_FRAMES:
        raise ProtocolError(f"{kind} message has {len(data)} data frames (max {MAX_DATA_FRAMES})")
    for i, frame in enumerate(data):
        if _nbytes(frame) > MAX_FRAME_BYTES:
            raise ProtocolError(f"{kind} data frame {i} is {_nbytes(frame)} bytes "
                                f"(max {MAX_FRAME_BYTES}); send it in smaller chunks")
    header_obj: dict[str, Any] = {
        "v": VERSION,
        "kind": kind,
        "job": job,
        "sender": sender,
        "ts": time.time(),
        "id": new_id() if id is None else id,
        "sn": new_session() if session is None else session,
        "n": counter,
        "body": body,
    }
    if re is not None:
        header_obj["re"] = re
    if term:
        header_obj["tm"] = term
    if data:
        header_obj["fd"] = frame_digests(secret, header_obj["id"], data)
    try:
        header = _ENCODER.encode(header_obj)
    except (TypeError, ValueError, msgspec.EncodeError) as e:
        raise ProtocolError(f"{kind} body is not JSON-serialisable: {e}") from e
    if len(header) + MAC_BYTES > MAX_MESSAGE_BYTES:
        raise ProtocolError(
            f"{kind} message is {len(header) + MAC_BYTES} bytes (max {MAX_MESSAGE_BYTES})"
        )
    return [header, _mac(secret, header), *data]


def verify(frames: Sequence[Buffer], *, secret: bytes,
           max_frame_bytes: int = MAX_FRAME_BYTES,
           max_message_bytes: int | None = None) -> bytes:
    """Frame count, sizes (each data frame, and the whole message: see :func:`total_cap`)
    and MAC: return the authenticated header bytes.

    Everything this raises concerns an unauthenticated peer and must not be answered with
    details. A wrong MAC raises :class:`AuthError`, the rest :class:`ProtocolError`.
    """
    if not 2 <= len(frames) <= 2 + MAX_DATA_FRAMES:
        raise ProtocolError(f"expected 2 to {2 + MAX_DATA_FRAMES} frames (header, MAC, data), "
                            f"got {len(frames)}")
    header, mac, data = bytes(frames[0]), bytes(frames[1]), frames[2:]
    if len(header) + len(mac) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message header is {len(header) + len(mac)} bytes "
                            f"(max {MAX_MESSAGE_BYTES})")
    if len(mac) != MAC_BYTES:
        raise ProtocolError(f"the MAC frame is {len(mac)} bytes, not {MAC_BYTES}")
    total = len(header) + len(mac)
    for i, frame in enumerate(data):
        size = _nbytes(frame)
        if size > max_frame_bytes:
            raise ProtocolError(f"data frame {i} is {size} bytes (max {max_frame_bytes} here)")
        total += size
    cap = total_cap(max_frame_bytes, max_message_bytes)
    if total > cap:
        raise ProtocolError(f"message of {len(frames)} frames is {total} bytes in all (max "
                            f"{cap} here)")
    if not hmac.compare_digest(mac, _mac(secret, header)):
        raise AuthError(
            "message not signed with this job's secret (wrong FTRUN_SECRET or state directory, "
            "or not an ftrun peer)"
        )
    if data:
        _check_frames(secret, header, data)
    return header


def _check_frames(secret: bytes, header: bytes, data: Sequence[Buffer]) -> None:
    """The data frames beside an authentic header are the ones its ``fd`` names."""
    try:
        digests = _DIGESTS_DECODER.decode(header)
        msg_id, want = digests.id, digests.fd
        ok = all(d.isascii() for d in want)
    except msgspec.DecodeError:
        ok = False
    if not ok:
        raise AuthError(f"{len(data)} data frame(s) beside a header that names no digests for "
                        "them: not an ftrun peer of this version")
    if len(want) != len(data):
        raise AuthError(f"{len(data)} data frame(s) beside a header signed for {len(want)}: "
                        "frames added or dropped on the way")
    got = frame_digests(secret, msg_id, data)
    bad = [str(i) for i, (a, b) in enumerate(zip(got, want, strict=True))
           if not hmac.compare_digest(a, b)]
    if bad:
        raise AuthError(f"data frame(s) {', '.join(bad[:8])} do not match the digests their "
                        "signed header carries: altered on the way, or not the frames signed (a "
                        "sender's buffer that changed before it went out)")


def parse(header: bytes, *, job: str, now: float | None = None,
          data: Sequence[Buffer] = (), typed: Typed = False) -> Message:
    """Decode and validate authenticated header bytes (see :func:`verify`) in one step;
    ``data`` are the message's data frames, verified with it. ``typed``: the kinds (all:
    True) whose body the caller takes as its :class:`~ftrun.protocol.messages.Body`; the
    others come as plain objects (validated the same)."""
    try:
        h = _HEADER_DECODER.decode(header)
    except msgspec.DecodeError as e:
        _explain_header(header, job, str(e))
        raise AssertionError("unreachable") from None
    if h.v != VERSION:
        raise _version_error(h.v)
    if h.id.strip(_HEX_DIGITS) or h.sn.strip(_HEX_DIGITS) or (
            h.re is not UNSET and h.re.strip(_HEX_DIGITS)):
        _explain_header(header, job, "id, sn or re is not a short hex string")
    body_decoder = messages._DECODERS.get(h.kind)
    if body_decoder is None:
        raise ProtocolError(f"unknown message kind {_short(h.kind)}")
    if h.job != job:
        raise ProtocolError(f"message is for job {_short(h.job)}, this is job {job!r}")
    try:
        body = body_decoder.decode(h.body)
    except msgspec.DecodeError as e:
        _explain_header(header, job, str(e))
        raise AssertionError("unreachable") from None
    if typed is not True and (typed is False or h.kind not in typed):
        body = _PLAIN_DECODER.decode(h.body)
    current = time.time() if now is None else now
    skew = h.ts - current
    if not abs(skew) <= MAX_CLOCK_SKEW_S:
        raise ProtocolError(
            f"message timestamp is {skew:+.0f} s off this host's clock (max "
            f"{MAX_CLOCK_SKEW_S:.0f} s): a replay, or clocks out of sync (run NTP)"
        )
    return Message(
        kind=h.kind,
        job=h.job,
        sender=h.sender,
        ts=h.ts,
        id=h.id,
        body=body,
        re=None if h.re is UNSET else h.re,
        frames=tuple(data),
        session=h.sn,
        counter=h.n,
        term=0 if h.tm is UNSET else h.tm,
    )


def _version_error(version: Any) -> ProtocolError:
    return ProtocolError(
        f"message has protocol version {_short(version)}; this ftrun speaks version "
        f"{VERSION}: the peer runs another ftrun release; run the same release on every "
        "node and for `ftrun status`"
    )


def _explain_header(header: bytes, job: str, decoder_says: str) -> None:
    """Raise the ProtocolError naming what is wrong with a header the typed decoder refused,
    checking in the order a reader would: JSON, version, kind, fields, job, body (the cold
    path: one more walk, on a refused message only)."""
    try:
        obj = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ProtocolError(f"header is not UTF-8 JSON: {_short(str(e), 120)}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"header must be a JSON object, got {type(obj).__name__}")
    version = obj.get("v")
    if version != VERSION or isinstance(version, bool):
        raise _version_error(version)
    kind = obj.get("kind")
    if not isinstance(kind, str) or kind not in BODIES:
        raise ProtocolError(f"unknown message kind {_short(kind)}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise ProtocolError(f"header.body must be an object, got {type(body).__name__}")
    unknown = sorted(set(obj) - _HEADER_NAMES)
    if unknown:
        raise ProtocolError(f"header has unknown field(s) {', '.join(map(repr, unknown))}")
    fields = {k: v for k, v in obj.items() if k != "body"}
    _walk(fields, mi.type_info(HeaderFields), "header", 0)
    if obj["job"] != job:
        raise ProtocolError(f"message is for job {_short(obj['job'])}, this is job {job!r}")
    for field in ("id", "re", "sn"):
        if field in obj and not _HEX.match(obj[field]):
            raise ProtocolError(f"message {field} {_short(obj[field])} is not a short hex string")
    if obj["n"] < 1:
        raise ProtocolError(f"message counter n={obj['n']} is not positive")
    _walk(body, mi.type_info(BODIES[kind]), f"{kind} body", 0)
    raise ProtocolError(f"invalid message: {_short(decoder_says, 200)}")


class ReplayGuard:
    """Takes each (sender, session, counter) of authentic messages once, in increasing order.

    One entry per (sender, session): its highest counter and when it was last seen, kept
    :data:`SESSION_KEPT_S` after that (older messages of it fail the clock check) and at most
    ``max_sessions`` of them (the least recently seen goes first, counted in
    ``forgotten_early``: its replays are then refused by the clock check only). Each check is
    amortised O(1).

    What this assumes: a session's messages arrive in the order they were numbered. A client
    numbers them under the lock it sends under, and ZeroMQ keeps the order of one
    connection; so only a message still in flight on a connection the client dropped (it
    reconnects after a request timed out) can arrive after a later one, and is then refused
    like a replay: it counts as lost, which its sender survives (a request is resent with a
    new number, and what is sent without waiting is periodic).
    """

    def __init__(self, kept_s: float = SESSION_KEPT_S, max_sessions: int = MAX_SESSIONS) -> None:
        self.kept_s = kept_s
        self.max_sessions = max_sessions
        self.forgotten_early = 0  # sessions dropped for room before their time
        self._seen: OrderedDict[tuple[str, str], tuple[int, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def check(self, msg: Message, now: float | None = None) -> None:
        """Raise ProtocolError when ``msg`` is a replay (or out of order); else record it.
        ``now`` is a monotonic time."""
        t = time.monotonic() if now is None else now
        seen = self._seen
        key = (msg.sender, msg.session)
        last = seen.get(key)
        if last is not None and msg.counter <= last[0]:
            raise ProtocolError(
                f"replayed or out-of-order message: {msg.kind} number {msg.counter} of "
                f"{msg.sender!r}'s session {msg.session} came after number {last[0]}"
            )
        seen[key] = (msg.counter, t)
        seen.move_to_end(key)
        # Evict from the least recently seen end: amortised O(1) per message.
        while seen:
            oldest_key, (_, oldest_t) = next(iter(seen.items()))
            if t - oldest_t <= self.kept_s and len(seen) <= self.max_sessions:
                break
            if t - oldest_t <= self.kept_s:
                self.forgotten_early += 1
            seen.popitem(last=False)


def peek(header: bytes, field: str) -> str | None:
    """``id`` or ``re`` of an authenticated header that failed :func:`parse`, if readable."""
    try:
        value = json.loads(header.decode("utf-8")).get(field)
    except (UnicodeDecodeError, ValueError, RecursionError, AttributeError):
        return None
    return value if isinstance(value, str) and _HEX.match(value) else None


def decode(frames: Sequence[Buffer], *, secret: bytes, job: str, now: float | None = None,
           max_frame_bytes: int = MAX_FRAME_BYTES, max_message_bytes: int | None = None,
           replays: ReplayGuard | None = None, typed: Typed = False) -> Message:
    """Authenticate and validate one message; raise AuthError or ProtocolError (also for a
    replay, when given the ``replays`` guard of the receiving end)."""
    header = verify(frames, secret=secret, max_frame_bytes=max_frame_bytes,
                    max_message_bytes=max_message_bytes)
    msg = parse(header, job=job, now=now, data=frames[2:], typed=typed)
    if replays is not None:
        replays.check(msg)
    return msg
