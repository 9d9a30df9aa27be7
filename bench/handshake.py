"""What a connection and a message cost with the handshake: run it on two trees to compare.

A server (a real ``Server`` of ftrun's transport, on a thread of this process) and a client
that, ``--connections`` times, connects, makes one request and closes; then one connection
that makes ``--messages`` requests. Reports per connection and per message the wall time
and the CPU time of the whole process (server, client and ZeroMQ's I/O thread together).

    .venv/bin/python bench/handshake.py [--connections 500] [--messages 5000]

Run it with ``PYTHONPATH`` set to each tree to compare (``ftrun.protocol.handshake`` exists
on the trees with the handshake; it says which it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import threading
import time
from typing import Any


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=500)
    parser.add_argument("--messages", type=int, default=5000)
    args = parser.parse_args()

    from ftrun.protocol.transport import Client, Reply, Server

    try:
        import ftrun.protocol.handshake  # noqa: F401

        tree = "handshake"
    except ImportError:
        tree = "no handshake"
    secret, job = os.urandom(32), "bench"
    server = Server("bench server", secret, job, {
        "probe": lambda m: Reply("probe_ack", {"size": m.body["size"]})}, sender="server")
    url = server.bind("tcp://127.0.0.1:*")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            server.serve_once(0.01)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    out: dict[str, Any] = {"tree": tree, "connections": args.connections,
                           "messages": args.messages}
    try:
        t0, c0 = time.perf_counter(), _cpu_s()
        for _ in range(args.connections):
            c = Client(url, secret, job, "bench")
            c.request("probe", {"size": 1}, "probe_ack", 10.0)
            c.close()
        wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
        out["per_connection_ms"] = round(wall / args.connections * 1000, 3)
        out["cpu_per_connection_ms"] = round(cpu / args.connections * 1000, 3)
        c = Client(url, secret, job, "bench")
        c.request("probe", {"size": 1}, "probe_ack", 10.0)
        t0, c0 = time.perf_counter(), _cpu_s()
        for _ in range(args.messages):
            c.request("probe", {"size": 1}, "probe_ack", 10.0)
        wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
        c.close()
        out["per_message_us"] = round(wall / args.messages * 1e6, 1)
        out["cpu_per_message_us"] = round(cpu / args.messages * 1e6, 1)
    finally:
        stop.set()
        thread.join(5)
        server.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
