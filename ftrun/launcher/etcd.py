"""A small etcd v3 client, and the election of the launcher that runs a job's coordinator.

etcd 3.4 and later serve the v3 API over gRPC and over a JSON gateway (``POST /v3/kv/range``,
``/v3/kv/txn``, ``/v3/lease/grant`` ...; keys and values base64, 64-bit integers as strings).
ftrun speaks the JSON gateway with the standard library: the few calls a rendezvous and an
election need (range, put, txn, delete, lease grant / keep-alive / revoke) do not justify a
gRPC client, and the Python etcd v3 clients pin old grpc/protobuf releases or are unmaintained.

:class:`EtcdClient` holds the cluster's client endpoints (1, 3 or 5 members) and fails over
between them: a request goes to the member that answered last; a member that refuses, times
out or answers "unavailable" (no leader, stopping) is left for the next one; :class:`EtcdTLS`
reaches it over https, with client certificates where the members ask for them. Every
request has a timeout; when no member answers, :class:`EtcdUnavailable` says which were tried and what to
do. Nothing here imports torch: ``ftrun status`` uses it from a login shell.

:class:`CoordinatorElection`: the launchers of a job on etcd elect the one that runs the
coordinator. The key ``/ftrun/<run id>/coordinator`` is created if absent, under a lease that
its holder keeps alive; the others read the coordinator's endpoints from it. The key's
``create_revision`` is the holder's *term*: it grows with every new holder (etcd revisions
never go back), so what a coordinator signs can later be bound to its term, and a launcher
that takes the role after the holder's lease expired (failover) gets a larger one.

Failover: every launcher follows the key (:class:`CoordinatorWatch`, a poll every
:data:`WATCH_POLL_S`). When the holder's host dies its lease runs out (at most
:data:`COORDINATOR_TTL_S`), the key goes with it, and the first launcher to see it vacant
takes the role (a new term), starts a coordinator and publishes it; every launcher then moves
to it. The election is the coordinator's :class:`~ftrun.coordinator.api.CoordinatorRole`:
:meth:`CoordinatorElection.acting` says whether the lease is certainly still held (its last
renewal's send time plus the TTL has not passed: a holder frozen by SIGSTOP knows on resuming
that it may have lost it, before any thread could renew or notice), and the job state that
must outlive a holder's host is kept under ``/ftrun/<run id>/state/``, written only while the
role is the writer's (a transaction on the role key's create revision).
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftrun.errors import ConfigError, FtrunTimeoutError, JobNotFoundError, UnreachableError

log = logging.getLogger(__name__)

DEFAULT_PORT = 2379
REQUEST_TIMEOUT_S = 5.0
KEY_ROOT = "/ftrun"
# How a job file's rdzv_endpoint says that the job's rendezvous is on etcd.
URL_SCHEME = "etcd://"
# gRPC status codes etcd answers with when a member cannot serve right now: another member may.
_RETRY_CODES = {4, 14}  # DEADLINE_EXCEEDED, UNAVAILABLE
_LEASE_NOT_FOUND = 5  # NOT_FOUND, for an expired or revoked lease
# Every request requires a leader (gRPC metadata ``hasleader: true``, which the gateway takes
# from this header; etcd's own clients set it with WithRequireLeader): a member that lost the
# cluster's quorum answers "no leader" at once instead of holding the request until it times
# out, so the client moves on, and a lost quorum reads as such within milliseconds.
_HEADERS = {"Content-Type": "application/json", "Grpc-Metadata-Hasleader": "true"}
_NO_LEADER = "no leader"
# The coordinator's lease: how long the role outlives a holder that stopped renewing it.
COORDINATOR_TTL_S = 5
# How often each launcher reads the coordinator's key (a range request: etcd serves tens of
# thousands a second, so even a thousand launchers cost it little).
WATCH_POLL_S = 0.5
# A holder stops acting this long before its lease could run out at etcd (etcd counts the
# TTL from when it received the renewal, later than the holder sent it; the margin covers a
# renewal that etcd took but whose answer was lost).
ACTING_MARGIN_S = 0.5


class EtcdError(UnreachableError):
    """etcd refused a request, or no member of the cluster answered."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code  # etcd's gRPC status code, 0 when it did not answer


class EtcdUnavailable(EtcdError):
    """No member of the etcd cluster answered within the timeout."""


def key_prefix(run_id: str) -> str:
    """Where everything of job ``run_id`` lives in etcd (no two jobs share a key)."""
    return f"{KEY_ROOT}/{run_id}/"


def endpoints_scheme(text: str) -> str:
    """``http`` or ``https``: the scheme the endpoints ``text`` name (none: http). All
    members are reached the same way."""
    schemes = {item.strip().partition("://")[0] if "://" in item else "http"
               for item in text.split(",") if item.strip()}
    bad = schemes - {"http", "https"}
    if bad:
        raise ConfigError(f"etcd endpoints {text!r}: scheme {sorted(bad)[0]}:// is not "
                          "etcd's; give HOST:PORT, http://HOST:PORT or https://HOST:PORT")
    if len(schemes) > 1:
        raise ConfigError(f"etcd endpoints {text!r} mix http:// and https://: every member "
                          "of one cluster serves its clients the same way")
    return schemes.pop() if schemes else "http"


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    """``host1:2379,host2:2379,...`` (``http://`` or ``https://`` allowed, port 2379 by
    default) -> list (the scheme: :func:`endpoints_scheme`)."""
    endpoints_scheme(text)
    out: list[tuple[str, int]] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        _, sep, rest = item.partition("://")
        hostport = rest if sep else item
        host, colon, port = hostport.rpartition(":")
        if not colon or "]" in port:
            host, port = hostport, str(DEFAULT_PORT)
        host = host.strip("[]")
        try:
            number = int(port)
        except ValueError:
            number = -1
        if not host or not 0 < number < 65536:
            raise ConfigError(f"etcd endpoint {item!r} is not HOST:PORT (e.g. node1:2379)")
        out.append((host, number))
    if not out:
        raise ConfigError(
            "no etcd endpoint given: pass --rdzv-endpoint HOST:PORT[,HOST:PORT...] with the "
            "client URLs of the etcd members (1, 3 or 5)"
        )
    if len(set(out)) != len(out):
        raise ConfigError(f"etcd endpoints {text!r} name a member twice")
    return out


def format_endpoints(endpoints: Sequence[tuple[str, int]], scheme: str = "http") -> str:
    """The endpoints as ``--rdzv-endpoint`` takes them (``https://`` before each under TLS)."""
    prefix = "https://" if scheme == "https" else ""
    return ",".join(prefix + (f"[{h}]:{p}" if ":" in h else f"{h}:{p}") for h, p in endpoints)


# The variables etcdctl reads its TLS files from; ftrun reads them where no --rdzv-conf
# gives them (``ftrun status --etcd https://...`` from a login shell).
TLS_ENV = {"cacert": "ETCDCTL_CACERT", "cert": "ETCDCTL_CERT", "key": "ETCDCTL_KEY"}


@dataclass(frozen=True)
class EtcdTLS:
    """How to reach etcd over TLS: the CA that signed the members' certificates (None: the
    system's), and this client's certificate and key where the members ask for one
    (``--client-cert-auth``). torch's etcd rendezvous takes the same ``--rdzv-conf`` keys:
    ``protocol=https``, ``cacert``, ``cert``, ``key``."""

    cacert: str | None = None
    cert: str | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError("etcd TLS: give both cert and key (the client's certificate and "
                              "its private key), or neither")
        for name in ("cacert", "cert", "key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"etcd TLS: {name} file {path!r} does not exist")

    @classmethod
    def from_conf(cls, conf: Callable[[str], str | None]) -> EtcdTLS | None:
        """From ``--rdzv-conf`` (``conf(key)``: its value or None): None when it asks for
        plain http (``protocol`` unset or ``http``, no file given)."""
        protocol = (conf("protocol") or "").strip().lower()
        if protocol not in ("", "http", "https"):
            raise ConfigError(f"--rdzv-conf protocol={protocol!r}: give http or https")
        files = {k: conf(k) or None for k in TLS_ENV}
        if protocol == "http" and any(files.values()):
            raise ConfigError("--rdzv-conf protocol=http with TLS files: drop them, or use "
                              "protocol=https")
        if protocol != "https" and not any(files.values()):
            return None
        return cls(**files)

    @classmethod
    def from_env(cls) -> EtcdTLS:
        import os

        return cls(**{k: os.environ.get(v) or None for k, v in TLS_ENV.items()})

    def context(self) -> ssl.SSLContext:
        try:
            context = ssl.create_default_context(cafile=self.cacert)
            if self.cert is not None:
                context.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"etcd TLS: cannot load the CA, certificate or key "
                              f"({self}): {e}") from e
        return context


def b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text or "")


def prefix_end(prefix: bytes) -> bytes:
    """The end of the key range holding every key that starts with ``prefix``."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"
    end[-1] += 1
    return bytes(end)


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int

    @classmethod
    def from_json(cls, kv: dict[str, Any]) -> KeyValue:
        return cls(unb64(kv.get("key")), unb64(kv.get("value")),
                   int(kv.get("create_revision", 0)), int(kv.get("mod_revision", 0)),
                   int(kv.get("lease", 0)))


class EtcdClient:
    """The v3 JSON gateway of an etcd cluster; thread-safe (one connection per request).

    ``timeout_s`` bounds each attempt on one member (connect and answer); a request tries every
    member once, starting with the one that answered last, so it ends within
    ``timeout_s x members``.
    """

    def __init__(self, endpoints: str | Sequence[tuple[str, int]],
                 timeout_s: float = REQUEST_TIMEOUT_S, tls: EtcdTLS | None = None) -> None:
        if isinstance(endpoints, str):
            self.endpoints = parse_endpoints(endpoints)
            scheme = endpoints_scheme(endpoints)
        else:
            self.endpoints, scheme = list(endpoints), "http"
        if timeout_s <= 0:
            raise ConfigError(f"etcd request timeout {timeout_s!r} s: must be positive")
        self.timeout_s = timeout_s
        # TLS when asked for, or when the endpoints say https:// (then with etcdctl's files).
        self.tls = tls if tls is not None else EtcdTLS.from_env() if scheme == "https" \
            else None
        self._ssl = self.tls.context() if self.tls is not None else None
        self._current = 0
        self._lock = threading.Lock()

    @property
    def scheme(self) -> str:
        return "http" if self.tls is None else "https"

    @property
    def endpoints_text(self) -> str:
        """The endpoints as ``--rdzv-endpoint`` takes them, the scheme included."""
        return format_endpoints(self.endpoints, self.scheme)

    def __repr__(self) -> str:
        return f"EtcdClient({self.endpoints_text!r})"

    # -- transport ---------------------------------------------------------------------------

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>`` on the first member that can serve it."""
        with self._lock:
            start = self._current
        failures: list[str] = []
        n = len(self.endpoints)
        for i in range(n):
            index = (start + i) % n
            host, port = self.endpoints[index]
            try:
                status, doc = self._post(host, port, path, body)
            except (OSError, http.client.HTTPException, ValueError) as e:
                failures.append(f"{host}:{port}: {type(e).__name__}: {e}")
                continue
            code = int(doc.get("code", 0)) if status != 200 else 0
            if status != 200 and (code in _RETRY_CODES or status >= 500 and not code):
                failures.append(f"{host}:{port}: {doc.get('message') or doc.get('error')}")
                continue
            with self._lock:
                self._current = index
            if status != 200:
                raise EtcdError(f"etcd {host}:{port} refused /v3/{path}: "
                                f"{doc.get('message') or doc.get('error') or status} "
                                f"(code {code})", code)
            return doc
        if any("SSL" in f or "CERTIFICATE" in f for f in failures):
            advice = ("A TLS handshake failed: check that the members serve https (and "
                      "--rdzv-endpoint says https:// or --rdzv-conf protocol=https), and "
                      "the CA, certificate and key (--rdzv-conf cacert=,cert=,key=; for "
                      "`ftrun status`, ETCDCTL_CACERT, ETCDCTL_CERT, ETCDCTL_KEY).")
        elif any(_NO_LEADER in f for f in failures):
            advice = ("etcd has no leader: its quorum is lost (a majority of its members is "
                      "down or cut off from the others). A running job trains on, but cannot "
                      "commit snapshots or recover from a fault until a majority is back.")
        else:
            advice = ("Check that --rdzv-endpoint lists the etcd members' client URLs "
                      "(HOST:2379,...) and that a majority of them is up.")
        raise EtcdUnavailable(
            f"no etcd member answered /v3/{path} within {self.timeout_s:g} s ("
            + "; ".join(failures) + "). " + advice
        )

    def _post(self, host: str, port: int, path: str,
              body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        conn = http.client.HTTPConnection(host, port, timeout=self.timeout_s) \
            if self._ssl is None else \
            http.client.HTTPSConnection(host, port, timeout=self.timeout_s, context=self._ssl)
        try:
            conn.request("POST", f"/v3/{path}", json.dumps(body).encode(), _HEADERS)
            response = conn.getresponse()
            raw = response.read()
        finally:
            conn.close()
        doc = json.loads(raw) if raw else {}
        if not isinstance(doc, dict):
            raise ValueError(f"answer is not a JSON object: {raw[:80]!r}")
        return response.status, doc

    # -- key-value ---------------------------------------------------------------------------

    def get(self, key: bytes | str) -> KeyValue | None:
        kvs = self.call("kv/range", {"key": b64(key)}).get("kvs") or []
        return KeyValue.from_json(kvs[0]) if kvs else None

    def get_prefix(self, prefix: bytes | str) -> list[KeyValue]:
        raw = prefix.encode() if isinstance(prefix, str) else prefix
        doc = self.call("kv/range", {"key": b64(raw), "range_end": b64(prefix_end(raw))})
        return [KeyValue.from_json(kv) for kv in doc.get("kvs") or []]

    def put(self, key: bytes | str, value: bytes | str, lease: int = 0) -> int:
        """Set ``key``; returns the revision of the write."""
        body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self.call("kv/put", body)["header"]["revision"])

    def delete(self, key: bytes | str) -> int:
        """Delete ``key``; returns how many keys went (0 or 1)."""
        return int(self.call("kv/deleterange", {"key": b64(key)}).get("deleted", 0))

    def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
            failure: list[dict[str, Any]]) -> tuple[bool, int, list[dict[str, Any]]]:
        """One transaction: (whether ``compare`` held, the revision after it, the responses
        of the branch that ran)."""
        doc = self.call("kv/txn", {"compare": compare, "success": success, "failure": failure})
        return bool(doc.get("succeeded")), int(doc["header"]["revision"]), \
            list(doc.get("responses") or [])

    def create(self, key: bytes | str, value: bytes | str,
               lease: int = 0) -> tuple[bool, KeyValue | None]:
        """Create ``key`` if absent: (True, None) when created, else (False, what is there)."""
        put: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            put["lease"] = str(lease)
        ok, _, responses = self.txn(
            [{"key": b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            [{"request_put": put}], [{"request_range": {"key": b64(key)}}])
        if ok:
            return True, None
        kvs = responses[0].get("response_range", {}).get("kvs") or [] if responses else []
        return False, KeyValue.from_json(kvs[0]) if kvs else None

    # -- leases ------------------------------------------------------------------------------

    def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; returns its id."""
        return int(self.call("lease/grant", {"TTL": str(int(ttl_s))})["ID"])

    def keep_alive(self, lease: int) -> int:
        """Renew ``lease``; returns its remaining TTL in seconds (0: it expired)."""
        doc = self.call("lease/keepalive", {"ID": str(lease)})
        return int((doc.get("result") or doc).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        """End ``lease`` and delete its keys (an expired lease is fine)."""
        try:
            self.call("lease/revoke", {"ID": str(lease)})
        except EtcdError as e:
            if e.code != _LEASE_NOT_FOUND:
                raise


# -- the coordinator's election -------------------------------------------------------------


def coordinator_key(run_id: str) -> str:
    return key_prefix(run_id) + "coordinator"


def state_key(run_id: str, name: str) -> str:
    """Where the coordinator role keeps the job state ``name`` that outlives its host."""
    return key_prefix(run_id) + "state/" + name


@dataclass(frozen=True)
class CoordinatorRecord:
    """What the holder of the coordinator role publishes (endpoints empty while it starts)."""

    node_id: str
    host: str
    endpoint: str = ""
    detect_endpoint: str = ""
    term: int = 0  # the key's create_revision, filled in on reading

    def to_json(self) -> str:
        return json.dumps({"node_id": self.node_id, "host": self.host,
                           "endpoint": self.endpoint, "detect": self.detect_endpoint})

    @classmethod
    def from_kv(cls, kv: KeyValue) -> CoordinatorRecord:
        try:
            doc = json.loads(kv.value)
            return cls(str(doc["node_id"]), str(doc["host"]), str(doc.get("endpoint", "")),
                       str(doc.get("detect", "")), kv.create_revision)
        except (ValueError, KeyError, TypeError) as e:
            raise EtcdError(f"etcd key {kv.key.decode(errors='replace')!r} does not hold an "
                            f"ftrun coordinator record ({e}); another program uses it") from e


def read_coordinator(client: EtcdClient, run_id: str) -> CoordinatorRecord | None:
    """The current holder of job ``run_id``'s coordinator role, None when none holds it."""
    kv = client.get(coordinator_key(run_id))
    return None if kv is None else CoordinatorRecord.from_kv(kv)


def coordinator_endpoint(endpoints: str, run_id: str, timeout_s: float) -> str:
    """The endpoint of job ``run_id``'s coordinator, as published in the etcd cluster at
    ``endpoints`` (what ``ftrun status`` asks from a login shell)."""
    client = EtcdClient(endpoints, timeout_s=timeout_s)
    record = read_coordinator(client, run_id)
    if record is None or not record.endpoint:
        raise JobNotFoundError(
            f"no coordinator of job {run_id!r} in etcd at {client.endpoints_text} "
            f"(key {coordinator_key(run_id)!r}"
            + (f" held by {record.node_id}, still starting" if record else "")
            + "): is the job running, under that --rdzv-id?")
    return record.endpoint


def wait_coordinator(client: EtcdClient, run_id: str, timeout_s: float,
                     poll_s: float = 0.1,
                     on_vacant: Callable[[], None] | None = None) -> CoordinatorRecord:
    """The coordinator's record once its holder has published its endpoints.
    ``on_vacant`` is called whenever nobody holds the role (a launcher then campaigns: the
    holder it saw may have died before publishing)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            record = read_coordinator(client, run_id)
        except EtcdUnavailable:
            if time.monotonic() >= deadline:
                raise
            record = None
        else:
            if record is None and on_vacant is not None:
                on_vacant()
                continue
        if record is not None and record.endpoint:
            return record
        if time.monotonic() >= deadline:
            raise FtrunTimeoutError(
                f"no coordinator of job {run_id!r} published its endpoint in etcd under "
                f"{coordinator_key(run_id)!r} within {timeout_s:g} s"
                + (f" (held by {record.node_id}, still starting)" if record else "")
                + "; are this job's other launchers running with the same --rdzv-id?")
        time.sleep(poll_s)


class CoordinatorElection:
    """This launcher's candidacy for the coordinator role of job ``run_id``.

    :meth:`campaign` creates the role's key if absent, under a lease of ``ttl_s`` seconds that
    a thread then renews every ``ttl_s / 3`` s. The winner starts its coordinator and
    :meth:`publish`es its endpoints; :meth:`resign` revokes the lease (the key goes with it).
    When the lease cannot be renewed (etcd unreachable for longer than the TTL, or this
    process was frozen), :attr:`lost` is set and ``on_lost(reason)`` is called once from the
    renewing thread: the role may already be another launcher's.
    """

    def __init__(self, client: EtcdClient, run_id: str, node_id: str, host: str,
                 ttl_s: int = COORDINATOR_TTL_S,
                 on_lost: Callable[[str], None] | None = None) -> None:
        if ttl_s < 2:
            raise ConfigError(f"coordinator lease TTL {ttl_s} s: must be at least 2 s")
        self.client = client
        self.run_id = run_id
        self.key = coordinator_key(run_id)
        self.record = CoordinatorRecord(node_id, host)
        self.ttl_s = ttl_s
        self.on_lost = on_lost
        self.lease = 0
        self.term = 0
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # The lease is certainly held until then (monotonic): see acting().
        self._alive_until = 0.0

    @property
    def leading(self) -> bool:
        return self.term > 0 and not self.lost.is_set()

    def acting(self) -> bool:
        """Whether this launcher certainly still holds the role: it won it, has not lost it,
        and its lease cannot have run out yet (checked against the clock, so a process
        resumed after SIGSTOP knows before any renewal or notice)."""
        return self.leading and time.monotonic() < self._alive_until - ACTING_MARGIN_S

    def load(self, name: str) -> Any:
        """The job state ``name`` kept with the role (None when never saved)."""
        kv = self.client.get(state_key(self.run_id, name))
        if kv is None:
            return None
        try:
            return json.loads(kv.value)
        except ValueError as e:
            raise EtcdError(f"etcd key {state_key(self.run_id, name)!r} does not hold JSON "
                            f"({e}); another program uses it") from e

    def save(self, name: str, value: Any) -> bool:
        """Keep the job state ``name``; only while the role is this launcher's (returns
        False, writing nothing, once it is not)."""
        if not self.acting():
            return False
        put = {"key": b64(state_key(self.run_id, name)), "value": b64(json.dumps(value))}
        ok, _, _ = self.client.txn(
            [{"key": b64(self.key), "target": "CREATE", "result": "EQUAL",
              "create_revision": str(self.term)}],
            [{"request_put": put}], [])
        return ok

    def campaign(self) -> CoordinatorRecord | None:
        """Try to take the role: None when this launcher holds it now (its lease then renewed
        in the background), else the current holder's record. A launcher that lost the
        role may campaign again (a new lease, a new term)."""
        if self.leading:
            return None
        if self.lost.is_set() or self._thread is not None:
            self._stop.set()
            self._thread = None
            self.lost, self._stop = threading.Event(), threading.Event()
            self.lease = self.term = 0
            # Unpublished again: the endpoints of the coordinator it ran are stale.
            self.record = CoordinatorRecord(self.record.node_id, self.record.host)
        sent = time.monotonic()
        lease = self.client.grant(self.ttl_s)
        try:
            won, holder = self.client.create(self.key, self.record.to_json(), lease)
        except BaseException:
            self._revoke_quietly(lease)
            raise
        if not won:
            self._revoke_quietly(lease)
            if holder is None:  # the holder's lease expired between the two reads: try again
                return self.campaign()
            return CoordinatorRecord.from_kv(holder)
        kv = self.client.get(self.key)
        if kv is None or kv.lease != lease:
            # Our lease expired already (this process stalled for the whole TTL).
            self._revoke_quietly(lease)
            return self.campaign()
        self.lease, self.term = lease, kv.create_revision
        self._alive_until = sent + self.ttl_s
        self._thread = threading.Thread(target=self._renew, args=(self._stop,),
                                        name="ftrun-coordinator-lease", daemon=True)
        self._thread.start()
        log.info("this launcher holds the coordinator role of job %s (term %d)",
                 self.run_id, self.term)
        return None

    def publish(self, endpoint: str, detect_endpoint: str) -> None:
        """Write the coordinator's endpoints into the role's key, if the role is still ours."""
        self.record = CoordinatorRecord(self.record.node_id, self.record.host, endpoint,
                                        detect_endpoint)
        put = {"key": b64(self.key), "value": b64(self.record.to_json()), "lease": str(self.lease)}
        ok, _, _ = self.client.txn(
            [{"key": b64(self.key), "target": "CREATE", "result": "EQUAL",
              "create_revision": str(self.term)}],
            [{"request_put": put}], [])
        if not ok:
            self._lose("the coordinator key changed hands before the endpoints were published")
            raise EtcdError(f"lost the coordinator role of job {self.run_id!r} (term "
                            f"{self.term}) before publishing its endpoint: this launcher's "
                            f"etcd lease expired (stalled for over {self.ttl_s} s?)")

    def resign(self) -> None:
        """Stop renewing and give the role up (the key goes with the lease). Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.client.timeout_s * len(self.client.endpoints) + 1)
        if self.lease and not self.lost.is_set():
            try:
                self.client.revoke(self.lease)
            except EtcdError as e:
                log.warning("could not give the coordinator role up in etcd (%s); it expires "
                            "with its lease within %d s", e, self.ttl_s)
        self.lease = 0

    def _renew(self, stop: threading.Event) -> None:
        interval = self.ttl_s / 3
        while not stop.wait(interval):
            sent = time.monotonic()
            # The lease is only known to be alive up to the last renewal's send time plus
            # the TTL.
            if sent >= self._alive_until:
                self._lose(f"its lease was not renewed for {self.ttl_s} s")
                return
            try:
                ttl = self.client.keep_alive(self.lease)
            except EtcdError as e:
                log.warning("cannot renew the coordinator lease in etcd (%s); retrying", e)
                continue
            except Exception:  # noqa: BLE001 - logged; the loop goes on
                log.exception("renewing the coordinator lease failed; retrying")
                continue
            if ttl <= 0:
                self._lose("etcd says its lease expired")
                return
            if not stop.is_set():
                self._alive_until = sent + ttl

    def _lose(self, reason: str) -> None:
        if self.lost.is_set():
            return
        self.lost.set()
        log.error("this launcher lost the coordinator role of job %s (term %d): %s",
                  self.run_id, self.term, reason)
        if self.on_lost is not None:
            self.on_lost(reason)

    def _revoke_quietly(self, lease: int) -> None:
        try:
            self.client.revoke(lease)
        except EtcdError as e:
            log.debug("revoking an unused lease failed (%s); it expires by itself", e)


class CoordinatorWatch:
    """Follows job ``run_id``'s coordinator role from a thread of its own.

    Every ``poll_s`` it reads the role's key: ``on_change(record)`` is called once per new
    published holder (a new term), ``on_vacant()`` while nobody holds the role (the holder's
    lease ran out: the caller campaigns). Both run on the watch's thread; one that raises is
    logged and the watch goes on. etcd unreachable is logged (at most every
    :data:`WARN_EVERY_S`) and retried: the job goes on with the coordinator it has.
    """

    WARN_EVERY_S = 10.0

    def __init__(self, client: EtcdClient, run_id: str, term: int,
                 on_change: Callable[[CoordinatorRecord], None],
                 on_vacant: Callable[[], None], poll_s: float = WATCH_POLL_S) -> None:
        self.client = client
        self.run_id = run_id
        self.term = term  # the term last handed to on_change (or known at start)
        self._endpoint = ""
        self._on_change = on_change
        self._on_vacant = on_vacant
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_warn = float("-inf")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ftrun-coordinator-watch",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.client.timeout_s * len(self.client.endpoints) + 1)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except EtcdError as e:
                now = time.monotonic()
                if now - self._last_warn >= self.WARN_EVERY_S:
                    self._last_warn = now
                    log.warning("cannot follow the coordinator role in etcd (%s); the job goes "
                                "on with the coordinator of term %d", e, self.term)
            except Exception:  # noqa: BLE001 - logged; the watch goes on
                log.exception("following the coordinator role failed; retrying")

    def check(self) -> None:
        """One look at the role's key (what the thread does every ``poll_s``)."""
        record = read_coordinator(self.client, self.run_id)
        if record is None:
            self._on_vacant()
        elif record.endpoint and (record.term, record.endpoint) != (self.term, self._endpoint):
            self.term, self._endpoint = record.term, record.endpoint
            self._on_change(record)


# -- a job's launchers and its keys ----------------------------------------------------------

# How long a launcher's presence outlives it when it dies without leaving (host lost).
PRESENCE_TTL_S = 10
# What a new run of a job clears of a previous one: the rendezvous (torch's state, and the
# agents' store), and the mark of a job that ended. The coordinator's kept state (state/:
# the event log's position, the excluded hosts) carries over to it.
RUN_SCOPED = ("rdzv/", "store/", "ended")
# How long the mark of a job that ended well outlives its keys: a launcher of that job that
# was cut off or frozen until after the end (its presence expired meanwhile) finds it and
# stops, instead of starting the job's rendezvous anew (and waiting for peers that are gone).
ENDED_TTL_S = 600


def ended_key(run_id: str) -> str:
    return key_prefix(run_id) + "ended"


def presence_prefix(run_id: str) -> str:
    return key_prefix(run_id) + "launchers/"


def _range(prefix: str) -> dict[str, str]:
    raw = prefix.encode()
    return {"key": b64(raw), "range_end": b64(prefix_end(raw))}


def _delete_all_but(prefix: str, key: str) -> list[dict[str, Any]]:
    """Requests deleting every key under ``prefix`` but ``key`` (etcd refuses a transaction
    that deletes a key it also writes)."""
    raw = key.encode()
    return [{"request_delete_range": {"key": b64(prefix), "range_end": b64(raw)}},
            {"request_delete_range": {"key": b64(raw + b"\0"),
                                      "range_end": b64(prefix_end(prefix.encode()))}}]


class LauncherPresence:
    """This launcher's key ``/ftrun/<run id>/launchers/<node id>``, under a lease of its own
    that a thread renews (a launcher that dies without leaving is gone within ``ttl_s``).

    It decides who clears a job's keys, and when:

    - :meth:`join`: the first launcher of a run (no launcher present, no coordinator holding
      the role) clears what a previous run under the same id left of the rendezvous
      (:data:`RUN_SCOPED`): a closed rendezvous, or one with the participants of a run
      killed by its scheduler (a Slurm requeue). One transaction, so of launchers that start
      together exactly one clears, and none once any is present;
    - :meth:`leave`: the launcher revokes its key; after a job that ended well (``done``), the
      last launcher to leave deletes everything under ``/ftrun/<run id>/`` but for the key
      ``ended``, under a lease of :data:`ENDED_TTL_S` (a straggler's rendezvous reads it as
      closed). A job that did not end well (a signal, a failure: a requeue may follow) keeps
      its keys for the next run, which clears the rendezvous part at its :meth:`join`.
    """

    def __init__(self, client: EtcdClient, run_id: str, node_id: str,
                 ttl_s: int = PRESENCE_TTL_S) -> None:
        self.client = client
        self.run_id = run_id
        self.key = presence_prefix(run_id) + node_id
        self.ttl_s = ttl_s
        self.lease = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def join(self) -> bool:
        """Be present; returns whether this launcher cleared a previous run's rendezvous."""
        self.lease = self.client.grant(self.ttl_s)
        nobody = [{**_range(presence_prefix(self.run_id)), "target": "CREATE",
                   "result": "EQUAL", "create_revision": "0"},
                  {"key": b64(coordinator_key(self.run_id)), "target": "CREATE",
                   "result": "EQUAL", "create_revision": "0"}]
        put = {"request_put": {"key": b64(self.key), "value": b64(str(time.time())),
                               "lease": str(self.lease)}}
        clear = [{"request_delete_range": _range(key_prefix(self.run_id) + part)}
                 for part in RUN_SCOPED]
        first, _, responses = self.client.txn(nobody, [*clear, put], [put])
        cleared = first and any(int(r.get("response_delete_range", {}).get("deleted", 0))
                                for r in responses)
        if cleared:
            log.warning("job %s: no launcher of it is running, and the rendezvous of a previous "
                        "run under this id was left in etcd: cleared (the coordinator's kept "
                        "state carries over)", self.run_id)
        self._thread = threading.Thread(target=self._renew, name="ftrun-etcd-presence",
                                        daemon=True)
        self._thread.start()
        return cleared

    def leave(self, done: bool) -> bool:
        """Stop being present; after a job that ended well, the last launcher to leave
        deletes the job's keys. Returns whether this one did."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.client.timeout_s * len(self.client.endpoints) + 1)
        try:
            if self.lease:
                self.client.revoke(self.lease)
                self.lease = 0
            if not done:
                return False
            # Nobody present and nobody holding the role (the holder gives it up before it
            # leaves): the job is over for every launcher.
            lease = self.client.grant(ENDED_TTL_S)
            ok, _, _ = self.client.txn(
                [{**_range(presence_prefix(self.run_id)), "target": "CREATE",
                  "result": "EQUAL", "create_revision": "0"},
                 {"key": b64(coordinator_key(self.run_id)), "target": "CREATE",
                  "result": "EQUAL", "create_revision": "0"}],
                [*_delete_all_but(key_prefix(self.run_id), ended_key(self.run_id)),
                 {"request_put": {"key": b64(ended_key(self.run_id)),
                                  "value": b64(str(time.time())), "lease": str(lease)}}], [])
            if not ok:
                self.client.revoke(lease)
        except EtcdError as e:
            log.warning("job %s: could not leave etcd cleanly (%s); its keys under %s stay "
                        "(a new run under this id clears its rendezvous)", self.run_id, e,
                        key_prefix(self.run_id))
            return False
        if ok:
            log.info("job %s ended: its keys are deleted from etcd (a mark that it ended stays "
                     "%d s)", self.run_id, ENDED_TTL_S)
        return ok

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if self.client.keep_alive(self.lease) > 0:
                    continue
                # Expired (etcd unreachable, or this process stalled, for the whole TTL).
                lease = self.client.grant(self.ttl_s)
                self.client.put(self.key, str(time.time()), lease)
                self.lease = lease
            except EtcdError as e:
                log.debug("renewing this launcher's presence in etcd failed (%s); retrying", e)
            except Exception:  # noqa: BLE001 - logged; the loop goes on
                log.exception("renewing this launcher's presence in etcd failed; retrying")


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    return True


def check_endpoints(client: EtcdClient) -> None:
    """Fail early, with what to do, when the endpoints do not name a reachable etcd."""
    bad = [h for h, _ in client.endpoints if not _resolves(h)]
    if bad:
        raise ConfigError(f"etcd endpoint host(s) {', '.join(bad)} do not resolve; check "
                          "--rdzv-endpoint")
    client.call("kv/range", {"key": b64(KEY_ROOT)})  # raises EtcdUnavailable with the details
