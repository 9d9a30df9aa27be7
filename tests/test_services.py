"""One contract, run against every server on the service runtime (ftrun.protocol.service):
it answers a valid request with a reply its request kind declares, refuses a peer without the
secret (the peer is told, not left to time out), answers a kind it does not take with an
error, survives garbage and goes on serving, and stops within its bound, releasing its
socket. Adding a server is one entry in SERVERS."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import zmq
from conftest import wait_for

from ftrun import protocol
from ftrun.errors import AuthError, ProtocolError
from ftrun.protocol.service import Service
from ftrun.protocol.transport import Client

pytestmark = pytest.mark.timeout(120)

SECRET = b"contract-secret-0123456789abcdef"
JOB = "contract"


@dataclass
class Running:
    """A server under test: where it listens, its service, a request it takes (kind,
    body) and how to stop it the way its owner does."""

    address: str
    service: Service
    request: tuple[str, dict[str, Any]]
    stop: Callable[[], None]


def _coordinator() -> Running:
    from ftrun.coordinator.server import Coordinator

    c = Coordinator(JOB, SECRET, bind_host="127.0.0.1")
    c.start()
    assert c._service is not None
    return Running(c.endpoint, c._service, ("hello", {"node_id": "n/1", "host": "h", "pid": 1}),
                   c.stop)


def _detection() -> Running:
    from ftrun.coordinator.detect import DetectConfig
    from ftrun.coordinator.detect_service import DetectService

    d = DetectService(JOB, SECRET, DetectConfig(), direct=lambda *a: "",
                      record=lambda *a: None, nodes=dict, coordinator_host="h",
                      excluded_file=None, bind_host="127.0.0.1")
    endpoint = d.start()
    assert d._service is not None
    return Running(endpoint, d._service, ("probe_result", {
        "node_id": "n/1", "host": "h", "id": "ab12",
        "results": [{"peer": "n/2", "host": "h2", "rtt_s": 0.001, "mb_s": 900.0}]}), d.stop)


def _probe() -> Running:
    from ftrun.launcher.probe import ProbeService

    p = ProbeService(JOB, "n/1", SECRET)
    address = p.start("127.0.0.1")
    return Running(address, p._service, ("probe", {"size": 0}), p.stop)


# The servers on the runtime. The store's servers (snapshot store, replica receiver, shard
# service) join with one line each once they run on it.
SERVERS: dict[str, Callable[[], Running]] = {
    "coordinator": _coordinator,
    "detection service": _detection,
    "probe service": _probe,
}


@pytest.fixture(params=sorted(SERVERS))
def running(request: pytest.FixtureRequest) -> Iterator[Running]:
    r = SERVERS[request.param]()
    yield r
    r.stop()


def _client(r: Running, secret: bytes = SECRET) -> Client:
    return Client(r.address, secret, JOB, "contract:client", peer=r.service.name)


def test_it_answers_a_request_with_a_reply_its_kind_declares(running: Running) -> None:
    kind, body = running.request
    c = _client(running)
    try:
        reply = c.request(kind, body, None, 10.0)
    finally:
        c.close()
    assert reply.kind in protocol.BODIES[kind].REPLIES, (kind, reply.kind)
    assert running.service.serving


def test_a_peer_without_the_secret_is_refused_and_told(running: Running) -> None:
    kind, body = running.request
    c = _client(running, secret=b"not-the-secret-0123456789abcdef!")
    try:
        with pytest.raises(AuthError, match="refused our secret"):
            c.request(kind, body, None, 10.0)
    finally:
        c.close()
    assert running.service.server.counters["auth_failures"] >= 1


def test_a_kind_it_does_not_take_is_answered_with_an_error(running: Running) -> None:
    c = _client(running)
    try:
        with pytest.raises(ProtocolError, match="does not accept 'fault_corrupt'"):
            c.request("fault_corrupt", {"rank": 0}, None, 10.0)
    finally:
        c.close()


def test_garbage_is_survived_and_serving_goes_on(running: Running) -> None:
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://{running.address}")
    c = _client(running)
    try:
        for frames in ([b"x"], [b"{}", b"y" * 32], [b"z"] * 500, [b"\xff" * 64, b"m" * 32]):
            raw.send_multipart(frames)
        counters = running.service.server.counters
        wait_for(lambda: counters["bad_messages"] + counters["auth_failures"] >= 4, 30,
                 "the garbage refused")
        kind, body = running.request
        assert c.request(kind, body, None, 10.0).kind in protocol.BODIES[kind].REPLIES
    finally:
        c.close()
        raw.close(0)
    assert counters["bad_messages"] >= 2


def test_it_stops_within_its_bound_and_releases_its_socket(running: Running) -> None:
    running.stop()
    assert not running.service.serving
    assert running.service.server._sock is None  # closed
    running.stop()  # twice is harmless
    # The port is free again (on a shared context, ZeroMQ's reaper closes it a moment later).
    host, port = protocol.split_endpoint(running.address)

    def rebinds() -> bool:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        try:
            sock.bind(f"tcp://{host}:{port}")
            return True
        except zmq.ZMQError:
            return False
        finally:
            sock.close(0)

    wait_for(rebinds, 30, f"port {port} free again")
