"""Point-to-point probes between launchers: latency and bandwidth of the links between hosts.

When the coordinator's analysis finds collectives slow while every rank arrives on time, the
fault is in the network, and the collectives alone cannot say where. The coordinator then
sends ``probe`` directives: each launcher measures its links to a few peers and reports a
``probe_result``; the rows and columns of that matrix name a slow host or a slow link.

- :class:`ProbeService`: every launcher serves ``probe`` messages on the interface its
  snapshot store takes replicas on (the data-plane interface), on a port the OS picks, from
  one thread. It answers each with a ``probe_ack`` carrying only the number of bytes
  received; frames larger than its cap are refused unread (no answer).
- :func:`probe_peers`: per peer, the round-trip time of an empty probe (median of a few) and
  the rate of sending ``size`` bytes (the best of a few sends, round trip included). Every
  wait is bounded by the per-peer timeout; a peer that fails is reported with its error, and
  the function never raises.
- :func:`probe_and_report`: runs one ``probe`` directive and sends the ``probe_result``.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import zmq

from ftrun import protocol
from ftrun.errors import FtrunError, ProtocolError
from ftrun.protocol import messages as m
from ftrun.protocol.service import Service
from ftrun.protocol.transport import Client, Server

log = logging.getLogger(__name__)

# The largest probe a service accepts: a bandwidth probe needs a few MiB to dwarf the
# round trip, and no more.
MAX_PROBE_BYTES = 16 << 20
DEFAULT_PROBE_BYTES = 4 << 20
RTT_PROBES = 5
BANDWIDTH_PROBES = 3
PROBE_TIMEOUT_S = 5.0
SERVE_POLL_S = 0.2
RESULT_TIMEOUT_S = 5.0


class ProbeService:
    """Answers ``probe`` messages from peer launchers on one thread.

    ``max_bytes`` caps the data a probe may carry: a larger frame is dropped before it is
    read (by ZeroMQ above 1 MiB, by the message check below), so it gets no answer.
    """

    def __init__(self, run_id: str, node_id: str, secret: bytes,
                 max_bytes: int = MAX_PROBE_BYTES) -> None:
        if max_bytes < 1:
            raise FtrunError(f"the probe service's cap must be >= 1 byte, got {max_bytes}")
        self.node_id = node_id
        self.max_bytes = max_bytes
        self.answered = 0
        self._service = Service(
            Server("probe service", secret, run_id, {"probe": self._on_probe},
                   sender=f"probe:{node_id}", max_frame_bytes=max_bytes, hwm=16, typed=True),
            poll_s=SERVE_POLL_S, max_messages=4, thread_name="ftrun-probe")
        self.address = ""

    def start(self, host: str) -> str:
        """Bind ``host`` on a port the OS picks and serve; returns the ``host:port``."""
        self.address = self._service.bind_tcp(host)
        self._service.start()
        log.info("answering link probes on %s", self.address)
        return self.address

    def stop(self, timeout_s: float = 2.0) -> None:
        self._service.stop(timeout_s)

    def _on_probe(self, msg: protocol.Message) -> m.ProbeAck:
        size = msg.body.size
        received = sum(memoryview(f).nbytes for f in msg.frames)
        if size > self.max_bytes or received > self.max_bytes:
            raise ProtocolError(f"a probe of {max(size, received)} bytes exceeds this "
                                f"service's cap of {self.max_bytes} bytes")
        if received != size:
            raise ProtocolError(f"the probe says {size} bytes but carries {received}")
        self.answered += 1
        return m.ProbeAck(size=received)


def _round_trip(client: Client, payload: bytes, deadline: float) -> float:
    """Seconds for one probe of ``payload`` and its ack; raises on no answer in time."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("out of time")
    frames = [payload] if payload else []
    t0 = time.perf_counter()
    reply = client.request("probe", {"size": len(payload)}, "probe_ack", remaining,
                           frames=frames)
    elapsed = time.perf_counter() - t0
    if reply.body["size"] != len(payload):
        raise ProtocolError(f"the peer acked {reply.body['size']} of {len(payload)} bytes")
    return elapsed


def probe_peer(peer: dict[str, Any], size: int, timeout_s: float, *, secret: bytes,
               run_id: str, sender: str, context: zmq.Context[Any] | None = None,
               rtt_probes: int = RTT_PROBES,
               bandwidth_probes: int = BANDWIDTH_PROBES) -> dict[str, Any]:
    """Probe one peer ``{"node_id", "host", "addr"}``: a ``probe_result`` results entry."""
    out: dict[str, Any] = {"peer": str(peer.get("node_id", "")), "host": str(peer.get("host", "")),
                           "rtt_s": None, "mb_s": None}
    deadline = time.monotonic() + timeout_s
    client: Client | None = None
    try:
        client = Client(str(peer["addr"]), secret, run_id, sender, peer=f"probe service of "
                        f"{out['peer']}", send_timeout_s=min(1.0, timeout_s), context=context)
        rtts = [_round_trip(client, b"", deadline) for _ in range(max(1, rtt_probes))]
        out["rtt_s"] = statistics.median(rtts)
        if size > 0:
            payload = bytes(size)
            best = min(_round_trip(client, payload, deadline)
                       for _ in range(max(1, bandwidth_probes)))
            out["mb_s"] = size / best / 1e6
    except TimeoutError:
        out["error"] = f"no answer within {timeout_s:g} s"
    except Exception as e:  # noqa: BLE001 - one peer's failure is its result, not ours
        out["error"] = f"{type(e).__name__}: {e}"[:1000]
    finally:
        if client is not None:
            client.close()
    return out


def probe_peers(peers: list[dict[str, Any]], size: int = DEFAULT_PROBE_BYTES,
                timeout_s: float = PROBE_TIMEOUT_S, *, secret: bytes, run_id: str,
                sender: str) -> list[dict[str, Any]]:
    """Probe each peer in turn (one link measured at a time, so probes do not share the
    link they measure); one result entry per peer, errors included. Never raises; takes at
    most ``timeout_s`` per peer."""
    size = max(0, min(int(size), MAX_PROBE_BYTES))
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        return [probe_peer(p, size, timeout_s, secret=secret, run_id=run_id, sender=sender,
                           context=ctx) for p in peers]
    finally:
        ctx.term()


def probe_and_report(directive: dict[str, Any], *, node_id: str, host: str, secret: bytes,
                     run_id: str, detect_endpoint: str,
                     timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, Any] | None:
    """Carry out one ``probe`` directive and send its ``probe_result`` to the coordinator's
    detect endpoint (``host:port``). Returns the result body, or None when the directive
    was malformed. Logs, never raises: it runs on a thread of its own."""
    data = directive.get("data", {})
    try:
        peers = [p for p in data["peers"] if p.get("node_id") != node_id]
        size = int(data.get("size", DEFAULT_PROBE_BYTES))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        log.error("probe directive %s is malformed (%s): %r", directive.get("id"), e, data)
        return None
    t0 = time.monotonic()
    results = probe_peers(peers, size, timeout_s, secret=secret, run_id=run_id,
                          sender=node_id)
    body = {"node_id": node_id, "host": host, "id": str(directive.get("id", "")),
            "results": results}
    failed = [r["peer"] for r in results if r.get("error")]
    log.info("probed %d peer(s) in %.1f s for directive %s%s", len(results),
             time.monotonic() - t0, body["id"],
             f"; no answer from {', '.join(failed)}" if failed else "")
    client = Client(detect_endpoint, secret, run_id, node_id, peer="coordinator (detection)",
                    send_timeout_s=1.0)
    try:
        client.request("probe_result", body, None, RESULT_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - logged; the coordinator may probe again
        log.warning("could not send the probe result of directive %s to %s: %s", body["id"],
                    detect_endpoint, e)
    finally:
        client.close()
    return body
