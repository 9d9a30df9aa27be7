"""The request/reply transport: id-matched replies, one error mapping, handler tables, binary
frames. The same contract runs over ipc (ranks to their store) and tcp (to the coordinator),
and the wrong-secret check runs against the real store and coordinator."""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from conftest import free_port

from ftrun import protocol
from ftrun.coordinator.client import request as coordinator_request
from ftrun.coordinator.server import Coordinator
from ftrun.errors import AuthError, FtrunError, IntegrityError, ProtocolError, UnreachableError
from ftrun.protocol import handshake, transport
from ftrun.protocol.transport import Client, Reply, Server
from ftrun.snapshot import segment as shm
from ftrun.store.store import SnapshotStore, StoreConfig

pytestmark = pytest.mark.timeout(60)

SECRET = b"k" * 32
JOB = "job-transport"


class Serving:
    """A Server with a handler table, served from a thread until the test ends."""

    def __init__(self, url: str, handlers: dict[str, transport.Handler], **kw: Any) -> None:
        self.server = Server("test server", SECRET, JOB, handlers, sender="server", **kw)
        self.url = self.server.bind(url)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.server.serve_once(0.02)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        assert not self._thread.is_alive()
        self.server.close()


def echo(msg: protocol.Message) -> Reply:
    return Reply("snap_done", {"rank": msg.body["rank"], "buffer": 0, "step": len(msg.frames),
                               "ok": True, "committed": 0}, frames=msg.frames)


def fail(msg: protocol.Message) -> Reply:
    raise RuntimeError("handler bug")


def refuse(msg: protocol.Message) -> Reply:
    raise IntegrityError("step 4 of rank 0 does not match its hashes")


def silent(msg: protocol.Message) -> None:
    return None


HANDLERS: dict[str, transport.Handler] = {
    "snap_flush": echo, "snap_claim": fail, "store_persist": refuse, "heartbeat": silent,
}


@pytest.fixture(params=["ipc", "tcp"])
def serving(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Serving]:
    url = f"ipc://{tmp_path}/s.sock" if request.param == "ipc" else "tcp://127.0.0.1:*"
    s = Serving(url, HANDLERS, max_frame_bytes=protocol.MAX_FRAME_BYTES)
    yield s
    s.close()


def client(url: str, secret: bytes = SECRET, **kw: Any) -> Client:
    return Client(url, secret, JOB, "tester", peer="test server", hint="check the test", **kw)


def test_binary_frames_travel_intact(serving: Serving) -> None:
    c = client(serving.url)
    try:
        data = [os.urandom(3 << 20), b"", bytes(range(256)) * 4]
        reply = c.request("snap_flush", {"rank": 7}, "snap_done", 5.0, frames=data)
        assert reply.body["step"] == 3 and reply.re is not None
        assert [bytes(f) for f in reply.frames] == data
    finally:
        c.close()


def test_tampered_frame_is_refused(serving: Serving) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    handshake.join(sock, SECRET)
    sock.connect(serving.url)
    try:
        frames = [bytes(f) for f in protocol.encode(
            "snap_flush", {"rank": 1}, secret=SECRET, job=JOB, sender="t",
            data=[b"chunk-0", b"chunk-1"])]
        frames[3] = b"chunk-X"
        sock.send_multipart(frames)
        assert sock.poll(5000), "no answer to a tampered frame"
        assert sock.recv_multipart() == [protocol.AUTH_REFUSED]
    finally:
        sock.close(0)
    assert serving.server.counters["auth_failures"] == 1
    c = client(serving.url)  # and the server goes on
    try:
        assert c.request("snap_flush", {"rank": 1}, "snap_done", 5.0).body["rank"] == 1
    finally:
        c.close()


def test_handler_table_errors(serving: Serving, caplog: pytest.LogCaptureFixture) -> None:
    c = client(serving.url)
    try:
        with pytest.raises(ProtocolError, match="does not accept 'bye'"):
            c.request("bye", {"node_id": "n", "state": "x", "exitcode": 0}, None, 5.0)
        with caplog.at_level(logging.ERROR, logger=transport.__name__), \
                pytest.raises(FtrunError, match="RuntimeError: handler bug"):
            c.request("snap_claim", {"rank": 0, "buffer": 0, "epoch": "e", "need_committed": 0},
                      "snap_claim_reply", 5.0)
        assert any("handling snap_claim" in r.getMessage() and r.exc_info for r in caplog.records)
        # An error raised on purpose comes back as its own class.
        with pytest.raises(IntegrityError, match="does not match its hashes"):
            c.request("store_persist", {"reason": "test"}, "ack", 5.0)
        # A reply of another kind than expected is a protocol error.
        with pytest.raises(ProtocolError, match="not ack"):
            c.request("snap_flush", {"rank": 0}, "ack", 5.0)
        # The loop survived all of it.
        assert c.request("snap_flush", {"rank": 2}, "snap_done", 5.0).body["rank"] == 2
    finally:
        c.close()
    assert serving.server.counters["handler_errors"] == 1


def test_replies_to_sends(serving: Serving, caplog: pytest.LogCaptureFixture) -> None:
    got: list[protocol.Message] = []
    c = client(serving.url, on_reply=got.append)
    try:
        with caplog.at_level(logging.WARNING, logger=transport.__name__):
            ok = c.send("snap_flush", {"rank": 3})
            bad = c.send("bye", {"node_id": "n", "state": "x", "exitcode": 0})
            assert ok and bad
            for _ in range(100):
                c.poll(0.05)
                if got and any("answered with an error" in r.getMessage()
                               for r in caplog.records):
                    break
    finally:
        c.close()
    assert [(m.kind, m.re) for m in got] == [("snap_done", ok)]
    assert any("does not accept 'bye'" in r.getMessage() for r in caplog.records)


def test_poll_first_returns_with_the_first_reply(serving: Serving) -> None:
    got: list[protocol.Message] = []
    c = client(serving.url, on_reply=got.append)
    try:
        sent = c.send("snap_flush", {"rank": 5})
        assert sent
        # Far beyond the test timeout (240 s): only a return at the reply ends this call.
        assert c.poll(3600.0, first=True) == 1
        assert [(m.kind, m.re) for m in got] == [("snap_done", sent)]
        assert c.poll(0.01, first=True) == 0  # nothing more arrives: back at the timeout
    finally:
        c.close()


def test_no_answer_is_unreachable_with_address_and_hint(serving: Serving) -> None:
    c = client(serving.url)
    try:
        with pytest.raises(UnreachableError) as e:
            c.request("heartbeat", {"node_id": "n", "host": "h", "pid": 1, "state": "s",
                                    "group_rank": None, "group_world_size": None,
                                    "restarts": 0, "max_restarts": 0, "workers": [],
                                    "last_error": None}, None, 0.2, attempts=2)
        assert serving.url in str(e.value) and "2 x 0.2 s" in str(e.value)
        assert "check the test" in str(e.value)
    finally:
        c.close()


def test_wrong_secret_is_auth_error(serving: Serving) -> None:
    c = client(serving.url, secret=b"w" * 32)
    try:
        with pytest.raises(AuthError, match="refused our secret"):
            c.request("snap_flush", {"rank": 0}, "snap_done", 5.0)
    finally:
        c.close()
    assert serving.server.counters["auth_failures"] >= 1  # at each handshake it retried


# -- replies are matched by id -----------------------------------------------------------------


class FakePeer:
    """A ROUTER that answers each request as ``answer(request)`` says: a list of
    (re, body) replies, sent in order."""

    def __init__(self, answer: Callable[[protocol.Message], list[tuple[str | None, int]]],
                 secret: bytes = SECRET) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self._served = handshake.serve(self.sock, SECRET, "fake peer")
        self.sock.bind("tcp://127.0.0.1:*")
        self.url = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._answer = answer
        self._secret = secret
        self.requests: list[protocol.Message] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            identity, *frames = self.sock.recv_multipart()
            msg = protocol.decode(frames, secret=SECRET, job=JOB)
            self.requests.append(msg)
            for re, committed in self._answer(msg):
                self.sock.send_multipart([identity, *protocol.encode(
                    "snap_claim_reply", {"ok": True, "committed": committed},
                    secret=self._secret, job=JOB, sender="fake", re=re)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)
        self._served.release()


def test_stale_replies_are_dropped() -> None:
    seen: dict[str, str] = {}
    delivered: list[protocol.Message] = []

    def answer(msg: protocol.Message) -> list[tuple[str | None, int]]:
        if msg.kind == "snap_staged":
            seen["sent"] = msg.id
            return []  # answered later, beside the next request's reply
        if "first" not in seen:
            seen["first"] = msg.id
            return []  # let the first request time out
        # Before the real reply: a late one to the timed-out request, one to nothing, and
        # the reply to the message sent without waiting.
        return [(seen["first"], 1), (None, 2), ("abcdef", 3), (seen["sent"], 4), (msg.id, 5)]

    peer = FakePeer(answer)
    c = client(peer.url, on_reply=delivered.append)
    body = {"rank": 0, "buffer": 1, "epoch": "e", "need_committed": 3}
    try:
        assert c.send("snap_staged", {"rank": 0, "buffer": 0, "step": 1, "epoch": "e"})
        with pytest.raises(UnreachableError):
            c.request("snap_claim", body, "snap_claim_reply", 0.3)
        reply = c.request("snap_claim", body, "snap_claim_reply", 5.0)
    finally:
        c.close()
        peer.close()
    assert reply.body["committed"] == 5 and reply.re == peer.requests[-1].id
    assert [m.body["committed"] for m in delivered] == [4]


def test_resent_request_keeps_its_id_and_is_answered_by_a_new_connection() -> None:
    def answer(msg: protocol.Message) -> list[tuple[str | None, int]]:
        return [] if len(peer.requests) < 3 else [(msg.id, 9)]

    peer = FakePeer(answer)
    c = client(peer.url)
    try:
        reply = c.request("snap_claim", {"rank": 0, "buffer": 1, "epoch": "e",
                                         "need_committed": 3}, "snap_claim_reply", 0.2,
                          attempts=5)
    finally:
        c.close()
        peer.close()
    assert reply.body["committed"] == 9
    assert len({m.id for m in peer.requests}) == 1 and len(peer.requests) == 3


def test_reply_signed_with_another_secret_is_auth_error() -> None:
    peer = FakePeer(lambda msg: [(msg.id, 1)], secret=b"o" * 32)
    c = client(peer.url)
    try:
        with pytest.raises(AuthError, match="not signed with our secret"):
            c.request("snap_flush", {"rank": 0}, None, 5.0)
    finally:
        c.close()
        peer.close()


def _request_in_child(c: Client, out: Any) -> None:
    try:
        out.put(c.request("snap_flush", {"rank": 5}, "snap_done", 5.0).body["rank"])
    except Exception as e:  # noqa: BLE001 - reported to the parent
        out.put(repr(e))


def test_a_forked_child_makes_its_own_socket(tmp_path: Path) -> None:
    s = Serving(f"ipc://{tmp_path}/f.sock", HANDLERS)
    c = client(s.url)
    try:
        assert c.request("snap_flush", {"rank": 4}, "snap_done", 5.0).body["rank"] == 4
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        child = ctx.Process(target=_request_in_child, args=(c, out))
        child.start()
        try:
            assert out.get(timeout=20) == 5
        finally:
            child.join(10)
            if child.is_alive():
                child.kill()
                child.join(5)
        assert c.request("snap_flush", {"rank": 6}, "snap_done", 5.0).body["rank"] == 6
    finally:
        c.close()
        s.close()


# -- a wrong secret on the real store and coordinator ---------------------------------------------


def test_wrong_secret_at_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)  # the store scans and cleans only here
    run_id = f"tr{uuid.uuid4().hex[:10]}"
    url = f"ipc://{tmp_path}/store.sock"
    store = SnapshotStore(StoreConfig(run_id=run_id, url=url, coordinator=None, node_id="n/1",
                                      owner_pid=os.getpid()), SECRET)
    thread = threading.Thread(target=store.serve, daemon=True)
    thread.start()
    good = Client(url, SECRET, run_id, "rank:0", peer="snapshot store")
    bad = Client(url, b"w" * 32, run_id, "rank:0", peer="snapshot store")
    try:
        with caplog.at_level(logging.WARNING, logger="ftrun.protocol"):
            assert good.request("snap_flush", {"rank": 0}, "ack", 10.0).kind == "ack"
            with pytest.raises(AuthError, match="snapshot store at .* refused our secret at "
                                                "its handshake"):
                bad.request("snap_flush", {"rank": 0}, "ack", 5.0)
        # Refused before any message of its was read, and said so with the peer (over ipc:
        # a local process).
        assert any("snapshot store: refused a connection from" in r.getMessage()
                   and "at the handshake: a wrong token" in r.getMessage()
                   for r in caplog.records)
        with pytest.raises(ProtocolError, match="does not accept 'status_request'"):
            good.request("status_request", {}, None, 5.0)
    finally:
        good.close()
        bad.close()
        store.stop(unlink=False)
        thread.join(10)
    assert not thread.is_alive()


def test_wrong_secret_at_the_coordinator(tmp_path: Path) -> None:
    c = Coordinator(JOB, SECRET, bind_host="127.0.0.1", port=free_port(),
                    events_file=tmp_path / "events.jsonl")
    c.start()
    try:
        with pytest.raises(AuthError, match="coordinator at .* refused our secret"):
            coordinator_request(c.endpoint, b"w" * 32, JOB, "status_request", {}, timeout_s=5)
        assert c.counters["auth_failures"] >= 1  # refused at each handshake it retried
        doc = coordinator_request(c.endpoint, SECRET, JOB, "status_request", {}, timeout_s=5)
        assert doc.body["doc"]["run_id"] == JOB
    finally:
        c.stop()


# -- the handshake ------------------------------------------------------------------------------


def test_a_server_of_its_own_context_lets_the_context_end() -> None:
    """The handshake gate of a context stops with the last server on it: the context can be
    terminated (a gate left running would hold it forever)."""
    ctx: zmq.Context[Any] = zmq.Context()
    first = Server("first", SECRET, JOB, HANDLERS, sender="s")
    second = Server("second", SECRET, JOB, HANDLERS, sender="s")
    first.bind("tcp://127.0.0.1:*", ctx)
    url = second.bind("tcp://127.0.0.1:*", ctx)
    first.close()  # the gate goes on for the second
    c = client(url, context=ctx)
    served = threading.Thread(target=second.serve_once, args=(10.0,), daemon=True)
    served.start()
    try:
        assert c.request("snap_flush", {"rank": 2}, "snap_done", 10.0).body["rank"] == 2
    finally:
        c.close()
        served.join(10)
        second.close()
    ended = threading.Thread(target=ctx.term, daemon=True)
    ended.start()
    ended.join(10)
    assert not ended.is_alive(), "the context could not end: a socket of the gate is open"


def test_a_peer_without_the_handshake_is_named_as_such(tmp_path: Path) -> None:
    """A server that speaks no handshake (not ftrun, or an ftrun from before handshakes) is a
    ProtocolError saying so, not a timeout."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    c = client(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    try:
        with pytest.raises(ProtocolError, match="does not speak ftrun's handshake"):
            c.request("snap_flush", {"rank": 0}, "snap_done", 10.0)
    finally:
        c.close()
        sock.close(0)


def test_a_refused_handshake_is_reported_once_per_window(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Peers with a wrong token: every refusal counted, the first of each address's window
    reported to on_reject (the coordinator's event log), with the count held back."""
    from ftrun.protocol import handshake

    monkeypatch.setattr(handshake, "WARN_EVERY_S", 3600.0)
    rejects: list[tuple[str, str, str, int]] = []
    s = Serving("tcp://127.0.0.1:*", HANDLERS, on_reject=lambda *a: rejects.append(a))
    wrong = [client(s.url, secret=b"x" * 32) for _ in range(3)]
    try:
        for c in wrong:
            with pytest.raises(AuthError, match="refused our secret at its handshake"):
                c.request("snap_flush", {"rank": 0}, "snap_done", 10.0)
    finally:
        for c in wrong:
            c.close()
        s.close()
    assert s.server.counters["auth_failures"] >= 3
    [(kind, address, reason, suppressed)] = rejects
    assert (kind, address, suppressed) == ("auth_failure", "127.0.0.1", 0)
    assert reason == ("refused at the handshake: a wrong token (another job's peer, or the "
                      "wrong secret)")
