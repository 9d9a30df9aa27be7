"""The job's holdings, surveyed once per node and restore rather than once per rank.

A restoring rank needs to know every verified shard the job's live stores hold (its own
node's, the other nodes', replicas included: ftrun.rank.restore). Asked by every rank of
every node, that is nodes x ranks ``holdings_request`` messages and as many ``stores_request``
to the coordinator. Here the node's store asks once per restore: the first of its ranks to
ask (``survey_request`` with the restore's ``key``, the same on every rank of one restore)
starts a survey of the other stores off the store's message loop; every rank polls until it
is done and reads the same answer, page by page. The store's own shard service is asked
afresh for each rank (a cheap local request), so a rank sees its node's shards as they are
after its own flush, whatever its node's other ranks had flushed when the survey started.

A store that does not answer within :data:`SURVEY_TIMEOUT_S` is a lost node: it is left out
and named (``lost``), and its shards are read from their replicas, where there are any.
Surveys are kept for the last :data:`KEEP` keys, at most :data:`FRESH_S` each.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ftrun import protocol
from ftrun.errors import FtrunError
from ftrun.protocol import messages as m
from ftrun.protocol.transport import Client

log = logging.getLogger("ftrun.shards")

SURVEY_TIMEOUT_S = 3.0  # a store that has not answered by then is taken as lost
KEEP = 4
FRESH_S = 30.0
PAGE = 1000  # holdings per survey_reply (its header stays far below the 1 MiB cap)


def _client(addr: str, secret: bytes, run_id: str, sender: str) -> Client:
    return Client(addr, secret, run_id, sender, peer="snapshot store",
                  hint="is that node still up? (its shards are read from another copy)",
                  max_frame_bytes=protocol.MAX_FRAME_BYTES)


def ask_holdings(stores: dict[str, str], secret: bytes, run_id: str, sender: str,
                 timeout_s: float = SURVEY_TIMEOUT_S,
                 refused: list[dict[str, Any]] | None = None,
                 ) -> tuple[list[dict[str, Any]], list[str]]:
    """Ask every store (node -> shard service address) what it holds, in parallel:
    (its records, each with the ``node`` and ``addr`` holding it; the nodes that did not
    answer). ``refused``, when given, receives the rebuilds the stores refused (each with
    the ``node`` that refused)."""

    def ask(node: str, addr: str) -> list[dict[str, Any]] | None:
        client = _client(addr, secret, run_id, sender)
        try:
            reply = client.request("holdings_request", {}, "holdings_reply", timeout_s)
        except FtrunError as e:
            log.warning("the store of node %s (%s) did not list its shards: %s", node, addr, e)
            return None
        finally:
            client.close()
        if refused is not None:
            refused.extend({**r, "node": node} for r in reply.body.get("refused") or ())
        return [{**r, "node": node, "addr": addr} for r in reply.body["records"]]

    if not stores:
        return [], []
    with ThreadPoolExecutor(max_workers=min(32, len(stores))) as pool:
        answers = dict(zip(stores, pool.map(lambda kv: ask(*kv), stores.items()), strict=True))
    held = [r for found in answers.values() if found for r in found]
    return held, sorted(n for n, found in answers.items() if found is None)


class Surveyor:
    """Answers ``survey_request`` in a node's store (its message loop calls :meth:`answer`).

    ``stores()`` lists the job's live stores (node -> shard service), this one's included
    when it has a shard service.
    """

    def __init__(self, secret: bytes, run_id: str, node_id: str,
                 stores: Callable[[], dict[str, str]]) -> None:
        self._secret, self._run_id, self._node_id = secret, run_id, node_id
        self._stores = stores
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftrun-survey")
        # key -> (when started, own shard service address, the survey of the other stores)
        self._surveys: dict[str, tuple[float, str, Future[Any]]] = {}
        self._pages: dict[str, tuple[list[dict[str, Any]], list[str]]] = {}
        self._own: Client | None = None
        self._own_addr = ""
        self.surveys = 0  # started
        # Erasure coding: rebuild(live stores, their holdings) runs after each survey of the
        # other stores, before the survey is ready (ftrun.store.ec_store)
        self.rebuild: Callable[[dict[str, str], list[dict[str, Any]]],
                               list[dict[str, Any]]] | None = None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._own is not None:
            self._own.close()

    def answer(self, key: str, offset: int) -> m.SurveyReply:
        now = time.monotonic()
        entry = self._surveys.get(key)
        if entry is None or (now - entry[0] > FRESH_S and entry[2].done()):
            entry = self._start(key, now)
        _, own_addr, future = entry
        if not future.done():
            return m.SurveyReply(ready=False)
        if offset == 0 or key not in self._pages:
            others, lost = future.result()
            mine, own_lost = self._own_holdings(own_addr)
            self._pages[key] = (mine + others, sorted(lost + own_lost))
        records, lost = self._pages[key]
        page = records[offset:offset + PAGE]
        nxt = offset + PAGE if offset + PAGE < len(records) else None
        return m.SurveyReply(ready=True, records=page, lost=lost,
                             **({"next": nxt} if nxt is not None else {}))

    def _start(self, key: str, now: float) -> tuple[float, str, Future[Any]]:
        stores = self._stores()
        own_addr = stores.pop(self._node_id, "")
        self.surveys += 1
        log.info("surveying the %d other stores of the job for restore %s", len(stores), key)
        future = self._pool.submit(self._survey, stores, own_addr)
        entry = (now, own_addr, future)
        self._surveys[key] = entry
        self._pages.pop(key, None)
        while len(self._surveys) > KEEP:
            old = next(iter(self._surveys))
            del self._surveys[old]
            self._pages.pop(old, None)
        return entry

    def _survey(self, stores: dict[str, str], own_addr: str) -> tuple[list[dict[str, Any]],
                                                                         list[str]]:
        """The other stores' holdings and the stores that did not answer; with erasure coding,
        the lost nodes' shards rebuilt first (here: this store's own holdings then list them;
        or by another store, waited for: its records are added)."""
        sender = f"survey:{self._node_id}"
        held, lost = ask_holdings(stores, self._secret, self._run_id, sender)
        rebuild = self.rebuild
        if rebuild is not None:
            live = {n: a for n, a in stores.items() if n not in lost}
            mine: list[dict[str, Any]] = []
            if own_addr:
                live[self._node_id] = own_addr
                mine, _ = ask_holdings({self._node_id: own_addr}, self._secret, self._run_id,
                                       sender)
            held = held + rebuild(live, held + mine)  # what other stores rebuilt
        return held, lost

    def _own_holdings(self, addr: str) -> tuple[list[dict[str, Any]], list[str]]:
        """This node's shards as its shard service lists them now."""
        if not addr:
            return [], []
        if self._own is None or self._own_addr != addr:
            if self._own is not None:
                self._own.close()
            self._own, self._own_addr = _client(addr, self._secret, self._run_id,
                                                f"survey:{self._node_id}"), addr
        try:
            reply = self._own.request("holdings_request", {}, "holdings_reply",
                                      SURVEY_TIMEOUT_S)
        except FtrunError as e:
            log.warning("this node's shard service (%s) did not list its shards: %s", addr, e)
            return [], [self._node_id]
        return [{**r, "node": self._node_id, "addr": addr} for r in reply.body["records"]], []
