"""``--rdzv-backend etcd``: torch's elastic rendezvous on etcd's v3 API.

torch's own etcd backends (``etcd``, ``etcd-v2``) speak etcd's v2 API, which etcd 3.4 turns off
by default and 3.6 removed. ftrun keeps torch's rendezvous state machine
(``DynamicRendezvousHandler``, the one behind c10d: MIN:MAX, spares, last call, keep-alives,
closing) and gives it two v3 parts:

- :class:`EtcdRendezvousBackend`: the state is one key, ``/ftrun/<run id>/rdzv/state``; its
  fencing token is the key's ``mod_revision``, and ``set_state`` is one transaction
  (``mod_revision == token`` -> put, else read), or create-if-absent without a token;
- :class:`EtcdStore`: the ``torch.distributed.Store`` the agent uses during a rendezvous
  (master address, rank assignment, exit barrier) as keys under ``/ftrun/<run id>/store/``.
  Blocking reads poll with a short back-off, bounded by the store's timeout. The ranks'
  process groups do not use it: ftrun turns off torch's shared store, so rank 0's host
  starts a TCPStore for them, as with c10d.

:func:`register` adds the backend to torch's registry as ``etcd-v3``; the launcher maps
``--rdzv-backend etcd`` onto it. This module imports torch; :mod:`ftrun.launcher.etcd` does not.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ftrun import _torch
from ftrun.launcher.etcd import (
    REQUEST_TIMEOUT_S,
    EtcdClient,
    EtcdError,
    EtcdTLS,
    KeyValue,
    b64,
    ended_key,
    key_prefix,
    prefix_end,
)

log = logging.getLogger(__name__)

BACKEND_NAME = "etcd-v3"
DEFAULT_STORE_TIMEOUT_S = 300.0
DEFAULT_KEEP_ALIVE_INTERVAL_S = 5.0  # torch's default (RendezvousParameters keep_alive_interval)
_POLL_FIRST_S = 0.005
_POLL_MAX_S = 0.1
# While etcd is unreachable (its quorum lost), how often the agent's check for waiting nodes
# tries it again; in between the job trains on (ftrun._torch.keep_world_while_unreachable).
KEEP_WORLD_RETRY_S = 2.0


def _kvs(responses: list[dict[str, Any]]) -> list[KeyValue]:
    out: list[KeyValue] = []
    for response in responses:
        out += [KeyValue.from_json(kv) for kv in
                (response.get("response_range") or {}).get("kvs") or []]
    return out


def _connection_error(e: EtcdError, what: str) -> Exception:
    return _torch.rendezvous_connection_error()(f"etcd rendezvous: {what}: {e}")


class EtcdRendezvousBackend(_torch.rendezvous_backend_base()):  # type: ignore[misc]
    """The rendezvous state of job ``run_id`` in etcd (see the module)."""

    def __init__(self, client: EtcdClient, run_id: str,
                 keep_alive_interval_s: float = DEFAULT_KEEP_ALIVE_INTERVAL_S) -> None:
        if not run_id:
            raise ValueError("the rendezvous run id must not be empty")
        self.client = client
        self.key = key_prefix(run_id) + "rdzv/state"
        self.ended_key = ended_key(run_id)
        # When (monotonic) etcd last answered, and whether it has failed since: after an
        # outage the first state this backend reads or writes has its keep-alives moved past
        # it, in etcd (_past_outage).
        self._answered_at = time.monotonic()
        self._down = False
        self._keep_alive_interval_s = keep_alive_interval_s

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def _unreachable(self, e: EtcdError, what: str) -> Exception:
        self._down = True
        return _connection_error(e, what)

    def _past_outage(self, state: bytes) -> tuple[bytes, float]:
        """``state`` with every keep-alive moved later by the outage this backend saw
        (counted from etcd's last answer before it) and one keep-alive interval
        (:func:`ftrun._torch.discount_keep_alives`): nobody could renew one while etcd was
        down, and that is no reason to drop them. Unchanged when there was no outage.

        The moved state is what gets written to etcd: moved in a node's own copy only, the
        next plain read would find the keep-alives expired after all and drop the nodes. Each
        node moves them once per outage it sees; a node that had stopped before an outage
        expires later by that much at most."""
        if not self._down or not state:
            return state, 0.0
        outage_s = time.monotonic() - self._answered_at
        return _torch.discount_keep_alives(state, outage_s, self._keep_alive_interval_s), outage_s

    def _answered(self, outage_s: float) -> None:
        if outage_s:
            log.warning("etcd answers again after %.1f s: the rendezvous keep-alives are moved "
                        "past the outage", outage_s)
        self._answered_at, self._down = time.monotonic(), False

    def get_state(self) -> tuple[bytes, Any] | None:
        try:
            kv = self.client.get(self.key)
            ended = self.client.get(self.ended_key) if kv is None else None
        except EtcdError as e:
            raise self._unreachable(e, "reading the state failed") from e
        if ended is not None:
            # The job ended well and its keys went; this launcher did not take part in its
            # end (cut off, or frozen until after it). A new run clears the mark first.
            raise _torch.rendezvous_closed_error()(
                f"the job under this rendezvous id ended (at {ended.value.decode()} unix "
                "time) while this launcher was away; its keys are gone from etcd. Start a new "
                "run of all its launchers to train again")
        if kv is None:
            self._answered(0.0)
            return None
        if not self._down:
            self._answered(0.0)
            return kv.value, kv.mod_revision
        # The first read after an outage: write the state back with its keep-alives moved,
        # unless someone wrote since this read (then theirs stands).
        moved = self.set_state(kv.value, kv.mod_revision)
        return None if moved is None else moved[:2]

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        if token is None:
            compare = {"key": b64(self.key), "target": "CREATE", "result": "EQUAL",
                       "create_revision": "0"}
        else:
            try:
                revision = int(token)
            except (TypeError, ValueError):
                # Not a token of ours: torch's contract says the set fails.
                current = self.get_state()
                return None if current is None else (*current, False)
            compare = {"key": b64(self.key), "target": "MOD", "result": "EQUAL",
                       "mod_revision": str(revision)}
        state, outage_s = self._past_outage(state)
        try:
            ok, revision_after, responses = self.client.txn(
                [compare], [{"request_put": {"key": b64(self.key), "value": b64(state)}}],
                [{"request_range": {"key": b64(self.key)}}])
        except EtcdError as e:
            raise self._unreachable(e, "writing the state failed") from e
        self._answered(outage_s)
        if ok:
            # The transaction's revision is the one its put wrote: the key's mod_revision.
            return state, revision_after, True
        kvs = _kvs(responses)
        return (kvs[0].value, kvs[0].mod_revision, False) if kvs else None


class EtcdStore(dist.Store):
    """A ``torch.distributed.Store`` on etcd, under ``/ftrun/<run id>/store/``.

    ``get``, ``wait`` and ``multi_get`` wait for absent keys up to the store's timeout and
    then raise ``DistStoreError``, as TCPStore does; ``add`` and ``compare_set`` are
    transactions, so concurrent agents never lose an update.
    """

    def __init__(self, client: EtcdClient, run_id: str,
                 timeout: timedelta = timedelta(seconds=DEFAULT_STORE_TIMEOUT_S)) -> None:
        super().__init__()
        self.client = client
        self.prefix = key_prefix(run_id) + "store/"
        self.set_timeout(timeout)

    def _key(self, key: str) -> str:
        return self.prefix + key

    @staticmethod
    def _bytes(value: Any) -> bytes:
        if isinstance(value, (bytes, bytearray)):
            return bytes(value)
        if isinstance(value, str):
            return value.encode()
        return bytes(value)  # a list of ints, as torch passes some values

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except EtcdError as e:
            raise dist.DistStoreError(f"etcd store: {what} failed: {e}") from e

    def set(self, key: str, value: Any) -> None:
        self._call(f"set {key!r}", self.client.put, self._key(key), self._bytes(value))

    def get(self, key: str) -> bytes:
        return self._wait_get([key], None)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._wait_get(keys, None)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        puts = [{"request_put": {"key": b64(self._key(k)), "value": b64(self._bytes(v))}}
                for k, v in zip(keys, values, strict=True)]
        self._call("multi_set", self.client.txn, [], puts, [])

    def check(self, keys: list[str]) -> bool:
        return all(self._call(f"check {k!r}", self.client.get, self._key(k)) is not None
                   for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_get(keys, timeout)

    def add(self, key: str, amount: int) -> int:
        full = self._key(key)
        while True:
            kv = self._call(f"add {key!r}", self.client.get, full)
            if kv is None:
                compare = {"key": b64(full), "target": "CREATE", "result": "EQUAL",
                           "create_revision": "0"}
                value = amount
            else:
                compare = {"key": b64(full), "target": "MOD", "result": "EQUAL",
                           "mod_revision": str(kv.mod_revision)}
                value = int(kv.value or b"0") + amount
            ok, _, _ = self._call(f"add {key!r}", self.client.txn, [compare],
                                  [{"request_put": {"key": b64(full), "value": b64(str(value))}}],
                                  [])
            if ok:
                return value

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        full, expected_b, desired_b = self._key(key), self._bytes(expected), self._bytes(desired)
        if expected_b:
            compare = {"key": b64(full), "target": "VALUE", "result": "EQUAL",
                       "value": b64(expected_b)}
        else:  # TCPStore's rule: an empty expected value sets a key that does not exist
            compare = {"key": b64(full), "target": "CREATE", "result": "EQUAL",
                       "create_revision": "0"}
        ok, _, responses = self._call(
            f"compare_set {key!r}", self.client.txn, [compare],
            [{"request_put": {"key": b64(full), "value": b64(desired_b)}}],
            [{"request_range": {"key": b64(full)}}])
        if ok:
            return desired_b
        kvs = _kvs(responses)
        return kvs[0].value if kvs else expected_b

    def delete_key(self, key: str) -> bool:
        return bool(self._call(f"delete {key!r}", self.client.delete, self._key(key)))

    def num_keys(self) -> int:
        prefix = self.prefix.encode()
        doc = self._call("num_keys", self.client.call, "kv/range",
                         {"key": b64(prefix), "range_end": b64(prefix_end(prefix)),
                          "count_only": True})
        return int(doc.get("count", 0))

    def _wait_get(self, keys: list[str], timeout: timedelta | None) -> list[bytes]:
        """The values of ``keys``, once all exist; DistStoreError after the timeout."""
        limit_s = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + limit_s
        values: dict[str, bytes] = {}
        pause = _POLL_FIRST_S
        while True:
            for key in keys:
                if key not in values:
                    kv = self._call(f"get {key!r}", self.client.get, self._key(key))
                    if kv is not None:
                        values[key] = kv.value
            if len(values) == len(keys):
                return [values[k] for k in keys]
            if time.monotonic() >= deadline:
                missing = [k for k in keys if k not in values]
                raise dist.DistStoreError(
                    f"etcd store: key(s) {missing} not set within {limit_s:g} s (wait timeout)")
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, _POLL_MAX_S)


def create_backend(params: Any) -> tuple[EtcdRendezvousBackend, EtcdStore]:
    """torch's ``RendezvousParameters`` -> the backend and the store. ``--rdzv-conf``
    ``read_timeout`` (seconds, default 5) bounds each request to one etcd member;
    ``protocol=https``, ``cacert``, ``cert``, ``key``: TLS, as torch's etcd rendezvous."""
    timeout_s = float(params.get("read_timeout", REQUEST_TIMEOUT_S))
    client = EtcdClient(params.endpoint, timeout_s=timeout_s,
                        tls=EtcdTLS.from_conf(lambda key: params.get(key)))
    join_s = float(params.get("join_timeout", DEFAULT_STORE_TIMEOUT_S))
    interval_s = float(params.get("keep_alive_interval", DEFAULT_KEEP_ALIVE_INTERVAL_S))
    return (EtcdRendezvousBackend(client, params.run_id, interval_s),
            EtcdStore(client, params.run_id, timedelta(seconds=join_s)))


def register() -> None:
    """Make ``--rdzv-backend etcd-v3`` known to torch's launcher in this process: its
    handlers keep the current world training while etcd is unreachable."""
    _torch.register_rendezvous_backend(BACKEND_NAME, create_backend,
                                       keep_world_retry_s=KEEP_WORLD_RETRY_S)
