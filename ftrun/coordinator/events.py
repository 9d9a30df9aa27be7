"""The job's structured event log: bounded in memory, appended as JSON lines to a file.

Every decision the coordinator takes (a node joined, lost or left; a directive issued or
acked; a persist target; a refused message) is one event ``{seq, ts, type, node, ...data}``.
``ftrun status`` shows the tail, ``events_request`` pages through what memory keeps, and
``<state dir>/jobs/<run id>/events.jsonl`` keeps everything. Thread-safe.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from ftrun.protocol.transport import RateLimiter

log = logging.getLogger(__name__)

MAX_EVENTS = 10_000
# The newest recoveries (launchers' ``recovery`` events) ``ftrun status`` shows.
RECOVERIES_KEPT = 8
WARN_EVERY_S = 10.0


class EventLog:
    """Events numbered from 1, the newest :data:`MAX_EVENTS` kept in memory. A coordinator
    that holds the role under a term (failover) marks each of its events with it."""

    def __init__(self, max_events: int = MAX_EVENTS, term: int = 0) -> None:
        self._term = term
        self._lock = threading.Lock()
        self._events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self._recoveries: deque[dict[str, Any]] = deque(maxlen=RECOVERIES_KEPT)
        self._recovery_count = 0
        self._seq = 0
        self._fh: Any = None
        self._warn = RateLimiter(WARN_EVERY_S)

    @property
    def count(self) -> int:
        """Events recorded so far (the newest ``seq``)."""
        return self._seq

    def start_after(self, seq: int) -> None:
        """Number the next event ``seq + 1`` (a coordinator that took over from another goes
        on past the events its predecessor numbered); never goes back."""
        with self._lock:
            self._seq = max(self._seq, seq)

    def open(self, path: Path) -> None:
        """Append to ``path`` from now on; on failure events stay in memory only."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            fh = os.fdopen(fd, "a", encoding="utf-8")
        except OSError as e:
            log.error("cannot open the event log %s (%s); events stay in memory only", path, e)
            return
        with self._lock:
            self._fh = fh

    def close(self) -> None:
        with self._lock:
            fh, self._fh = self._fh, None
        if fh is not None:
            try:
                fh.close()
            except OSError as e:
                log.warning("closing the event log failed: %s", e)

    def record(self, type_: str, node: str | None, data: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self._seq += 1
            event = dict(data)
            if self._term:
                event.setdefault("term", self._term)
            event.update(seq=self._seq, ts=time.time(), type=type_, node=node)
            self._events.append(event)
            if type_ == "recovery":
                self._recoveries.append(event)
                self._recovery_count += 1
            if self._fh is not None:
                try:
                    self._fh.write(json.dumps(event, separators=(",", ":")) + "\n")
                    self._fh.flush()
                except (OSError, TypeError, ValueError) as e:
                    allowed, _ = self._warn.allow(("events_file", type(e)))
                    if allowed:
                        log.error("writing the event log failed: %s", e)
        return event

    def since(self, since: int = 0) -> list[dict[str, Any]]:
        """Every event kept in memory with ``seq > since``, oldest first."""
        with self._lock:
            if since <= 0:
                return [dict(e) for e in self._events]
            # seq is consecutive: skip straight to the first one wanted.
            first = self._events[0]["seq"] if self._events else 0
            start = max(0, since - first + 1)
            return [dict(e) for e in list(self._events)[start:]]

    def recoveries(self) -> dict[str, Any]:
        """How many recoveries were recorded, and the newest ones (oldest first)."""
        with self._lock:
            return {"count": self._recovery_count,
                    "recent": [dict(e) for e in self._recoveries]}

    def tail(self, n: int) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(e) for e in list(self._events)[-n:]] if n > 0 else []

    def page(self, since: int, max_events: int, max_bytes: int) -> tuple[list[dict[str, Any]], bool]:
        """Events after ``since``, at most ``max_events`` and about ``max_bytes`` of JSON;
        and whether more follow."""
        out: list[dict[str, Any]] = []
        size = 0
        for event in self.since(since):
            size += len(json.dumps(event, separators=(",", ":"))) + 1
            if len(out) >= max_events or size > max_bytes:
                return out, True
            out.append(event)
        return out, False
