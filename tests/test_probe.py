"""Link probes (ftrun.launcher.probe): real probe services on loopback, real ZeroMQ."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import zmq
from conftest import free_port

from ftrun import protocol
from ftrun.launcher.probe import ProbeService, probe_and_report, probe_peers
from ftrun.protocol.transport import Reply, Server

SECRET = b"probe-test-secret"
RUN_ID = "probe-test"


@pytest.fixture
def services() -> Iterator[list[ProbeService]]:
    started: list[ProbeService] = []
    try:
        for i in range(2):
            service = ProbeService(RUN_ID, f"node{i}", SECRET)
            service.start("127.0.0.1")
            started.append(service)
        yield started
    finally:
        for service in started:
            service.stop()


def peer(service: ProbeService) -> dict[str, str]:
    return {"node_id": service.node_id, "host": "localhost", "addr": service.address}


def test_two_services_measure_rtt_and_throughput(services: list[ProbeService]) -> None:
    results = probe_peers([peer(s) for s in services], 1 << 20, 10.0, secret=SECRET,
                          run_id=RUN_ID, sender="prober")
    assert [r["peer"] for r in results] == ["node0", "node1"]
    for r in results:
        assert "error" not in r, r
        assert r["rtt_s"] > 0 and r["mb_s"] > 0, r
        protocol.validate(protocol.messages.ProbeOutcome, r)
    # Each service saw its round trips: 5 empty probes and 3 of 1 MiB.
    assert [s.answered for s in services] == [8, 8]


def test_an_unreachable_peer_is_an_error_entry(services: list[ProbeService]) -> None:
    dead = {"node_id": "gone", "host": "localhost", "addr": f"127.0.0.1:{free_port()}"}
    results = probe_peers([dead, peer(services[0])], 4096, 1.0, secret=SECRET, run_id=RUN_ID,
                          sender="prober")
    assert results[0]["peer"] == "gone" and results[0]["rtt_s"] is None
    assert results[0]["mb_s"] is None and results[0]["error"]
    assert "error" not in results[1] and results[1]["mb_s"] > 0  # the next peer still probed


def test_a_malformed_peer_is_an_error_entry_too() -> None:
    results = probe_peers([{"node_id": "x", "host": "h", "addr": "not an address"}], 10, 0.5,
                          secret=SECRET, run_id=RUN_ID, sender="prober")
    assert results[0]["error"] and results[0]["rtt_s"] is None


def test_a_service_refuses_probes_over_its_cap() -> None:
    small = ProbeService(RUN_ID, "small", SECRET, max_bytes=64 << 10)
    small.start("127.0.0.1")
    try:
        over = probe_peers([peer(small)], 256 << 10, 2.0, secret=SECRET, run_id=RUN_ID,
                           sender="prober")[0]
        # The round trips fit; the 256 KiB sends were dropped unread and never answered.
        assert over["rtt_s"] is not None and over["rtt_s"] > 0, over
        assert over["mb_s"] is None and over["error"], over
        assert small.answered == 5
        # A probe within the cap is still served afterwards.
        within = probe_peers([peer(small)], 32 << 10, 5.0, secret=SECRET, run_id=RUN_ID,
                             sender="prober")[0]
        assert "error" not in within and within["mb_s"] > 0, within
    finally:
        small.stop()


def test_a_probe_whose_size_lies_is_answered_with_an_error(services: list[ProbeService]) -> None:
    from ftrun.errors import ProtocolError
    from ftrun.protocol.transport import Client

    client = Client(services[0].address, SECRET, RUN_ID, "liar", peer="probe service")
    try:
        with pytest.raises(ProtocolError, match="says 100 bytes but carries 10"):
            client.request("probe", {"size": 100}, "probe_ack", 5.0, frames=[b"x" * 10])
    finally:
        client.close()


def test_probe_and_report_sends_the_result_to_the_detect_endpoint(
        services: list[ProbeService]) -> None:
    """A probe directive's result reaches a real server at the detect endpoint, validated
    against the probe_result schema, with this node left out of its own peers."""
    received: list[protocol.Message] = []

    def on_result(msg: protocol.Message) -> Reply:
        received.append(msg)
        return Reply("ack", {"re": msg.id})

    ctx: zmq.Context = zmq.Context()
    server = Server("detect", SECRET, RUN_ID, {"probe_result": on_result}, sender="coordinator")
    endpoint = server.bind_tcp("127.0.0.1", ctx)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            server.serve_once(0.05)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        directive = {"id": "d-1", "action": "probe",
                     "data": {"peers": [peer(s) for s in services], "size": 65536}}
        body = probe_and_report(directive, node_id="node0", host="hostA", secret=SECRET,
                                run_id=RUN_ID, detect_endpoint=endpoint)
        assert body is not None
        assert [r["peer"] for r in body["results"]] == ["node1"]
        assert len(received) == 1 and received[0].body == body
        assert received[0].body["id"] == "d-1" and received[0].sender == "node0"
        # A malformed directive is logged and reported as nothing.
        assert probe_and_report({"id": "d-2", "data": {}}, node_id="node0", host="hostA",
                                secret=SECRET, run_id=RUN_ID, detect_endpoint=endpoint) is None
    finally:
        stop.set()
        thread.join(5)
        server.close()
        ctx.term()
