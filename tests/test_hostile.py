"""Hostile input against a real transport.Server, over loopback tcp and ipc: replayed
messages, numbers that are not finite, floods of refused messages, and messages whose frames
are each small enough but too large together."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from conftest import null_greeting, wait_for
from test_transport import JOB, SECRET
from test_transport import Serving as TransportServing

from ftrun import protocol
from ftrun.errors import ProtocolError, UnreachableError
from ftrun.protocol import codec, handshake, transport
from ftrun.protocol.transport import Client, Reply, Server

pytestmark = pytest.mark.timeout(120)

HEARTBEAT = {"node_id": "n/1", "host": "n", "pid": 1, "state": "healthy", "group_rank": 0,
             "group_world_size": 2, "restarts": 0, "max_restarts": 3, "last_error": None,
             "workers": [{"local_rank": 0, "rank": 0, "pid": 10, "state": "healthy",
                          "exitcode": None, "progress_age_s": 0.5}]}


class Serving(TransportServing):
    """A real Server whose handlers record what they were given, served from a thread."""

    def __init__(self, url: str, **kw: Any) -> None:
        self.seen: list[protocol.Message] = []
        self.rejects: list[tuple[str, str, str, int]] = []
        super().__init__(url, {"heartbeat": self._record, "bye": self._record,
                               "snap_flush": self._record},
                         on_reject=lambda *a: self.rejects.append(a), **kw)

    def _record(self, msg: protocol.Message) -> Reply:
        self.seen.append(msg)
        return Reply("ack", {"re": msg.id})


@pytest.fixture(params=["ipc", "tcp"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/s.sock" if request.param == "ipc" else "tcp://127.0.0.1:*"


@pytest.fixture
def serving(url: str) -> Iterator[Serving]:
    s = Serving(url)
    yield s
    s.close()


class Raw:
    """A bare DEALER: sends whatever frames it is given, as a replayer or a flooder would.
    It passes the handshake (the token crosses the network in clear: a peer that captured
    messages has it too) unless ``secret`` is None."""

    def __init__(self, url: str, secret: bytes | None = SECRET) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if secret is not None:
            handshake.join(self.sock, secret)
        self.sock.connect(url)

    def send(self, frames: list[Any]) -> None:
        self.sock.send_multipart(frames)

    def answer(self, timeout_s: float = 10.0) -> protocol.Message:
        assert self.sock.poll(int(timeout_s * 1000)), "the server did not answer"
        return protocol.decode(self.sock.recv_multipart(), secret=SECRET, job=JOB)

    def close(self) -> None:
        self.sock.close(0)


def signed(header: dict[str, Any]) -> list[bytes]:
    """A header signed with the job's secret, serialised as a peer might (NaN allowed)."""
    raw = json.dumps(header).encode()
    return [raw, hmac.new(SECRET, raw, hashlib.sha256).digest()]


def header(kind: str, body: dict[str, Any], **over: Any) -> dict[str, Any]:
    h = {"v": protocol.VERSION, "kind": kind, "job": JOB, "sender": "launcher:n/1",
         "ts": time.time(), "id": codec.new_id(), "sn": "5e5510", "n": 1, "body": body}
    h.update(over)
    return h


# -- replays -------------------------------------------------------------------------------------


def test_a_replayed_message_is_refused(serving: Serving) -> None:
    """An authentic bye and heartbeat, captured and sent again within the clock window from
    another connection, are refused; the real sender's next messages still pass."""
    bye = [bytes(f) for f in protocol.encode(
        "bye", {"node_id": "n/1", "state": "succeeded", "exitcode": 0}, secret=SECRET, job=JOB,
        sender="launcher:n/1", session="a11ce", counter=7)]
    beat = [bytes(f) for f in protocol.encode(
        "heartbeat", HEARTBEAT, secret=SECRET, job=JOB, sender="launcher:n/1",
        session="a11ce", counter=3)]
    node, replayer = Raw(serving.url), Raw(serving.url)
    try:
        node.send(bye)
        assert node.answer().kind == "ack"
        replayer.send(bye)
        reply = replayer.answer()
        assert reply.kind == "error" and "replayed" in reply.body["message"]
        assert "number 7" in reply.body["message"] and "after number 7" in reply.body["message"]
        # An older message of the same session (an old heartbeat) is refused too.
        replayer.send(beat)
        assert "number 3" in replayer.answer().body["message"]
        # The same counter under another session, or the next counter, passes.
        node.send([bytes(f) for f in protocol.encode(
            "heartbeat", HEARTBEAT, secret=SECRET, job=JOB, sender="launcher:n/1",
            session="b0b", counter=7)])
        assert node.answer().kind == "ack"
        node.send([bytes(f) for f in protocol.encode(
            "heartbeat", HEARTBEAT, secret=SECRET, job=JOB, sender="launcher:n/1",
            session="a11ce", counter=8)])
        assert node.answer().kind == "ack"
        # Another sender naming the same session is its own entry.
        node.send([bytes(f) for f in protocol.encode(
            "snap_flush", {"rank": 0}, secret=SECRET, job=JOB, sender="rank:0",
            session="a11ce", counter=1)])
        assert node.answer().kind == "ack"
    finally:
        node.close()
        replayer.close()
    assert [(m.kind, m.session, m.counter) for m in serving.seen] == [
        ("bye", "a11ce", 7), ("heartbeat", "b0b", 7), ("heartbeat", "a11ce", 8),
        ("snap_flush", "a11ce", 1)]
    assert serving.server.counters["replays"] == 2
    assert serving.rejects and serving.rejects[0][0] == "replay"


def test_a_client_numbers_its_messages_and_keeps_its_session_across_reconnects(
        url: str) -> None:
    """Client.request resends on a fresh connection after a timeout: the resend carries the
    same session, the next number and the same id, so it is taken and answers the request."""
    calls: list[protocol.Message] = []

    def first_unanswered(msg: protocol.Message) -> Reply | None:
        calls.append(msg)
        return None if len(calls) == 1 else Reply("ack", {"re": msg.id})

    server = Server("test server", SECRET, JOB, {"snap_flush": first_unanswered},
                    sender="server")
    bound = server.bind(url)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            server.serve_once(0.02)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    c = Client(bound, SECRET, JOB, "rank:0")
    try:
        assert c.request("snap_flush", {"rank": 0}, "ack", 0.5, attempts=3).kind == "ack"
        assert c.send("snap_flush", {"rank": 1})
        wait_for(lambda: len(calls) == 3, 10, "the message sent without waiting")
    finally:
        c.close()
        stop.set()
        thread.join(5)
        server.close()
    assert len({m.session for m in calls}) == 1 and calls[0].session
    assert [m.counter for m in calls] == [1, 2, 3]
    assert calls[0].id == calls[1].id != calls[2].id
    assert server.counters["replays"] == 0


def test_a_replayed_reply_is_delivered_once(url: str) -> None:
    """A reply to a message sent without waiting goes to on_reply once; the same reply sent
    again (a replay towards the client) is dropped."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    served = handshake.serve(router, SECRET, "replayer")
    router.bind(url)
    bound = router.getsockopt_string(zmq.LAST_ENDPOINT)
    got: list[protocol.Message] = []
    c = Client(bound, SECRET, JOB, "launcher:n/1", on_reply=got.append)
    try:
        sent = c.send("heartbeat", HEARTBEAT)
        assert sent
        assert router.poll(10000)
        identity, *_ = router.recv_multipart()
        reply = [bytes(f) for f in protocol.encode(
            "directives", {"directives": [{"id": "d1", "action": "restart", "data": {}}]},
            secret=SECRET, job=JOB, sender="coordinator", re=sent)]
        router.send_multipart([identity, *reply])
        router.send_multipart([identity, *reply])
        assert c.poll(10.0, first=True) == 1
        c.poll(0.3)  # the copy, if it were taken, arrives within this
    finally:
        c.close()
        router.close(0)
        served.release()
    assert [m.re for m in got] == [sent]


def test_replay_guard_forgets_sessions_only_after_the_clock_window() -> None:
    guard = codec.ReplayGuard(kept_s=100.0, max_sessions=3)

    def msg(session: str, n: int) -> protocol.Message:
        return protocol.Message(kind="bye", job=JOB, sender="s", ts=0.0, id="ab",
                                body={}, session=session, counter=n)

    guard.check(msg("a", 5), now=0.0)
    with pytest.raises(ProtocolError, match="replayed"):
        guard.check(msg("a", 5), now=99.0)
    guard.check(msg("b", 1), now=150.0)  # "a" not seen for 150 s: forgotten
    assert len(guard) == 1
    guard.check(msg("a", 1), now=150.0)
    for s in ("c", "d", "e"):  # room for 3: the least recently seen goes first
        guard.check(msg(s, 1), now=151.0)
    assert len(guard) == 3 and guard.forgotten_early == 2
    assert codec.SESSION_KEPT_S > 2 * codec.MAX_CLOCK_SKEW_S


# -- numbers that are not finite ----------------------------------------------------------------


@pytest.mark.parametrize(("kind", "body", "over", "field"), [
    ("heartbeat", HEARTBEAT, {"ts": float("nan")}, "header.ts"),
    ("heartbeat", HEARTBEAT, {"ts": float("inf")}, "header.ts"),
    ("heartbeat", {**HEARTBEAT, "workers": [{**HEARTBEAT["workers"][0],
                                             "progress_age_s": float("nan")}]}, {},
     r"heartbeat body.workers\[0\].progress_age_s"),
    ("heartbeat", {**HEARTBEAT, "extra": {"a": [1, {"b": [float("-inf")]}]}}, {},
     r"heartbeat body.extra.a\[1\].b\[0\]"),
    ("snap_flush", {"rank": float("nan")}, {}, "snap_flush body.rank"),
])
def test_numbers_must_be_finite(serving: Serving, kind: str, body: dict[str, Any],
                                over: dict[str, Any], field: str) -> None:
    raw = Raw(serving.url)
    try:
        raw.send(signed(header(kind, body, **over)))
        reply = raw.answer()
    finally:
        raw.close()
    assert reply.kind == "error", reply.body
    assert field.replace("\\", "") in reply.body["message"], reply.body["message"]
    assert not serving.seen
    # The sender's own library refuses them before sending, naming the field too.
    if not over:
        with pytest.raises(ProtocolError, match=field):
            protocol.encode(kind, body, secret=SECRET, job=JOB, sender="x")


def test_numbers_that_overflow_to_infinity() -> None:
    """A literal too large for a float (1e999) parses as infinity: refused like one."""
    body = {**HEARTBEAT, "workers": [{**HEARTBEAT["workers"][0], "progress_age_s": "BIG"}]}
    for doc, big, match in ((header("heartbeat", body), "1e999",
                             r"workers\[0\].progress_age_s is inf"),
                            (header("heartbeat", HEARTBEAT, ts="BIG"), "-1e999",
                             "header.ts is -inf")):
        raw = json.dumps(doc).replace('"BIG"', big).encode()
        with pytest.raises(ProtocolError, match=match):
            protocol.decode([raw, hmac.new(SECRET, raw, hashlib.sha256).digest()],
                            secret=SECRET, job=JOB)


# -- floods ---------------------------------------------------------------------------------------


def test_a_flood_of_varied_garbage_is_logged_once_per_peer(
        url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """An unauthenticated sender varying the frame count (and so the reason text) gets one
    log line and one on_reject per window; the next one let through carries the count of
    those suppressed; a real client is served throughout."""
    monkeypatch.setattr(transport, "WARN_EVERY_S", 3600.0)
    s = Serving(url)
    flood = Raw(s.url)
    good = Client(s.url, SECRET, JOB, "launcher:n/2")
    n = 2000
    try:
        with caplog.at_level(logging.WARNING, logger=transport.__name__):
            for i in range(n):
                flood.send([b"x" * (i % 50)] * (1 + i % 70))
            assert good.request("heartbeat", HEARTBEAT, "ack", 10.0).kind == "ack"
            wait_for(lambda: s.server.counters["messages"] >= n + 1, 30, "the flood read")
            early = len(s.rejects)
            # The window ends (here: at once); the next refused message is let through with
            # the count of those held back.
            s.server._warn.every_s = 0.0
            flood.send([b"again"])
            wait_for(lambda: len(s.rejects) > early, 30, "a refusal after the window")
    finally:
        flood.close()
        good.close()
        s.close()
    assert s.server.counters["bad_messages"] + s.server.counters["auth_failures"] >= n
    assert early == 1, s.rejects  # one per window, however the flood varied
    assert len(s.rejects) == 2 and s.rejects[-1][3] == n - 1, s.rejects
    lines = [r.getMessage() for r in caplog.records if "from peer" in r.getMessage()]
    assert len(lines) == len(s.rejects) and "more refused since" in lines[-1]


def test_a_flood_from_many_peers_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """From 40 addresses (127.0.0.2 to .41): at most MAX_REFUSAL_REPORTS are reported per
    window in all, and at most MAX_PEERS_TRACKED peers are remembered, the refusals of those
    forgotten counted and reported with the next one let through."""
    monkeypatch.setattr(transport, "WARN_EVERY_S", 3600.0)
    monkeypatch.setattr(transport, "MAX_PEERS_TRACKED", 8)
    monkeypatch.setattr(transport, "MAX_REFUSAL_REPORTS", 5)
    s = Serving("tcp://127.0.0.1:*")
    port = s.url.rsplit(":", 1)[1]
    flooders = [Raw(f"tcp://127.0.0.{2 + i}:0;127.0.0.1:{port}") for i in range(40)]
    try:
        for k in range(3):
            for f in flooders:
                f.send([b"garbage" * k] * (k + 1))
        wait_for(lambda: s.server.counters["messages"] >= 120, 30, "the flood read")
    finally:
        for f in flooders:
            f.close()
        s.close()
    assert len(s.rejects) == 5
    assert len({r[1] for r in s.rejects}) == 5  # five peers, one report each
    assert len(s.server._warn._last) <= 8
    held = s.server._warn.forgotten + sum(e[1] for e in s.server._warn._last.values())
    assert held + len(s.rejects) == 120


# -- the total size of a message ----------------------------------------------------------------


def test_small_frames_too_large_together_are_refused(serving: Serving) -> None:
    """At a server of small messages (the coordinator's default), data frames within the
    per-frame cap but over the total are refused before the MAC is even checked."""
    frames = [bytes(f) for f in protocol.encode(
        "snap_flush", {"rank": 0}, secret=SECRET, job=JOB, sender="rank:0",
        data=[b"d" * (400 << 10)] * 3)]
    raw = Raw(serving.url)
    try:
        raw.send(frames)
        wait_for(lambda: serving.server.counters["bad_messages"] == 1, 10, "the refusal")
        assert not raw.sock.poll(200)  # never answered
    finally:
        raw.close()
    assert "in all (max 1048576 here)" in serving.rejects[0][2]
    assert not serving.seen


def test_the_total_limit_is_configurable(url: str) -> None:
    """A server taking data frames of up to F bytes takes F + a header in all by default
    (a shard read: 4 chunks of 1 MiB under F = 4 MiB), and what max_message_bytes says when
    set."""
    s = Serving(url, max_frame_bytes=4 << 20)
    tight = Serving(url if url.startswith("tcp") else url.replace(".sock", "2.sock"),
                    max_frame_bytes=4 << 20, max_message_bytes=2 << 20)
    c, t = Client(s.url, SECRET, JOB, "rank:0"), Client(tight.url, SECRET, JOB, "rank:0")
    try:
        assert c.request("snap_flush", {"rank": 0}, "ack", 10.0,
                         frames=[b"c" * (1 << 20)] * 4).kind == "ack"
        with pytest.raises(UnreachableError):  # refused unanswered: not even authenticated
            c.request("snap_flush", {"rank": 0}, "ack", 1.0, frames=[b"c" * (2 << 20)] * 3)
        assert "in all (max 5242880 here)" in s.rejects[-1][2]
        assert t.request("snap_flush", {"rank": 0}, "ack", 10.0,
                         frames=[b"c" * (1 << 20)]).kind == "ack"
        with pytest.raises(UnreachableError):
            t.request("snap_flush", {"rank": 0}, "ack", 1.0, frames=[b"c" * (1 << 20)] * 2)
        assert "in all (max 2097152 here)" in tight.rejects[-1][2]
    finally:
        c.close()
        t.close()
        s.close()
        tight.close()
    assert [len(m.frames) for m in s.seen] == [4] and [len(m.frames) for m in tight.seen] == [1]


# -- what a peer without the secret can cost the coordinator ------------------------------------

# A peer without the job's token is refused at the handshake: nothing it sends is read, so a
# flood of any size costs the coordinator what a connection costs. Its bound under 4 x 50 MB
# of 1 KiB frames (a message of 51,200 frames each; before the handshake, one such message of
# 1 Gi made the coordinator hold 2 GB):
NO_TOKEN_PEAK_MIB = 32
# A peer that has the token (it crosses the network in clear) but not the secret passes the
# handshake, and ZeroMQ assembles each of its messages whole before the server sees the first
# frame (ZMQ_MAXMSGSIZE caps a frame, not a message's frame count). Under the 10 x 50 MB flood
# the peak is what ZeroMQ queued while the server read: +140-250 MiB on an idle host, up to the
# whole flood when the host is busy (477 MiB of frames, ~523 MiB with ZeroMQ's per-frame
# allocation): the bound is that and a margin; the server keeps at most one message's caps of
# it, drops the rest as it reads and gives the heap back when the flood ends.
FLOOD_PEAK_MIB = 600
FLOOD_KEPT_MIB = 48
_COORDINATOR = """
import sys
sys.path.insert(0, sys.argv[1])
from ftrun.coordinator.server import Coordinator
c = Coordinator("flood", bytes.fromhex(sys.argv[2]), bind_host="127.0.0.1")
c.start()
print(c.endpoint, flush=True)
sys.stdin.readline()
c.stop()
"""


def _memory_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process, in MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text()
                  .splitlines() if ":" in line)
    return (int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024)


def _flood(url: str, secret: bytes | None, messages: int) -> tuple[zmq.Socket[Any], int]:
    """A DEALER that sends up to ``messages`` messages of 50 MB as 1 KiB frames (with the
    job's handshake token when ``secret`` is given), and how many it could queue: ZeroMQ
    stops taking them (after a few seconds) when it has no connection to queue them on, as
    when the peer refused its handshake."""
    flood = zmq.Context.instance().socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.setsockopt(zmq.SNDTIMEO, 3000)
    if secret is not None:
        handshake.join(flood, secret)
    flood.connect(url)
    frame = b"x" * 1024
    for sent in range(messages):
        try:
            for _ in range(50 * 1024 - 1):
                flood.send(frame, zmq.SNDMORE)
            flood.send(frame)
        except zmq.Again:
            return flood, sent
    return flood, messages


@pytest.mark.timeout(300)
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_a_flood_costs_the_coordinator_bounded_memory() -> None:
    """Without the token: refused at the handshake, nothing read, next to no memory, the
    status answered meanwhile; raw bytes that are not ZeroMQ at all: the same. With the
    token but not the secret: every message read and refused, memory bounded and given
    back."""
    import socket
    import subprocess
    import sys

    secret = b"k" * 32
    child = subprocess.Popen(
        [sys.executable, "-c", _COORDINATOR, str(Path(__file__).resolve().parent.parent),
         secret.hex()], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    floods: list[zmq.Socket[Any]] = []
    status = None
    try:
        assert child.stdout is not None and child.stdin is not None
        endpoint = child.stdout.readline().strip()
        status = Client(endpoint, secret, "flood", "status")

        def counters() -> dict[str, int]:
            doc = status.request("status_request", {"nodes": "none"}, "status_reply", 30.0)
            return dict(doc.body["doc"]["coordinator"]["messages"])

        counters()  # warmed up: the serving loop has run
        start_rss, start_hwm = _memory_mib(child.pid)
        floods.append(_flood(f"tcp://{endpoint}", None, 4)[0])
        host, port = endpoint.rsplit(":", 1)
        greeting = null_greeting(host, int(port))  # refused and counted for sure (see there)
        with socket.create_connection((host, int(port)), timeout=10) as raw:
            try:  # 64 MiB that are not ZeroMQ's protocol: the connection is dropped
                for _ in range(64):
                    raw.sendall(b"\xff" * (1 << 20))
            except OSError:
                pass
        # The greeting without the token and the raw bytes refused at their handshake,
        # counted (the flood's DEALER too, unless it closed first: not relied on), never read;
        # the status answered meanwhile.
        wait_for(lambda: counters()["auth_failures"] >= 2, 60, "the handshakes refused")
        greeting.close()
        assert counters()["bad_messages"] == 0 and counters()["messages"] > 0
        no_token_peak = _memory_mib(child.pid)[1] - start_rss
        assert no_token_peak <= NO_TOKEN_PEAK_MIB, (start_rss, start_hwm, no_token_peak)

        flood, sent = _flood(f"tcp://{endpoint}", secret, 10)
        floods.append(flood)
        assert sent == 10
        wait_for(lambda: counters()["bad_messages"] >= 10, 120, "the flood refused")
        peak = _memory_mib(child.pid)[1] - start_rss
        wait_for(lambda: _memory_mib(child.pid)[0] - start_rss <= FLOOD_KEPT_MIB, 60,
                 f"the coordinator's memory back within {FLOOD_KEPT_MIB} MiB")
        assert peak <= FLOOD_PEAK_MIB, (start_rss, start_hwm, peak)
    finally:
        for flood in floods:
            flood.close(0)
        if status is not None:
            status.close()
        if child.stdin is not None:
            child.stdin.write("\n")
            child.stdin.flush()
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(10)
