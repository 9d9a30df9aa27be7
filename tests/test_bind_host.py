"""Every TCP socket a job listens on, and its address, as docs/operations.md lists them
("Every socket a job opens"), read from /proc while the real processes run:

- ``ftrun coordinator --bind-host 127.0.0.1``: the rendezvous store, the coordinator and the
  detection service all listen on 127.0.0.1 (torch's store alone would listen on every
  interface);
- a launcher with ``--bind-host 127.0.0.1`` that hosts the c10d store and runs the
  coordinator, 2 ranks: the launcher and its snapshot store listen on 127.0.0.1 only (store,
  coordinator, detection, link probes, replicas, shards); the ranks' listeners are torch's:
  rank 0's process-group store on every interface at MASTER_PORT (torch's env://
  initialisation gives it no address), and gloo's pairs.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from conftest import ROOT, Procs, free_port, wait_for

from ftrun import jobs
from ftrun.rank.sockets import socket_inodes
from ftrun.testing.procs import tree_pids

pytestmark = [pytest.mark.integration]

WILDCARD = {"0.0.0.0", "::"}


def _proc_tcp_listeners() -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket of this network namespace."""
    out: dict[int, tuple[str, int]] = {}
    for name, v6 in (("tcp", False), ("tcp6", True)):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)
            if v6:  # four little-endian 32-bit words
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                addr = ipaddress.IPv6Address(raw)
                addr_s = str(addr.ipv4_mapped or addr)
            else:
                addr_s = str(ipaddress.IPv4Address(raw[::-1]))
            out[int(fields[9])] = (addr_s, int(hex_port, 16))
    return out


def listeners(pids: list[int]) -> dict[int, set[tuple[str, int]]]:
    """pid -> the (address, port) its listening TCP sockets are bound to."""
    table = _proc_tcp_listeners()
    return {pid: {table[i] for i in inodes if i in table}
            for pid in pids if (inodes := socket_inodes(pid) & table.keys())}


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0")
                if "=" in item)


def test_standalone_coordinator_listens_on_its_bind_host_only(procs: Procs,
                                                              tmp_path: Path) -> None:
    port = free_port()
    state = tmp_path / "state"
    proc = procs.ftrun("coordinator", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
                       "bind-test", "--bind-host", "127.0.0.1", "--state-dir", str(state),
                       env={"FTRUN_SECRET": "a" * 32}, name="coordinator")
    wait_for(lambda: (jobs.job_dir("bind-test", str(state)) / "job.json").exists()
             or proc.poll() is not None, 60, "the coordinator's job file")
    assert proc.poll() is None, procs.output(proc)
    bound = set().union(*listeners([proc.pid]).values())
    assert ("127.0.0.1", port) in bound, bound  # the rendezvous store
    assert len(bound) == 3, bound  # with the coordinator and the detection service
    assert {addr for addr, _ in bound} == {"127.0.0.1"}, bound


def test_a_launcher_listens_on_its_bind_host_and_its_ranks_as_torch_does(
        procs: Procs, tmp_path: Path) -> None:
    port = free_port()
    out = tmp_path / "out"
    out.mkdir()
    launcher = procs.ftrun(
        "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--bind-host", "127.0.0.1",
        "--rdzv-id", "bind-job", "--max-restarts", "0",
        str(ROOT / "examples" / "user_ddp.py"), "--epochs", "1", "--samples", "256",
        "--batch-size", "8", "--hidden", "32", "--step-sleep", "0.3", "--pid-log", str(out),
        env={"FTRUN_STATE_DIR": str(tmp_path / "state")})

    def training() -> bool:
        assert launcher.poll() is None, procs.output(launcher)[-3000:]
        logs = [out / f"pids-rank{r}.log" for r in range(2)]
        return all(p.exists() and len(p.read_text().splitlines()) >= 2 for p in logs)

    wait_for(training, 120, "both ranks training", interval_s=0.2)
    pids = tree_pids(launcher.pid)
    ranks = {pid: env for pid in pids
             if (env := _environ(pid)).get("RANK") is not None and "LOCAL_RANK" in env}
    assert len(ranks) == 2, ranks.keys()
    found = listeners(pids)
    ours = {pid: socks for pid, socks in found.items() if pid not in ranks}
    # The launcher (store, coordinator, detection, link probes) and its snapshot store
    # (replicas, shards): 127.0.0.1 only.
    assert ("127.0.0.1", port) in ours.get(launcher.pid, set()), found
    assert len(ours) == 2 and sum(len(s) for s in ours.values()) >= 6, ours
    assert {addr for socks in ours.values() for addr, _ in socks} == {"127.0.0.1"}, ours
    # torch's: rank 0's process-group store on every interface, at MASTER_PORT.
    [rank0] = [pid for pid, env in ranks.items() if env["RANK"] == "0"]
    master_port = int(ranks[rank0]["MASTER_PORT"])
    wild = {(a, p) for a, p in found.get(rank0, set()) if a in WILDCARD}
    assert {p for _, p in wild} == {master_port}, found
    assert all(a not in WILDCARD for pid in ranks if pid != rank0
               for a, _ in found.get(pid, set())), found
    assert procs.wait(launcher, 120) == 0, procs.output(launcher)[-3000:]
