"""Orders from the coordinator to node launchers, delivered over lossy links.

The coordinator never opens a connection to a launcher: it answers the launcher's
heartbeats. A directive (``restart``, ``isolate``, ``probe``; see :class:`Action`) is kept
pending for its node and sent in a ``directives`` reply to *every* heartbeat of that node
until a heartbeat lists its id in ``acked``. A lost reply or a lost heartbeat only delays
it by one heartbeat interval; the launcher's reporter delivers each id once
(:class:`ftrun.coordinator.client.NodeReporter`). A directive is dropped when its node is
gone (left or lost) or after :data:`DIRECTIVE_TTL_S`.

Who calls what: the coordinator's serving thread calls :meth:`DirectiveBook.for_heartbeat`
and :meth:`DirectiveBook.drop_node`; anyone (the detection thread, tests) calls
:meth:`DirectiveBook.issue`. Every method is thread-safe and returns what happened so the
caller records events outside the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ftrun import protocol
from ftrun.coordinator.api import Action
from ftrun.errors import ConfigError

DIRECTIVE_TTL_S = 120.0
# Not an order but a request, sent in a ``directives`` reply to a keep-alive heartbeat whose
# workers the coordinator does not hold (it restarted, or a full heartbeat was lost): send a
# full heartbeat. The reporter handles it itself: never handed on, never acked.
REPORT_ACTION = Action.REPORT
# The most directives one reply carries (the oldest first); the rest follow in later replies.
MAX_PER_REPLY = 32
# The most directives pending for one node; issuing more is refused (a runaway caller).
MAX_PENDING_PER_NODE = 256


__all__ = ["REPORT_ACTION", "Action", "Directive", "DirectiveBook"]


@dataclass
class Directive:
    id: str
    node_id: str
    action: str
    data: dict[str, Any]
    issued_mono: float
    sent: int = 0  # replies it went out in so far
    wire: dict[str, Any] = field(default_factory=dict)


class DirectiveBook:
    """The pending directives of every node."""

    def __init__(self, ttl_s: float = DIRECTIVE_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._pending: dict[str, dict[str, Directive]] = {}  # node -> id -> directive

    def issue(self, node_id: str, action: str, data: dict[str, Any], now: float) -> Directive:
        """Queue a directive for ``node_id``; raises ConfigError for an unknown action or a
        ``data`` that cannot travel (not JSON, too large)."""
        if action not in {a.value for a in Action}:
            raise ConfigError(f"unknown directive action {action!r}; use one of "
                              f"{', '.join(a.value for a in Action)}")
        wire = {"id": protocol.new_id(), "action": str(action), "data": dict(data)}
        try:
            protocol.validate("directives", {"directives": [wire]})
            protocol.encode("directives", {"directives": [wire]}, secret=b"x", job="check",
                            sender="coordinator")
        except Exception as e:  # noqa: BLE001 - ProtocolError, or a non-JSON value
            raise ConfigError(f"directive {action} for {node_id} cannot be sent: {e}; pass "
                              "plain JSON data (numbers, strings, lists, dicts)") from e
        d = Directive(wire["id"], node_id, wire["action"], wire["data"], now, wire=wire)
        with self._lock:
            book = self._pending.setdefault(node_id, {})
            if len(book) >= MAX_PENDING_PER_NODE:
                raise ConfigError(f"{len(book)} directives already pending for {node_id}; "
                                  "it does not ack them (is its launcher alive?)")
            book[d.id] = d
        return d

    def any_for(self, node_id: str) -> bool:
        """Whether anything is pending for ``node_id`` (lock-free: the heartbeat fast path;
        a directive issued concurrently goes out with the next heartbeat)."""
        return node_id in self._pending

    def for_heartbeat(self, node_id: str, acked: Iterable[str],
                      now: float) -> tuple[list[dict[str, Any]], list[Directive], list[Directive]]:
        """A heartbeat of ``node_id`` arrived acking ``acked``: returns (the directives to
        send in its reply, those acked now, those expired now)."""
        with self._lock:
            book = self._pending.get(node_id)
            if not book:
                return [], [], []
            done = [book.pop(i) for i in acked if i in book]
            expired = [d for d in book.values() if now - d.issued_mono > self.ttl_s]
            for d in expired:
                del book[d.id]
            out = []
            for d in list(book.values())[:MAX_PER_REPLY]:
                d.sent += 1
                out.append(d.wire)
            if not book:
                del self._pending[node_id]
        return out, done, expired

    def drop_node(self, node_id: str) -> list[Directive]:
        """The node is gone: its pending directives are dropped (and returned)."""
        with self._lock:
            return list(self._pending.pop(node_id, {}).values())

    def pending(self, node_id: str | None = None) -> list[dict[str, Any]]:
        """What is pending (for ``node_id``, or every node): id, node, action, age, sends."""
        with self._lock:
            books = ([self._pending.get(node_id, {})] if node_id is not None
                     else list(self._pending.values()))
            return [{"id": d.id, "node_id": d.node_id, "action": d.action, "sent": d.sent,
                     "issued_mono": d.issued_mono} for b in books for d in b.values()]

    def count(self) -> int:
        with self._lock:
            return sum(len(b) for b in self._pending.values())
