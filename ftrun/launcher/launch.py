"""``ftrun [TORCHRUN FLAGS] [FTRUN FLAGS] SCRIPT [ARGS]``: the node launcher.

Order of business on every node:

1. Parse with torchrun's own parser (plus ftrun's group); fill rendezvous settings from Slurm
   when running under ``srun`` and the user did not give them.
2. Decide, before any rendezvous, which launcher hosts the rendezvous TCPStore. That launcher
   also runs the job's coordinator, so both live in one predictable place:
   - ``--coordinator HOST:PORT`` given: a standalone ``ftrun coordinator`` hosts both;
   - under Slurm, with the endpoint taken from Slurm: node 0 (``SLURM_NODEID=0``, the first
     host of the nodelist), whatever the host names resolve to;
   - ``--standalone`` or a single node: this launcher;
   - otherwise torch's rule: the launcher on the ``--rdzv-endpoint`` host that binds first.
   Under torch's rule a launcher that finds the port taken (by another launcher or a
   standalone ``ftrun coordinator`` on its host) uses the store there; under Slurm or with
   ``is_host=1`` a taken port is an error.
   The coordinator's endpoint is published in that store, where every launcher finds it.
   With ``--rdzv-backend etcd`` there is no such launcher: the rendezvous state lives in
   etcd (v3 API, :mod:`ftrun.launcher.etcd_rdzv`), and the launchers elect the one that runs
   the coordinator there (:class:`~ftrun.launcher.etcd.CoordinatorElection`), which publishes
   its endpoint in etcd. There the role fails over: every launcher follows it in etcd, one
   takes it when its holder's lease runs out (the holder's host died, or froze), and every
   launcher moves its reporter, its store and its future ranks to the new coordinator
   (:meth:`NodeServices._coordinator_moved`); a holder whose lease ran out steps down.
3. Tune the c10d rendezvous' dead-node detection (unless ``--rdzv-conf`` sets it), turn off
   torch's shared rendezvous store (restarted ranks read stale gloo addresses through it),
   and run torch's elastic launch with :class:`FtrunAgent`, inside the node's services
   (:class:`NodeServices`: started in order before the launch, closed in reverse after it).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import hashlib
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from ftrun import _torch, exit_codes, jobs, knobs, protocol
from ftrun.coordinator.api import NodeState
from ftrun.errors import ConfigError, FtrunError
from ftrun.launcher import slurm
from ftrun.launcher.agent import AgentContext, FtrunAgent, HostIsolated
from ftrun.launcher.args import (
    FtrunOptions,
    build_parser,
    check_redundancy,
    explicit_dests,
    ftrun_options,
)
from ftrun.launcher.probe import ProbeService, probe_and_report
from ftrun.launcher.store_proc import StoreProcess
from ftrun.pdeath import LAUNCHER_PID_ENV
from ftrun.rank.progress import STACKS_SIGNAL, last_steps
from ftrun.sigrelay import SignalRelay
from ftrun.store.api import StoreConfig

if TYPE_CHECKING:
    from ftrun.coordinator.client import NodeReporter
    from ftrun.coordinator.server import Coordinator
    from ftrun.launcher.etcd import CoordinatorElection, CoordinatorRecord, EtcdClient

log = logging.getLogger(__name__)

C10D_DEFAULT_PORT = 29400
# --rdzv-backend names that mean ftrun's etcd v3 backend (torch's registry maps "etcd" to its
# legacy v2 backend; ftrun hands torch the name its v3 backend is registered under).
ETCD_BACKENDS = ("etcd", "etcd-v3")
SLURM_RDZV_PORT = 29500
# c10d's defaults take 15 s (keep-alive 5 s x 3) to drop a dead node and then wait a 30 s
# last call. 2 s x 3 tolerates a launcher stalled for ~4 s on a loaded host; 1 s x 2 was
# measured to split a job into two worlds. Only applied where --rdzv-conf is silent.
RDZV_TUNING = {"keep_alive_interval": "2", "keep_alive_max_attempt": "3", "last_call_timeout": "5"}
COORDINATOR_KEY = "ftrun/coordinator"
# How long the launcher that runs the coordinator keeps it up, as it exits, for other nodes'
# final persists: in all, and for a node that has not begun its final persist yet (a node
# that is not stopping at all does not hold up the exit for longer than that).
FINAL_PERSIST_WAIT_S = 120.0
FINAL_START_GRACE_S = 10.0
# With --coordinator: how long the launcher waits for the coordinator's answer to its hello
# (where the ranks report their collectives) before it starts the workers without it.
HELLO_WAIT_S = 10.0
COLL_RELAY_WAIT_S = 5.0  # for the reporter thread to make its collective relay


@dataclass
class RendezvousPlan:
    host: str
    port: int
    is_host: bool
    store: Any = None  # our own TCPStore handle: the server on the host, a client elsewhere
    etcd: EtcdClient | None = None  # --rdzv-backend etcd: the cluster holding the rendezvous


def _parse_conf(conf: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in conf.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--rdzv-conf item {item!r} is not KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def _format_conf(conf: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in conf.items())


def _split_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host:
        return endpoint.strip("[]"), default_port
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise ConfigError(f"rendezvous endpoint {endpoint!r} has a bad port; use HOST:PORT") from None


def apply_slurm(args: argparse.Namespace, explicit: set[str], environ: dict[str, str]) -> bool:
    """Fill nnodes, node rank, rendezvous id and endpoint from SLURM_* where not given.

    Returns whether the rendezvous endpoint came from Slurm: then node 0 hosts the store.
    """
    derived = slurm.derive(environ)
    if derived is None:
        return False
    for warning in derived.warnings:
        log.warning("%s", warning)
    if not derived.in_step:
        return False
    if "standalone" in explicit and args.standalone:
        return False
    if "nnodes" not in explicit:
        args.nnodes = derived.nnodes
    if "node_rank" not in explicit:
        args.node_rank = derived.node_rank
    if "rdzv_id" not in explicit:
        args.rdzv_id = derived.rdzv_id
    if "rdzv_backend" not in explicit:
        args.rdzv_backend = "c10d"
    endpoint_from_slurm = "rdzv_endpoint" not in explicit and args.rdzv_backend == "c10d"
    if endpoint_from_slurm:
        args.rdzv_endpoint = f"{derived.rdzv_host}:{SLURM_RDZV_PORT}"
    log.info(
        "Slurm job %s: nnodes=%s node_rank=%s rdzv_id=%s rdzv_endpoint=%s",
        derived.job_id, args.nnodes, derived.node_rank, args.rdzv_id, args.rdzv_endpoint,
    )
    return endpoint_from_slurm


def check_script(args: argparse.Namespace) -> None:
    script = args.training_script
    if args.module:
        return
    if args.no_python:
        if os.path.sep in script and not os.path.isfile(script):
            raise ConfigError(f"program {script!r} not found")
        if os.path.sep not in script and shutil.which(script) is None:
            raise ConfigError(f"program {script!r} not found on PATH")
        return
    if not os.path.isfile(script):
        raise ConfigError(
            f"training script {script!r} not found (cwd {os.getcwd()}); pass a path to a "
            "Python file, or -m MODULE"
        )


def _tcp_store(host: str, port: int, is_master: bool, timeout_s: float,
               bind_host: str | None = None) -> Any:
    """The rendezvous TCPStore at ``host:port``: its server where ``is_master`` (listening on
    ``bind_host`` only when given, else on every interface as torch's), else a client."""
    from torch.distributed import TCPStore

    if is_master and bind_host:
        return _torch.bound_tcp_store(host, port, bind_host, timeout_s)
    return TCPStore(
        host, port, is_master=is_master, multi_tenant=True, wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
    )


def is_local_address(host: str) -> bool:
    """Whether ``host`` names an address of this machine's (network namespace's) interfaces:
    only there can a socket bind to it."""
    try:
        if Path("/proc/sys/net/ipv4/ip_nonlocal_bind").read_text().strip() != "0":
            return False  # any address binds: binding proves nothing
    except OSError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((sockaddr[0], 0))
            except OSError:
                continue
            return True
    return False


def plan_rendezvous(
    args: argparse.Namespace, explicit: set[str], external: bool, node0_hosts: bool = False,
    bind_host: str | None = None,
) -> RendezvousPlan | None:
    """Decide who hosts the rendezvous store (and so the coordinator). Mutates ``args``.

    ``node0_hosts``: the endpoint is node 0's host (Slurm's first host), so the launcher of
    node rank 0 hosts, and no other. ``bind_host`` (``--bind-host``): where a store hosted
    here listens (default: every interface, as torch's).
    """
    _, max_nodes = (int(x) for x in (args.nnodes.split(":") * 2)[:2])
    single = args.standalone or (
        args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None
        and max_nodes == 1
    )
    if single:
        # torch would bind localhost:0 inside its rendezvous; bind it here instead so the
        # port is known before the coordinator publishes itself in the store. Every client
        # is on this host: the store listens on localhost only (torch's on every interface).
        store = _tcp_store("localhost", 0, True, 60, bind_host="localhost")
        args.standalone = False
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = f"localhost:{store.port}"
        if args.rdzv_id == "none" or "rdzv_id" not in explicit:
            args.rdzv_id = str(uuid.uuid4())
        return RendezvousPlan("localhost", store.port, True, store)

    if args.rdzv_backend == "static":
        host = args.master_addr
        port = args.master_port if args.master_port is not None else 29500
        return RendezvousPlan(host, port, args.node_rank == 0)

    if args.rdzv_backend in ETCD_BACKENDS:
        return _plan_etcd(args)
    if args.rdzv_backend == "etcd-v2":
        raise ConfigError(
            "--rdzv-backend etcd-v2 uses etcd's deprecated v2 API, which ftrun does not "
            "support; use --rdzv-backend etcd (ftrun's backend on etcd's v3 API)"
        )
    if args.rdzv_backend != "c10d":
        return None  # another backend of torch's: no store of ours to publish in

    conf = _tuned_conf(args.rdzv_conf)
    host, port = _split_endpoint(args.rdzv_endpoint or "localhost", C10D_DEFAULT_PORT)
    join_timeout = float(conf.get("join_timeout", 600))
    explicit_host = "is_host" in conf
    if explicit_host:
        is_host = conf["is_host"].lower() in ("1", "true", "yes", "y")
    elif external:
        is_host = False
    elif node0_hosts:
        # Decided by rank, not by resolving host names: several nodes may share a host (or
        # its name may resolve oddly), and the first to bind would win under torch's rule.
        is_host = args.node_rank == 0
    else:
        # torch's own rule: the launcher on the endpoint's host that binds first. torch
        # compares the endpoint with what this machine's name resolves to, which misses an
        # address on a second interface (or in a network namespace): one of this machine's
        # own addresses counts as well.
        is_host = _torch.is_this_host(host) or is_local_address(host)
    store = None
    if is_host:
        try:
            store = _tcp_store(host, port, True, join_timeout, bind_host=bind_host)
        except Exception as e:
            # Under Slurm the port is the fixed default: a taken one is another job's.
            if explicit_host or node0_hosts:
                raise ConfigError(
                    f"cannot host the rendezvous store on {host}:{port}: {e}. Is another job "
                    "using that port? Pick another with --rdzv-endpoint."
                ) from e
            # Another launcher on this host, or `ftrun coordinator`, holds it already.
            is_host = False
    conf["is_host"] = "1" if is_host else "0"
    args.rdzv_conf = _format_conf(conf)
    return RendezvousPlan(host, port, is_host, store)


def _tuned_conf(rdzv_conf: str) -> dict[str, str]:
    """``--rdzv-conf`` with :data:`RDZV_TUNING` where it is silent."""
    conf = _parse_conf(rdzv_conf)
    for key, value in RDZV_TUNING.items():
        conf.setdefault(key, value)
    return conf


def _plan_etcd(args: argparse.Namespace) -> RendezvousPlan:
    """``--rdzv-backend etcd``: check that the endpoints name a reachable etcd cluster,
    register ftrun's v3 backend with torch and point ``args`` at it. Mutates ``args``."""
    from ftrun.launcher import etcd, etcd_rdzv

    if not args.rdzv_endpoint:
        raise ConfigError("--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT[,HOST:PORT...]: "
                          "the client URLs of the etcd cluster's members (1, 3 or 5)")
    conf = _tuned_conf(args.rdzv_conf)
    if "is_host" in conf:
        raise ConfigError("--rdzv-conf is_host is c10d's (which launcher hosts its store); "
                          "with --rdzv-backend etcd no launcher hosts the rendezvous: drop it")
    try:
        timeout_s = float(conf.get("read_timeout", etcd.REQUEST_TIMEOUT_S))
    except ValueError:
        raise ConfigError(f"--rdzv-conf read_timeout={conf['read_timeout']!r}: give seconds, "
                          "e.g. read_timeout=5") from None
    client = etcd.EtcdClient(args.rdzv_endpoint, timeout_s=timeout_s,
                             tls=etcd.EtcdTLS.from_conf(conf.get))
    etcd.check_endpoints(client)
    etcd_rdzv.register()
    args.rdzv_backend = etcd_rdzv.BACKEND_NAME
    args.rdzv_endpoint = client.endpoints_text
    args.rdzv_conf = _format_conf(conf)
    host, port = client.endpoints[0]
    return RendezvousPlan(host, port, False, etcd=client)


def _node_dir(run_id: str) -> Path:
    base = Path(tempfile.gettempdir()) / f"ftrun-{os.getuid()}"
    base.mkdir(mode=0o700, exist_ok=True)
    # Short on purpose: the store's socket lives here and socket paths max out at 107 bytes.
    tag = hashlib.sha1(run_id.encode()).hexdigest()[:8]
    return Path(tempfile.mkdtemp(prefix=f"{tag}.", dir=base))


def _store_url(node_dir: Path) -> str:
    path = node_dir / "store.sock"
    if len(str(path)) <= 100:
        return f"ipc://{path}"
    # A long TMPDIR: use Linux's abstract socket namespace (messages are still signed).
    return f"ipc://@ftrun-{os.getuid()}-{node_dir.name}"


def _replica_host(plan: RendezvousPlan | None) -> str:
    """Where this node's store takes replicas by default: the rendezvous endpoint's host on
    the node that hosts it (peers reach it there already), elsewhere this node's own address
    on the route to that host."""
    if plan is None or plan.host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:
        addr = socket.getaddrinfo(plan.host, plan.port, type=socket.SOCK_DGRAM)[0]
        if plan.is_host:
            return str(addr[4][0])
        with socket.socket(addr[0], socket.SOCK_DGRAM) as s:
            s.connect(addr[4])  # no packet is sent: this only picks the route
            return str(s.getsockname()[0])
    except OSError as e:
        raise ConfigError(f"cannot find this node's address toward the rendezvous host "
                          f"{plan.host} ({e}); pass --replica-addr HOST") from e


def _install_signal_forwarding(ctx: AgentContext) -> SignalRelay:
    """SIGUSR1 is passed on to the workers and the store from a thread (see ftrun.sigrelay);
    SIGUSR2 acts in its handler, which must raise in the main thread's rendezvous wait."""
    def forward(signum: int) -> None:
        if ctx.agent is not None:
            ctx.agent.forward_signal(signum)

    def interrupt(_signum: int, _frame: Any) -> None:
        if ctx.agent is not None:
            ctx.agent.on_interrupt()  # raises HostIsolated in a rendezvous wait

    signal.signal(signal.SIGUSR2, interrupt)
    # As a rank does (ftrun.rank.progress), the launcher writes its threads' Python stacks on
    # STACKS_SIGNAL (kill -s RTMIN+5 PID), here to its stderr: where a launcher waits.
    with contextlib.suppress(OSError, RuntimeError, ValueError):
        faulthandler.register(STACKS_SIGNAL, all_threads=True)
    return SignalRelay(forward, signal.SIGUSR1, name="ftrun-forward-signals").start()


def _detection_config(opts: FtrunOptions) -> Any:
    """What the coordinator does about hangs and slow ranks, hosts and links."""
    from ftrun.coordinator.detect import DetectConfig

    return DetectConfig(on_hang=opts.on_hang, on_slow=opts.on_slow,
                        on_corruption=opts.on_corruption, isolate_hook=opts.isolate_hook,
                        busy_hang_s=opts.busy_hang_s)


def _probe_runner(ctx: AgentContext, secret: bytes, run_id: str, endpoint: str,
                  detect: Callable[[], str]) -> Any:
    """Start each probe directive on a thread of its own: probes take seconds, and the agent's
    thread watches the workers. Results go to the coordinator's detection endpoint
    (``detect()``: the current one)."""
    def run_probe(directive: dict[str, Any]) -> None:
        def probe() -> None:
            try:
                probe_and_report(directive, node_id=ctx.node_id, host=ctx.host, secret=secret,
                                 run_id=run_id, detect_endpoint=detect() or endpoint)
            except Exception:  # noqa: BLE001 - logged; the agent goes on
                log.exception("probe directive %s failed", directive.get("id"))

        threading.Thread(target=probe, name="ftrun-prober", daemon=True).start()

    return run_probe


class NodeServices:
    """The services one node launcher runs around torchrun's launch.

    :meth:`start` starts them in this order, and :meth:`close` closes the ones started in the
    reverse order (a failed start closes those before it, then raises):

    1. this node's private directory (the store's socket and the ranks' progress files);
    2. the job's coordinator, when this launcher hosts the rendezvous store and no
       ``--coordinator`` is given: started, its endpoints published in the rendezvous store,
       the job's files written. Otherwise nothing starts: the endpoints are read from the
       rendezvous store, or ``--coordinator`` names the coordinator;
    3. the link-probe service, on the address replicas use;
    4. the node reporter, when there is a coordinator;
    5. the snapshot store process, and the file that names its URL;
    6. forwarding of SIGUSR1 and SIGUSR2 to the agent.

    Each close is bounded by the service's own timeout (the coordinator first serves other
    nodes' final persists, at most :data:`FINAL_PERSIST_WAIT_S`); one that fails is logged
    and the rest still close. :meth:`launch` runs torchrun's launch with an
    :class:`FtrunAgent` on :attr:`ctx` and records the exit code and final state that the
    reporter's ``job_end`` event and ``bye`` carry.
    """

    # Set by start(), in order.
    node_dir: Path
    store_url: str
    ctx: AgentContext
    data_host: str  # replicas, the shard service and link probes listen here
    probe_addr: str
    store: StoreProcess

    def __init__(self, args: argparse.Namespace, opts: FtrunOptions,
                 plan: RendezvousPlan | None) -> None:
        self.args = args
        self.opts = opts
        self.plan = plan
        self.run_id: str = args.rdzv_id
        self.host = socket.gethostname()
        self.node_id = f"{self.host}/{os.getpid()}"
        self.secret = jobs.load_secret(self.run_id, opts.state_dir)
        # The coordinator's endpoint: --coordinator, the one this launcher runs, or the one
        # published in the rendezvous store; None when the job has none.
        self.endpoint: str | None = opts.coordinator
        # Where the ranks report their collectives (ftrun.rank.collectives); "" turns that off.
        # With --coordinator (no rendezvous store to read it from) the coordinator's answer to
        # this launcher's hello says it.
        self.detect_endpoint = ""
        self.coordinator: Coordinator | None = None
        self.reporter: NodeReporter | None = None
        # --rdzv-backend etcd: the coordinator role's term and holder this node reports to,
        # and this launcher's candidacy for the role.
        self.term = 0
        self.holder = ""
        self._election: CoordinatorElection | None = None
        self._failover_lock = threading.RLock()
        self.exitcode = 1
        self.final = NodeState.FAILED
        self._store_file: Path | None = None
        self._closers: list[tuple[str, Callable[[], None]]] = []

    def __enter__(self) -> NodeServices:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def start(self) -> NodeServices:
        """Start the node's services in order (see the class); on a failure, close the ones
        already started and re-raise."""
        try:
            self._make_node_dir()
            self._start_coordinator()
            self._make_context()
            self._start_prober()
            self._start_reporter()
            self._start_store()
            self._start_forwarding()
            self._start_watch()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Close the services started, in the reverse order. Idempotent."""
        while self._closers:
            name, close = self._closers.pop()
            try:
                close()
            except Exception:  # noqa: BLE001 - logged; the other services still close
                log.exception("closing the %s failed; closing the rest", name)

    def _on_close(self, name: str, close: Callable[[], None]) -> None:
        self._closers.append((name, close))

    # -- starting ----------------------------------------------------------------------------

    def _make_node_dir(self) -> None:
        self.node_dir = _node_dir(self.run_id)
        self._on_close("node directory", lambda: shutil.rmtree(self.node_dir, ignore_errors=True))
        self.store_url = _store_url(self.node_dir)

    def _start_coordinator(self) -> None:
        from ftrun.coordinator.server import (
            lookup_detect_endpoint,
            lookup_endpoint,
            publish_endpoint,
        )

        plan = self.plan
        if plan is None or self.endpoint is not None:
            return
        if plan.etcd is not None:
            self._elect_coordinator(plan.etcd)
            return
        if not plan.is_host:
            timeout_s = self._join_timeout_s()
            store = _tcp_store(plan.host, plan.port, False, timeout_s)
            self.endpoint = lookup_endpoint(store, timeout_s)
            self.detect_endpoint = lookup_detect_endpoint(store)
            return
        self._run_coordinator(plan.host if plan.host != "localhost" else "127.0.0.1",
                              f"{plan.host}:{plan.port}")
        if plan.store is None:
            plan.store = _tcp_store(plan.host, plan.port, True, 60, bind_host=self.opts.bind_host)
        publish_endpoint(plan.store, self.endpoint, self.detect_endpoint)

    def _join_timeout_s(self) -> float:
        return float(_parse_conf(self.args.rdzv_conf).get("join_timeout", 600))

    def _elect_coordinator(self, client: EtcdClient) -> None:
        """--rdzv-backend etcd: run the coordinator if this launcher wins the role in etcd,
        else read the winner's endpoints there."""
        from ftrun.launcher.etcd import CoordinatorElection, LauncherPresence, wait_coordinator

        # First, so left last: after a job that ended well, the last launcher out deletes the
        # job's keys; the first launcher of a new run clears a previous run's rendezvous.
        presence = LauncherPresence(client, self.run_id, self.node_id)
        presence.join()
        self._on_close("presence in etcd", lambda: presence.leave(done=self.exitcode == 0))
        election = CoordinatorElection(client, self.run_id, self.node_id, self.host,
                                       on_lost=self._role_lost)
        self._election = election
        # Registered first, so closed last: the role is given up once the coordinator
        # stopped. Any launcher may come to run the coordinator (failover): its closer has
        # its place here, before the reporter's and the store's, whoever runs it.
        self._on_close("coordinator role in etcd", election.resign)
        self._on_close("coordinator", self._stop_coordinator)
        holds = election.campaign() is None
        if holds:
            self._take_role()
        record = wait_coordinator(client, self.run_id, self._join_timeout_s(),
                                  on_vacant=self._role_vacant)
        if record.node_id != self.node_id:
            log.info("coordinator of job %s at %s (run by %s, term %d, found in etcd)",
                     self.run_id, record.endpoint, record.node_id, record.term)
        self.endpoint, self.detect_endpoint = record.endpoint, record.detect_endpoint
        self.term, self.holder = record.term, record.node_id

    def _take_role(self) -> None:
        """This launcher holds the coordinator role: start the coordinator, bound to the
        role's term, and publish it in etcd."""
        from ftrun.launcher.etcd import URL_SCHEME

        election, plan = self._election, self.plan
        assert election is not None and plan is not None and plan.etcd is not None
        coordinator = self._run_coordinator(
            self.opts.replica_addr or _replica_host(plan),
            URL_SCHEME + plan.etcd.endpoints_text, role=election)
        try:
            election.publish(coordinator.endpoint, coordinator.detect_endpoint or "")
        except Exception:
            self._drop_coordinator("its role was lost before it was published")
            raise

    def _start_watch(self) -> None:
        """--rdzv-backend etcd: follow the coordinator role (failover)."""
        from ftrun.launcher.etcd import CoordinatorWatch

        plan = self.plan
        if plan is None or plan.etcd is None or self._election is None:
            return
        watch = CoordinatorWatch(plan.etcd, self.run_id, self.term,
                                 on_change=self._coordinator_moved, on_vacant=self._role_vacant)
        watch.start()
        self._on_close("coordinator watch", watch.stop)

    def _role_vacant(self) -> None:
        """Nobody holds the coordinator role (its holder's lease ran out): take it. Called
        from the watch's thread; the watch then finds the new holder (maybe this one)."""
        from ftrun.launcher.etcd import ended_key

        election, plan = self._election, self.plan
        assert election is not None and plan is not None and plan.etcd is not None
        with self._failover_lock:
            if self.coordinator is not None and self.coordinator.acting():
                return  # ours: the key will be back (the watch read between two writes)
            if plan.etcd.get(ended_key(self.run_id)) is not None:
                return  # the job ended while this launcher was away (its rendezvous says so)
            self._drop_coordinator("its role is vacant")
            holder = election.campaign()
            if holder is not None:
                log.info("coordinator role of job %s taken by %s (term %d)", self.run_id,
                         holder.node_id, holder.term)
                return
            log.warning("the coordinator role of job %s was vacant (holder %s, term %d, gone)"
                        ": this launcher takes it (term %d)", self.run_id, self.holder,
                        self.term, election.term)
            self._take_role()

    def _coordinator_moved(self, record: CoordinatorRecord) -> None:
        """A new coordinator holds the role (failover): report to it from now on, from this
        launcher, its store and the ranks it starts next. Called from the watch's thread."""
        from dataclasses import replace

        if record.term <= self.term:
            return
        old_term, old_holder = self.term, self.holder
        self.term, self.holder = record.term, record.node_id
        self.endpoint, self.detect_endpoint = record.endpoint, record.detect_endpoint
        log.warning("coordinator failover: job %s's coordinator is now %s at %s (term %d; was "
                    "%s, term %d)", self.run_id, record.node_id, record.endpoint, record.term,
                    old_holder, old_term)
        worker_env = self.ctx.worker_env
        worker_env[knobs.COORDINATOR.name] = record.endpoint
        if self._coll_relay() is None:
            worker_env[knobs.DETECT.name] = record.detect_endpoint
        # else the ranks keep reporting to this launcher's relay, which follows the new
        # coordinator once it answers the reporter's hello
        if self.reporter is not None:
            self.reporter.retarget(record.endpoint, record.term)
            self.ctx.run_probe = _probe_runner(self.ctx, self.secret, self.run_id,
                                               record.endpoint, lambda: self.detect_endpoint)
            self.reporter.event("coordinator_failover", old_term=old_term,
                                new_term=record.term, old_holder=old_holder,
                                new_holder=record.node_id, endpoint=record.endpoint)
        store = getattr(self, "store", None)
        if store is not None:
            # A store restarted later starts with the new coordinator.
            store.cfg = replace(store.cfg, coordinator=record.endpoint,
                                coordinator_term=record.term)
            self._tell_store(record)

    def _tell_store(self, record: CoordinatorRecord) -> None:
        """Move this node's store to the new coordinator (bounded; a store that does not
        answer learns it when the launcher restarts it)."""
        from ftrun.protocol.transport import Client

        client = Client(self.store_url, self.secret, self.run_id, f"launcher:{self.node_id}",
                        peer="snapshot store")
        try:
            client.request("coordinator_moved", {"endpoint": record.endpoint,
                                                 "term": record.term}, "ack", 5.0, attempts=2)
        except FtrunError as e:
            log.error("could not move this node's snapshot store to the new coordinator "
                      "(%s); its commits wait until it learns it", e)
        finally:
            client.close()

    def _role_lost(self, reason: str) -> None:
        """This launcher's lease on the coordinator role ran out (its host froze, or etcd was
        unreachable for the whole TTL): its coordinator steps down and stops; the watch then
        finds whoever holds the role now, or takes it again. From the lease's thread."""
        threading.Thread(target=self._drop_coordinator, args=(f"lease lost: {reason}",),
                         name="ftrun-coordinator-step-down", daemon=True).start()

    def _drop_coordinator(self, reason: str) -> None:
        """Step the coordinator this launcher runs down and stop it, if there is one."""
        with self._failover_lock:
            coordinator, self.coordinator = self.coordinator, None
        if coordinator is None:
            return
        coordinator.step_down(reason)
        coordinator.stop()

    def _run_coordinator(self, advertise_host: str, rdzv_endpoint: str,
                         role: CoordinatorElection | None = None) -> Coordinator:
        """Start the job's coordinator in this launcher and record it in the job file.
        ``role``: the coordinator role it holds (etcd), whose term it is bound to."""
        from ftrun.coordinator.server import Coordinator

        opts, run_id = self.opts, self.run_id
        coordinator = Coordinator(
            run_id, self.secret,
            bind_host=opts.bind_host,
            advertise_host=advertise_host,
            node_timeout_s=opts.node_timeout_s,
            events_file=jobs.events_path(run_id, opts.state_dir),
            detection=_detection_config(opts),
            role=role,
        )
        coordinator.start()
        self.coordinator = coordinator
        if role is None:
            self._on_close("coordinator", self._stop_coordinator)
            self.endpoint = coordinator.endpoint
            self.detect_endpoint = coordinator.detect_endpoint or ""
        # (With a role, the node moves to it once it is published: _coordinator_moved.)
        if knobs.SECRET.get():
            # For `ftrun status` from any shell that sees the state directory (a requeued
            # job's new secret replaces the old one).
            jobs.write_secret(run_id, self.secret, opts.state_dir)
        jobs.write_job_file(
            jobs.JobFile(run_id=run_id, endpoint=coordinator.endpoint, host=self.host,
                         pid=os.getpid(),
                         started_at=time.time(), rdzv_endpoint=rdzv_endpoint),
            opts.state_dir,
        )
        log.info("coordinator of job %s at %s", run_id, coordinator.endpoint)
        return coordinator

    def _make_context(self) -> None:
        opts = self.opts
        ctx = AgentContext(node_id=self.node_id, host=self.host, node_dir=self.node_dir,
                           hang_timeout_s=opts.hang_timeout_s, warm_workers=opts.warm_workers,
                           warm_imports=opts.warm_imports)
        ctx.worker_env = {
            knobs.STORE.name: self.store_url,
            knobs.SECRET.name: self.secret.decode(),
            knobs.PERSIST_DIR.name: opts.persist.dir or "",
            knobs.START_FRESH.name: "1" if opts.start_fresh else "0",
            knobs.SNAPSHOT_EVERY.name: opts.snapshot_every,
            knobs.SNAPSHOT_WAIT.name: str(opts.snapshot_wait_s),
            knobs.RUN_ID.name: self.run_id,
            knobs.JOB_DIR.name: str(jobs.job_dir(self.run_id, opts.state_dir)),
            knobs.NODE_ID.name: self.node_id,
            knobs.COORDINATOR.name: self.endpoint or "",
            knobs.DETECT.name: self.detect_endpoint,
            LAUNCHER_PID_ENV: str(os.getpid()),
        }
        # NCCL's per-collective durations, for the ranks' collective monitor (the user's
        # choice wins: worker_env overrides the launcher's environment, which the ranks
        # inherit).
        if "TORCH_NCCL_ENABLE_TIMING" not in os.environ:
            ctx.worker_env["TORCH_NCCL_ENABLE_TIMING"] = "1"
        # Restarted ranks must not bootstrap through the previous round's shared store.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        self.ctx = ctx

    def _start_prober(self) -> None:
        # Replicas, the shard service (restores read other nodes' shards through it) and link
        # probes all use the same interface.
        self.data_host = self.opts.replica_addr or _replica_host(self.plan)
        prober = ProbeService(self.run_id, self.node_id, self.secret)
        try:
            self.probe_addr = prober.start(self.data_host)
        except zmq.ZMQError as e:
            raise ConfigError(f"cannot listen for link probes on {self.data_host} ({e}); pass "
                              "--replica-addr with an address of this machine") from e
        self._on_close("link-probe service", prober.stop)

    def _start_reporter(self) -> None:
        from ftrun.coordinator.client import NodeReporter

        if not self.endpoint:
            return
        ctx, endpoint = self.ctx, self.endpoint
        reporter = NodeReporter(endpoint, self.secret, self.run_id, self.node_id, self.host,
                                self._node_state, interval_s=self.opts.heartbeat_interval_s,
                                on_directive=ctx.on_directive, on_hello=self._hello_answered,
                                term=self.term)
        self.reporter = reporter
        reporter.start()
        self._on_close("node reporter", self._stop_reporter)
        ctx.sink = reporter
        ctx.run_probe = _probe_runner(ctx, self.secret, self.run_id, endpoint,
                                      lambda: self.detect_endpoint)
        reporter.coll_ready.wait(COLL_RELAY_WAIT_S)
        relay = self._coll_relay()
        if relay is not None and ctx.worker_env.get(knobs.DETECT.name):
            # The ranks report their collectives to this launcher, which passes them on.
            ctx.worker_env[knobs.DETECT.name] = relay
        if self.opts.coordinator is not None and not reporter.wait_hello(HELLO_WAIT_S):
            log.warning("the coordinator at %s did not answer within %.0f s; this node's ranks "
                        "report their collectives only from their first start after it does",
                        endpoint, HELLO_WAIT_S)

    def _node_state(self) -> dict[str, Any]:
        """The reporter's heartbeat fields (called from its thread)."""
        agent = self.ctx.agent
        base = {"state": NodeState.INIT, "group_rank": None, "group_world_size": None,
                "restarts": 0, "max_restarts": self.args.max_restarts, "workers": [],
                "last_error": None}
        fields = agent.node_state() if agent is not None else base
        return {**fields, "probe_addr": self.probe_addr}

    def _hello_answered(self, body: dict[str, Any]) -> None:
        """The coordinator's answer to hello (the reporter calls this once, from its thread)."""
        from ftrun.coordinator.client import policy_mismatch

        opts = self.opts
        mismatch = policy_mismatch(body, opts.on_hang, opts.on_slow, opts.on_corruption)
        if mismatch is not None:
            log.warning("%s", mismatch)
            if self.reporter is not None:
                self.reporter.event("policy_mismatch", on_hang=opts.on_hang,
                                    on_slow=opts.on_slow,
                                    coordinator_on_hang=body.get("on_hang"),
                                    coordinator_on_slow=body.get("on_slow"),
                                    on_corruption=opts.on_corruption,
                                    coordinator_on_corruption=body.get("on_corruption"))
        worker_env = self.ctx.worker_env
        if body.get("detect"):
            protocol.split_endpoint(body["detect"])  # validate
            if not self.detect_endpoint:
                self.detect_endpoint = body["detect"]
        if not worker_env.get(knobs.DETECT.name) and body.get("detect"):
            # Ranks started from now on report their collectives there (through this
            # launcher's relay when it has one).
            worker_env[knobs.DETECT.name] = self._coll_relay() or body["detect"]

    def _coll_relay(self) -> str | None:
        """The address of this launcher's relay for its ranks' collective reports, if any."""
        coll = getattr(self.reporter, "coll", None) if self.reporter is not None else None
        return coll.address if coll is not None else None

    def _start_store(self) -> None:
        ctx, opts = self.ctx, self.opts
        plan = opts.plan()  # --redundancy: replicas (copies) or erasure coding (ec_k, ec_m)
        store = StoreProcess(
            StoreConfig(run_id=self.run_id, url=self.store_url, coordinator=self.endpoint,
                        node_id=self.node_id, owner_pid=os.getpid(), persist=opts.persist,
                        threads=opts.store_threads,
                        replicas=1 if plan.erasure else plan.copies,
                        ec_k=plan.k, ec_m=plan.m,
                        replica_host=self.data_host,
                        replica_rate_mb_s=opts.replica_rate_mb_s,
                        coordinator_term=self.term),
            env={knobs.SECRET.name: self.secret.decode()},
        )
        self.store = ctx.store = store
        store.start()
        self._on_close("snapshot store", self._stop_store)
        ctx.sink.event("store_started", pid=store.pid, url=self.store_url)
        self._store_file = jobs.write_store_url(self.run_id, self.node_id, self.store_url,
                                                opts.state_dir)

    def _start_forwarding(self) -> None:
        forwarding = _install_signal_forwarding(self.ctx)
        self._on_close("signal forwarding", forwarding.close)

    # -- running -----------------------------------------------------------------------------

    def launch(self) -> int:
        """Run torchrun's launch on this node; returns the launcher's exit code."""
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.elastic.rendezvous.api import RendezvousError

        ctx = self.ctx
        try:
            # torch's launch_agent builds an FtrunAgent where it builds a LocalElasticAgent.
            _torch.run_torchrun(self.args, lambda **kwargs: FtrunAgent(ctx=ctx, **kwargs))
            self.exitcode, self.final = 0, NodeState.SUCCEEDED
        except ChildFailedError as e:
            log.error("%s", e.format_msg())
        except HostIsolated as e:
            # torch's agent killed the workers and left the rendezvous open (see HostIsolated).
            log.error("this host (%s) was isolated by the job's coordinator: %s. The launcher "
                      "exits with code %d; the other nodes go on without it%s", self.host,
                      e.reason, exit_codes.ISOLATED,
                      " (but this launcher runs the job's rendezvous store and coordinator, so "
                      "the job ends with it; run `ftrun coordinator` on a host of its own to "
                      "keep a job going when a host is isolated)"
                      if self.coordinator is not None else "")
            self.exitcode, self.final = exit_codes.ISOLATED, NodeState.ISOLATED
        except SignalException as e:
            # torch's agent already stopped the workers with the same signal.
            log.warning("stopped by %s", signal.Signals(e.sigval).name)
            self.exitcode, self.final = 128 + int(e.sigval), NodeState.STOPPED
        except RendezvousError as e:
            why = str(e) or (
                "the job's rendezvous is closed: its other nodes finished or shut the job down "
                "while this launcher was away (frozen, cut off, or starting late); start a new "
                "run (a new --rdzv-id) to train again"
                if isinstance(e, _torch.rendezvous_closed_error()) else "(no detail given)")
            log.error("rendezvous failed: %s: %s", type(e).__name__, why)
        return self.exitcode

    # -- closing -----------------------------------------------------------------------------

    def _stop_store(self) -> None:
        self.store.stop()
        if self._store_file is not None:
            self._store_file.unlink(missing_ok=True)

    def _stop_reporter(self) -> None:
        reporter = self.reporter
        assert reporter is not None
        try:
            steps = last_steps(self.node_dir)
        except OSError:
            steps = []
        agent = self.ctx.agent if getattr(self, "ctx", None) is not None else None
        # The last step this node's ranks finished (the job's steps trained) and their step
        # time (what a recomputed step costs), for ftrun report.
        reporter.event("job_end", exitcode=self.exitcode, state=self.final,
                       last_step=max(steps) if steps else None,
                       step_s=agent.step_time_s() if agent is not None else None)
        reporter.stop(self.final, self.exitcode)

    def _stop_coordinator(self) -> None:
        with self._failover_lock:
            coordinator, self.coordinator = self.coordinator, None
        if coordinator is None:
            return  # (etcd) another launcher runs it, or this one's stepped down
        # Other nodes' stores ask the coordinator which step to write as they stop (SIGTERM
        # reaches every node at about the same time): serve them first.
        waiting = coordinator.wait_final_persists(FINAL_PERSIST_WAIT_S, FINAL_START_GRACE_S,
                                                  exclude=self.node_id)
        if waiting:
            log.warning("stopping the coordinator while node(s) %s still persist",
                        ", ".join(waiting))
        coordinator.stop()


def run(argv: list[str]) -> int:
    """Launch one node of a job. Returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on bad flags, exactly as torchrun
    opts = ftrun_options(args)
    explicit = explicit_dests(parser, argv)
    node0_hosts = apply_slurm(args, explicit, dict(os.environ))
    check_redundancy(opts, args)  # the node count is known now (Slurm sets it)
    check_script(args)
    plan = plan_rendezvous(args, explicit, external=opts.coordinator is not None,
                           node0_hosts=node0_hosts, bind_host=opts.bind_host)
    with NodeServices(args, opts, plan) as node:
        return node.launch()
