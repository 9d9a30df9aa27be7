"""Node loss on network namespaces: every host has its own address, loopback and memory."""

from __future__ import annotations

import sys

import pytest
from conftest import wait_for
from netns import Cluster, cluster_factory  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.integration]

# A tiny TCP server and client, each run on one host.
SERVE = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept(); c.sendall(sys.argv[3].encode()); c.close()
"""
CONNECT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as c:
        print("got", c.recv(100).decode())
except OSError as e:
    print("error", type(e).__name__)
"""


def _connect(c: Cluster, i: int, host: str, port: int, timeout_s: float = 5) -> str:
    out = c.exec(i, [sys.executable, "-c", CONNECT, host, str(port), str(timeout_s)])
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_hosts_reach_each_other_and_keep_their_own_loopback(cluster_factory) -> None:  # noqa: F811
    c = cluster_factory(3)
    servers = []
    for i in range(3):
        for addr in (c.addr(i), "127.0.0.1"):
            p = c.run(i, [sys.executable, "-c", SERVE, addr, "7001", f"{addr}@{i}"],
                      name=f"serve{i}")
            servers.append(p)
    for p in servers:
        wait_for(lambda p=p: "listening" in c.output(p), 30, f"server {p.pid} to listen")
    for i in range(3):
        for j in range(3):
            assert _connect(c, i, c.addr(j), 7001) == f"got {c.addr(j)}@{j}"
        # each host's loopback is its own
        assert _connect(c, i, "127.0.0.1", 7001) == f"got 127.0.0.1@{i}"
    # a cut link isolates the host both ways; restoring it brings it back
    c.cut_link(1)
    assert _connect(c, 0, c.addr(1), 7001, 2) == "error TimeoutError"
    assert _connect(c, 1, c.addr(2), 7001, 2).startswith("error")
    assert _connect(c, 0, c.addr(2), 7001) == f"got {c.addr(2)}@2"
    c.restore_link(1)
    assert _connect(c, 0, c.addr(1), 7001, 10) == f"got {c.addr(1)}@1"
    # a slowed link still carries traffic
    c.slow_link(1, "10mbit")
    assert _connect(c, 0, c.addr(1), 7001, 10) == f"got {c.addr(1)}@1"
    c.unslow_link(1)
    # killing a host kills exactly its processes
    (c.shm_dir(2) / "segment").write_bytes(b"x")
    before = c.pids(2)
    assert len(before) == 2
    killed = c.kill_host(2)
    assert sorted(killed) == sorted(before) and not c.pids(2)
    assert not any(c.shm_dir(2).iterdir())  # its memory is gone with it
    assert len(c.pids(0)) == 2 and len(c.pids(1)) == 2
    assert _connect(c, 0, c.addr(2), 7001, 2).startswith("error")
