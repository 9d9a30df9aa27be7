"""Network namespaces as hosts: a bridge and n namespaces, each with its own address.

A :class:`Cluster` gives every "host" what a real one has apart from its own kernel: its
own network stack (address ``10.X.Y.i+1/24`` on ``eth0``, a loopback of its own), its own
host name, which resolves to that address on every host of the cluster (``ip netns exec``
mounts ``/etc/netns/NAME/hosts`` over ``/etc/hosts``; torch publishes the host name as
the workers' master address), and its own shared-memory directory (``FTRUN_SHM_DIR``), so
that a killed host's snapshots are gone with it. The state directory is shared by all
hosts, as a shared home is on a cluster. Processes run through ``ip netns exec``
(:meth:`Cluster.wrap` gives the command line; the process keeps its pid), each
:meth:`Cluster.run` one in a session of its own with its output in a log file.

Faults: :meth:`Cluster.kill_host` (SIGKILL every process in the namespace, and drop its
memory), :meth:`Cluster.cut_link` / :meth:`Cluster.restore_link` (the host-side veth down
or up), :meth:`Cluster.slow_link` (tc tbf on both directions).

Needs root, ``ip netns`` and ``tc``: :func:`unavailable_reason` says why not (tests turn it
into a skip, or a failure under ``FTRUN_REQUIRE_NETNS=1``: ``tests/netns.py``). Everything a
cluster creates is removed on exit, also when the caller failed; clusters left by a process
that was itself killed are swept by the next cluster (:func:`sweep_stale`).

Usage::

    with Cluster(3, tmp_path) as c:
        p = c.ftrun(0, "--nnodes", "3", ..., "--rdzv-endpoint", f"{c.addr(0)}:29400", ...)
        c.kill_host(1)
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ftrun.testing.procs import KILL_TIMEOUT_S, REPO, Procs, pid_alive

# Clusters record their owner here, so that one left by a killed test run can be swept.
REGISTRY = Path("/run/ftrun-netns")
ETC_NETNS = Path("/etc/netns")  # ip netns exec mounts the files of ETC_NETNS/NAME over /etc
IP_TIMEOUT_S = 30.0


class NetnsUnavailable(RuntimeError):
    """This machine cannot create network namespaces (not root, or no ``ip netns``)."""


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and out.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({out.returncode}): {out.stderr.strip()}")
    return out


_probe: str | None = None


def unavailable_reason() -> str:
    """Why namespaces cannot be used here, or "" when they can (probed once per process)."""
    global _probe
    if _probe is None:
        if os.geteuid() != 0:
            _probe = "network namespace tests need root (ip netns add)"
        elif shutil.which("ip") is None or shutil.which("tc") is None:
            _probe = "network namespace tests need the ip and tc commands (iproute2)"
        else:
            name = f"ftprobe{secrets.token_hex(3)}"
            out = _ip("netns", "add", name, check=False)
            if out.returncode != 0:
                _probe = f"`ip netns add` failed: {out.stderr.strip()}"
            else:
                _ip("netns", "del", name, check=False)
                _probe = ""
    return _probe


def sweep_stale() -> list[str]:
    """Remove the namespaces, links and memory of clusters whose test process is gone."""
    swept = []
    try:
        records = list(REGISTRY.glob("*.json"))
    except OSError:
        return swept
    for path in records:
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if pid_alive(int(rec.get("pid", 0))):
            continue
        _teardown(rec["namespaces"], rec["veths"], rec["bridge"], Path(rec["shm_root"]))
        path.unlink(missing_ok=True)
        swept.append(rec["bridge"])
    return swept


def _ns_pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False)
    if out.returncode != 0:
        return []
    return [int(p) for p in out.stdout.split()]


def _kill_all(ns: str, timeout_s: float = KILL_TIMEOUT_S,
              reap: Callable[[], object] | None = None) -> list[int]:
    """SIGKILL every process in ``ns`` until none is left (a launcher may fork meanwhile).

    ``reap`` collects the caller's own children among them: a killed child stays listed
    until its parent waits for it.
    """
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while True:
        if reap is not None:
            reap()
        pids = [p for p in _ns_pids(ns) if p != os.getpid()]
        if not pids:
            return killed
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                if pid not in killed:
                    killed.append(pid)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} in namespace {ns} survive SIGKILL")
        time.sleep(0.05)


def _teardown(namespaces: Sequence[str], veths: Sequence[str], bridge: str,
              shm_root: Path) -> list[str]:
    """Kill, delete and remove everything listed; returns what could not be removed."""
    errors = []
    for ns in namespaces:
        try:
            _kill_all(ns)
        except RuntimeError as e:
            errors.append(str(e))
    for ns in namespaces:
        out = _ip("netns", "del", ns, check=False)
        if out.returncode != 0 and "No such file" not in out.stderr:
            errors.append(f"ip netns del {ns}: {out.stderr.strip()}")
        shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
    for dev in [*veths, bridge]:
        # Deleting a namespace deletes its end of each veth pair, and with it the pair.
        if Path(f"/sys/class/net/{dev}").exists():
            out = _ip("link", "del", dev, check=False)
            if out.returncode != 0 and Path(f"/sys/class/net/{dev}").exists():
                errors.append(f"ip link del {dev}: {out.stderr.strip()}")
    shutil.rmtree(shm_root, ignore_errors=True)
    if shm_root.exists():
        errors.append(f"cannot remove {shm_root}")
    return errors


class Cluster:
    """``n`` hosts on one bridge. Use as a context manager; see the module docstring."""

    def __init__(self, n: int, tmp_path: Path, state_dir: Path | None = None) -> None:
        if not 1 <= n <= 250:
            raise ValueError(f"a cluster has 1 to 250 hosts, not {n}")
        self.n = n
        self.tmp_path = Path(tmp_path)
        self.state_dir = Path(state_dir) if state_dir else self.tmp_path / "state"
        self.tag = secrets.token_hex(2)
        self.bridge = f"ftbr{self.tag}"
        self.namespaces = [f"ft{self.tag}-{i}" for i in range(n)]
        self.veths = [f"ftv{self.tag}{i}h" for i in range(n)]  # host side, in the bridge
        rng = random.Random(secrets.randbits(32))
        self.subnet = f"10.{rng.randrange(1, 255)}.{rng.randrange(0, 256)}"
        self.shm_root = Path("/dev/shm") / f"ftrun-netns-{self.tag}"
        self.procs: list[tuple[int, subprocess.Popen[str]]] = []
        self.lost: set[int] = set()
        self._record = REGISTRY / f"{self.tag}.json"
        self._up = False

    # ---- set-up and tear-down -------------------------------------------------------

    def __enter__(self) -> Cluster:
        reason = unavailable_reason()
        if reason:
            raise NetnsUnavailable(reason)
        sweep_stale()
        REGISTRY.mkdir(parents=True, exist_ok=True)
        self._record.write_text(json.dumps({
            "pid": os.getpid(), "namespaces": self.namespaces, "veths": self.veths,
            "bridge": self.bridge, "shm_root": str(self.shm_root)}))
        self._up = True
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(raise_errors=exc[0] is None)

    def _create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        for i, (ns, veth) in enumerate(zip(self.namespaces, self.veths, strict=True)):
            inner = f"ftv{self.tag}{i}n"
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("link", "set", inner, "name", "eth0", ns=ns)
            _ip("addr", "add", f"{self.addr(i)}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            self.shm_dir(i).mkdir(parents=True, exist_ok=True)
        hosts = "127.0.0.1 localhost\n::1 localhost\n" + "".join(
            f"{self.addr(i)} {ns}\n" for i, ns in enumerate(self.namespaces))
        for ns in self.namespaces:
            (ETC_NETNS / ns).mkdir(parents=True, exist_ok=True)
            (ETC_NETNS / ns / "hosts").write_text(hosts)

    def close(self, raise_errors: bool = False) -> None:
        """Kill every process of every host, delete namespaces, links and memory."""
        if not self._up:
            return
        self._up = False
        errors = _teardown(self.namespaces, self.veths, self.bridge, self.shm_root)
        for _, proc in self.procs:
            try:
                proc.wait(timeout=KILL_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                errors.append(f"process {proc.pid} did not exit after SIGKILL")
        if not errors:
            self._record.unlink(missing_ok=True)
        if errors and raise_errors:
            raise RuntimeError("network namespace cleanup failed: " + "; ".join(errors))

    # ---- what a host is -------------------------------------------------------------

    def addr(self, i: int) -> str:
        """Host ``i``'s address on the bridge."""
        return f"{self.subnet}.{i + 1}"

    @property
    def addresses(self) -> list[str]:
        """Every host's address, by index."""
        return [self.addr(i) for i in range(self.n)]

    def hostname(self, i: int) -> str:
        """Host ``i``'s name (its namespace's), resolving to :meth:`addr` on every host."""
        return self.namespaces[i]

    def wrap(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run on host ``i``: in its namespace, with a UTS namespace of its own named
        as the host (``ip netns exec``, ``unshare`` and ``sh`` exec it: the pid stays)."""
        return ["ip", "netns", "exec", self.namespaces[i], "unshare", "--uts", "--", "sh",
                "-c", 'hostname "$0" && exec "$@"', self.hostname(i), *argv]

    def shm_dir(self, i: int) -> Path:
        """Host ``i``'s shared memory (its FTRUN_SHM_DIR)."""
        return self.shm_root / str(i)

    def env(self, i: int, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of processes on host ``i``."""
        return {**os.environ, "PYTHONUNBUFFERED": "1", "FTRUN_STATE_DIR": str(self.state_dir),
                "FTRUN_SHM_DIR": str(self.shm_dir(i)), **(extra or {})}

    # ---- processes ------------------------------------------------------------------

    def run(self, i: int, argv: Sequence[str], env: dict[str, str] | None = None,
            name: str | None = None, cwd: Path = REPO) -> subprocess.Popen[str]:
        """Start ``argv`` on host ``i`` in a session of its own; output goes to a log file."""
        if not self._up:
            raise RuntimeError("the cluster is not set up: use it inside `with Cluster(...)`")
        log_path = self.tmp_path / f"{name or f'host{i}'}.{len(self.procs)}.log"
        with open(log_path, "w") as out:
            proc = subprocess.Popen(
                self.wrap(i, argv), stdout=out,
                stderr=subprocess.STDOUT, text=True, env=self.env(i, env), cwd=cwd,
                start_new_session=True,
            )
        proc.log_path = str(log_path)  # type: ignore[attr-defined]
        proc.host = i  # type: ignore[attr-defined]
        self.procs.append((i, proc))
        return proc

    def ftrun(self, i: int, *args: str, env: dict[str, str] | None = None,
              name: str | None = None) -> subprocess.Popen[str]:
        """``python -m ftrun ARGS`` on host ``i``."""
        return self.run(i, [sys.executable, "-m", "ftrun", *args], env=env,
                        name=name or f"host{i}")

    def exec(self, i: int, argv: Sequence[str], timeout_s: float = 60,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run a short command on host ``i`` and return its output."""
        return subprocess.run(self.wrap(i, argv),
                              capture_output=True, text=True, timeout=timeout_s,
                              env=self.env(i, env), cwd=REPO)

    # Read a process's log, wait for it with a bounded timeout: as for local processes.
    output = staticmethod(Procs.output)
    wait = Procs.wait

    def started(self) -> list[subprocess.Popen[str]]:
        return [proc for _, proc in self.procs]

    def succeed(self, procs: Sequence[subprocess.Popen[str]], timeout_s: float) -> str:
        """Wait for every one of ``procs`` (each up to ``timeout_s``); each must exit 0.
        Returns their outputs, joined."""
        outs = []
        for p in procs:
            code = self.wait(p, timeout_s)
            outs.append(self.output(p))
            if code != 0:
                raise AssertionError(f"host {p.host} exited {code}:\n"  # type: ignore[attr-defined]
                                     f"{outs[-1][-4000:]}")
        return "".join(outs)

    def pids(self, i: int) -> list[int]:
        """Every process on host ``i``."""
        return _ns_pids(self.namespaces[i])

    # ---- faults ---------------------------------------------------------------------

    def kill_host(self, i: int, lose_memory: bool = True) -> list[int]:
        """SIGKILL every process on host ``i`` (and, as a real host loss, drop its memory).

        Returns the PIDs killed; raises when there was nothing to kill, so a test cannot
        believe it killed a host that was already gone.
        """
        mine = [proc for host, proc in self.procs if host == i]
        killed = _kill_all(self.namespaces[i], reap=lambda: [p.poll() for p in mine])
        if not killed:
            raise AssertionError(f"host {i} had no process to kill")
        for proc in mine:
            proc.wait(timeout=KILL_TIMEOUT_S)
        if lose_memory:
            shutil.rmtree(self.shm_dir(i), ignore_errors=True)
            self.shm_dir(i).mkdir(parents=True, exist_ok=True)
        self.lost.add(i)
        return killed

    def freeze_host(self, i: int) -> list[int]:
        """SIGSTOP every process on host ``i`` (a host that hangs: its sockets stay open,
        nothing answers). Returns the PIDs stopped; :meth:`thaw_host` resumes them."""
        stopped = []
        for pid in self.pids(i):
            if pid == os.getpid():
                continue
            try:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            except ProcessLookupError:
                pass
        if not stopped:
            raise AssertionError(f"host {i} had no process to freeze")
        return stopped

    def thaw_host(self, i: int) -> None:
        """SIGCONT every process on host ``i``."""
        for pid in self.pids(i):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def cut_link(self, i: int) -> None:
        """Take host ``i`` off the network: its processes live on, unreachable."""
        _ip("link", "set", self.veths[i], "down")

    def restore_link(self, i: int) -> None:
        _ip("link", "set", self.veths[i], "up")

    def slow_link(self, i: int, rate: str, burst: str = "64kb", latency: str = "200ms") -> None:
        """Cap host ``i``'s traffic, both ways, at ``rate`` (tc syntax: "100mbit", "10mbps")."""
        tbf = ["tbf", "rate", rate, "burst", burst, "latency", latency]
        subprocess.run(["tc", "qdisc", "replace", "dev", self.veths[i], "root", *tbf],
                       check=True, capture_output=True, timeout=IP_TIMEOUT_S)
        subprocess.run(["ip", "netns", "exec", self.namespaces[i], "tc", "qdisc", "replace",
                        "dev", "eth0", "root", *tbf],
                       check=True, capture_output=True, timeout=IP_TIMEOUT_S)

    def unslow_link(self, i: int) -> None:
        subprocess.run(["tc", "qdisc", "del", "dev", self.veths[i], "root"],
                       capture_output=True, timeout=IP_TIMEOUT_S)
        subprocess.run(["ip", "netns", "exec", self.namespaces[i], "tc", "qdisc", "del",
                        "dev", "eth0", "root"], capture_output=True, timeout=IP_TIMEOUT_S)
