"""A real etcd cluster for tests and benchmarks: N members on loopback ports, in a directory.

:class:`EtcdCluster` starts Debian's ``etcd`` (``bash scripts/setup-etcd.sh`` installs it)
once per member, each with its data, log and PID in the cluster's directory and a
parent-death signal (a member never outlives the process that started it), waits until every
member reports itself healthy (a leader is elected), and stops members by PID. Elections are
tuned for loopback (heartbeat 50 ms, election timeout 500 ms), so losing the leader costs
about a second, not the default ten.

:func:`etcd_binary` finds the program; tests skip without it unless ``FTRUN_REQUIRE_ETCD=1``.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftrun.testing.procs import REPO, _die_with_parent, free_port, pid_alive, wait_for

REQUIRE_ENV = "FTRUN_REQUIRE_ETCD"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


def etcd_binary() -> str | None:
    """The path of the ``etcd`` program, None where it is not installed."""
    return shutil.which("etcd") or next(
        (p for p in ("/usr/bin/etcd", "/usr/sbin/etcd") if os.access(p, os.X_OK)), None)


class EtcdCluster:
    """``members`` etcd processes forming one cluster on ``host`` (127.0.0.1 by default:
    an address of the root namespace's bridge reaches them from network namespaces), under
    ``base``.

    Use as a context manager (or call :meth:`start` and :meth:`stop`): a failure while
    starting stops the members already started. :attr:`endpoints` is what ``--rdzv-endpoint``
    takes (``127.0.0.1:P1,127.0.0.1:P2,...``).
    """

    def __init__(self, base: Path, members: int = 3, host: str = "127.0.0.1",
                 tls: TestCerts | None = None) -> None:
        if members < 1:
            raise ValueError(f"an etcd cluster needs at least one member, not {members}")
        binary = etcd_binary()
        if binary is None:
            raise FileNotFoundError("etcd is not installed; run: bash scripts/setup-etcd.sh")
        self.binary = binary
        self.base = base
        self.host = host  # the address every member listens on (loopback by default)
        # With ``tls``, members serve their clients over https and ask each for a
        # certificate signed by the test CA (peers still talk plain http among themselves).
        self.tls = tls
        self.names = [f"m{i}" for i in range(members)]
        # Ports outside the kernel's ephemeral range: a member stopped and started again
        # binds its port anew, which an outgoing connection may take meanwhile otherwise
        # (seen in CI: "bind: address already in use" on a member's restart).
        taken: set[int] = set()
        self.client_ports = [_stable_port(host, taken) for _ in self.names]
        self.peer_ports = [_stable_port(host, taken) for _ in self.names]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * members
        self._token = f"ftrun-test-{uuid.uuid4().hex[:12]}"

    @property
    def endpoints(self) -> str:
        scheme = "https://" if self.tls else ""
        return ",".join(f"{scheme}{self.host}:{p}" for p in self.client_ports)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def start(self) -> EtcdCluster:
        try:
            for i in range(len(self.names)):
                self.start_member(i)
            try:
                wait_for(self.healthy, START_TIMEOUT_S, "etcd members healthy")
            except AssertionError as e:
                raise AssertionError(f"{e}; their logs:\n{self.logs()}") from None
        except BaseException:
            self.stop()
            raise
        return self

    def start_member(self, i: int) -> None:
        """Start member ``i`` (again, after :meth:`stop_member`: it rejoins with its data)."""
        if self.procs[i] is not None:
            raise RuntimeError(f"etcd member {self.names[i]} is running already")
        self.procs[i] = self._start_member(i, self.names[i])

    def _start_member(self, i: int, name: str) -> subprocess.Popen[bytes]:
        cluster = ",".join(f"{n}=http://{self.host}:{p}"
                           for n, p in zip(self.names, self.peer_ports, strict=True))
        client = f"{'https' if self.tls else 'http'}://{self.host}:{self.client_ports[i]}"
        tls = [] if self.tls is None else [
            "--cert-file", str(self.tls.server_cert), "--key-file", str(self.tls.server_key),
            "--client-cert-auth", "--trusted-ca-file", str(self.tls.ca)]
        peer = f"http://{self.host}:{self.peer_ports[i]}"
        data = self.base / name
        data.mkdir(parents=True, exist_ok=True)
        with open(self.base / f"{name}.log", "ab") as out:
            proc = subprocess.Popen(
                [self.binary, "--name", name, "--data-dir", str(data / "data"),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", cluster, "--initial-cluster-state", "new",
                 "--initial-cluster-token", self._token,
                 "--heartbeat-interval", "50", "--election-timeout", "500",
                 "--log-level", "warn", *tls],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=_die_with_parent,
            )
        (self.base / f"{name}.pid").write_text(str(proc.pid))
        return proc

    def member_healthy(self, i: int) -> bool:
        scheme = "https" if self.tls else "http"
        url = f"{scheme}://{self.host}:{self.client_ports[i]}/health"
        context = None
        if self.tls is not None:
            context = ssl.create_default_context(cafile=str(self.tls.ca))
            context.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as response:  # noqa: S310
                return b'"true"' in response.read()
        except OSError:
            return False

    def healthy(self) -> bool:
        """Every running member reports itself healthy."""
        running = [i for i, p in enumerate(self.procs) if p is not None and p.poll() is None]
        return len(running) == len(self.procs) and all(self.member_healthy(i) for i in running)

    def stop_member(self, i: int) -> None:
        """Stop member ``i`` (SIGTERM, then SIGKILL after :data:`STOP_TIMEOUT_S`)."""
        proc = self.procs[i]
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=STOP_TIMEOUT_S)
        self.procs[i] = None

    def stop(self) -> None:
        """Stop every member. Idempotent."""
        for i in range(len(self.procs)):
            self.stop_member(i)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None and pid_alive(p.pid)]

    def logs(self) -> str:
        parts = []
        for name in self.names:
            with contextlib.suppress(OSError):
                text = (self.base / f"{name}.log").read_text(errors="replace")
                parts.append(f"--- etcd {name} ---\n{text[-1500:]}")
        return "\n".join(parts)


def _stable_port(host: str, taken: set[int]) -> int:
    """A port free on ``host`` below the ephemeral range (so no outgoing connection takes it
    while its member is stopped); falls back to one the OS hands out."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = random.randrange(10000, max(10001, low))
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        taken.add(port)
        return port
    return free_port()


@dataclass(frozen=True)
class TestCerts:
    """A throw-away CA, a server certificate for ``host`` and a client certificate, made
    with ``openssl`` under ``base`` (:meth:`make`)."""

    __test__ = False  # (not a pytest class)

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def make(cls, base: Path, host: str = "127.0.0.1") -> TestCerts:
        base.mkdir(parents=True, exist_ok=True)

        def openssl(*args: str) -> None:
            subprocess.run(["openssl", *args], cwd=base, check=True, capture_output=True,
                           timeout=60)

        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                "/CN=ftrun-test-ca", "-keyout", "ca.key", "-out", "ca.pem")
        # etcd's JSON gateway dials its own gRPC server with the server certificate: under
        # --client-cert-auth that certificate must be good for client authentication too.
        for name, ext in (("server", f"subjectAltName=IP:{host}\n"
                                     "extendedKeyUsage=serverAuth,clientAuth"),
                          ("client", "extendedKeyUsage=clientAuth")):
            (base / f"{name}.ext").write_text(ext + "\n")
            openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=ftrun-test-{name}",
                    "-keyout", f"{name}.key", "-out", f"{name}.csr")
            openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                    "-CAcreateserial", "-days", "1", "-extfile", f"{name}.ext",
                    "-out", f"{name}.pem")
        return cls(base / "ca.pem", base / "server.pem", base / "server.key",
                   base / "client.pem", base / "client.key")


# One user-style job on etcd, as the failover test and bench run it: examples/user_ddp.py
# (@ftrun.resilient), 3 nodes of one rank, a step every ``step_sleep_s`` at least, 32 steps.
USER_DDP_STEPS = 32  # 2 epochs of 384 samples, 8 a step on each of 3 ranks
USER_DDP_DIGEST = r"^user-ddp: step=.* params_xxh3=(\w+)$"  # its result line (re.M)


def user_ddp_on_etcd(cluster: Any, endpoints: str, run_id: str, hosts: Sequence[int],
                     out: Path, step_sleep_s: float = 0.3) -> list[subprocess.Popen[str]]:
    """Start the job's launchers on ``hosts`` of a :class:`ftrun.testing.netns.Cluster`;
    each rank logs its steps (``pids-rank<R>.log``: step, pid, time) under ``out``."""
    out.mkdir(exist_ok=True)
    cmd = ["--nnodes", "3", "--nproc-per-node", "1", "--rdzv-backend", "etcd",
           "--rdzv-endpoint", endpoints, "--rdzv-id", run_id, "--max-restarts", "3",
           str(REPO / "examples" / "user_ddp.py"), "--epochs", "2", "--samples", "384",
           "--batch-size", "8", "--hidden", "64", "--step-sleep", str(step_sleep_s),
           "--pid-log", str(out), "--fault-dir", str(out)]
    return [cluster.ftrun(i, *cmd, name=f"{run_id}.host{i}") for i in hosts]
