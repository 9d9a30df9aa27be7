"""The service runtime: one lifecycle for every server on :mod:`ftrun.protocol.transport`.

A :class:`Service` owns a :class:`~ftrun.protocol.transport.Server`'s socket (and, when
asked, a ZeroMQ context of its own) and runs it:

- **bind**: :meth:`Service.bind` (a URL: tcp://host:port, port ``*`` for any; ipc://path)
  or :meth:`Service.bind_tcp` (a host, on a port the OS picks); a failure closes what was
  made and raises :class:`~ftrun.errors.FtrunError` naming the address and what to do;
- **serve**: :meth:`Service.start` (a daemon thread of its own) or :meth:`Service.run` (in
  the calling thread). The loop reads what arrives within ``poll_s`` (at most
  ``max_messages`` a round), then calls ``after(n)``, the owner's periodic work, with the
  number read; with ``batch_s``, a round that read some but not all waiting messages
  waits out the rest of ``batch_s`` (at thousands of messages a second, waking for each
  one costs more than handling it). ``setup`` runs once on the serving thread first;
- **survive**: an error in a round (the server, ``after``) is logged and the loop goes on
  after ``poll_s``; a terminated context ends it;
- **stop**: :meth:`Service.stop` is bounded by its timeout: it returns False, leaving the
  socket to the stuck thread, when the loop did not end in time; else the socket is closed
  and an own context terminated. Calling it twice, or before start, is harmless.

Adopting it is a few lines: build the Server, wrap it, bind, start; stop in the owner's stop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from ftrun.errors import FtrunError
from ftrun.protocol.transport import Server

log = logging.getLogger(__name__)


class Service:
    """One server's bind, thread, serving loop, error survival and bounded stop."""

    def __init__(
        self,
        server: Server,
        *,
        poll_s: float,
        max_messages: int,
        after: Callable[[int], None] | None = None,
        setup: Callable[[], None] | None = None,
        batch_s: float = 0.0,
        own_context: bool = False,
        thread_name: str | None = None,
    ) -> None:
        self.server = server
        self.poll_s = poll_s
        self.max_messages = max_messages
        self._after = after
        self._setup = setup
        self._batch_s = batch_s
        self._own_context = own_context
        self._thread_name = thread_name or f"ftrun-{server.name.replace(' ', '-')}"
        self._ctx: zmq.Context[Any] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._running = threading.Event()
        self.bound: str | None = None  # the URL actually bound

    @property
    def name(self) -> str:
        return self.server.name

    # -- bind ------------------------------------------------------------------------------

    def _context(self) -> zmq.Context[Any]:
        if not self._own_context:
            return zmq.Context.instance()
        if self._ctx is None:
            self._ctx = zmq.Context()
        return self._ctx

    def bind(self, url: str) -> str:
        """Bind ``url``; returns the URL actually bound."""
        try:
            self.bound = self.server.bind(url, self._context())
        except zmq.ZMQError as e:
            self._term()
            raise FtrunError(f"the {self.name} cannot listen on {url}: {e}; pick another "
                             "port or free this one, or another bind address") from e
        return self.bound

    def bind_tcp(self, host: str) -> str:
        """Bind ``host`` on a port the OS picks; returns the ``host:port`` peers use."""
        try:
            address = self.server.bind_tcp(host, self._context())
        except zmq.ZMQError as e:
            self._term()
            raise FtrunError(f"the {self.name} cannot listen on {host}: {e}; check the bind "
                             "address") from e
        self.bound = address
        return address

    # -- serve -----------------------------------------------------------------------------

    def start(self) -> None:
        """Serve on a daemon thread of its own (bind first)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name=self._thread_name, daemon=True)
        self._thread.start()

    def run(self, stop: threading.Event | None = None) -> None:
        """Serve in the calling thread until :meth:`stop` (or ``stop`` is set); an
        owner-run loop (not :meth:`start`'s thread) closes the socket on its way out."""
        own_thread = threading.current_thread() is self._thread
        self._running.set()
        try:
            if self._setup is not None:
                try:
                    self._setup()
                except Exception:  # noqa: BLE001 - serving goes on without it
                    log.exception("%s: setup failed; serving anyway", self.name)
            self._loop(stop)
        finally:
            self._running.clear()
            if not own_thread:
                self._close()

    def _loop(self, stop: threading.Event | None) -> None:
        server = self.server
        while not self._stop.is_set() and (stop is None or not stop.is_set()):
            try:
                started = time.monotonic()
                n = server.serve_once(self.poll_s, self.max_messages)
                if self._after is not None:
                    self._after(n)
                if self._batch_s and 0 < n < self.max_messages:
                    self._stop.wait(max(0.0, self._batch_s - (time.monotonic() - started)))
            except zmq.ContextTerminated:
                break
            except Exception:  # noqa: BLE001 - a serving loop must survive anything
                log.exception("%s loop error; continuing", self.name)
                self._stop.wait(self.poll_s)
        log.debug("%s stopped serving", self.name)

    @property
    def serving(self) -> bool:
        """Whether a loop runs (on :meth:`start`'s thread or in :meth:`run`'s caller)."""
        return self._running.is_set()

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called (``setup`` work checks it to end early)."""
        return self._stop.is_set()

    @property
    def owns_thread(self) -> bool:
        """Whether it serves on a thread of its own (:meth:`start`)."""
        return self._thread is not None

    # -- stop ------------------------------------------------------------------------------

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop serving within ``timeout_s`` and release the socket; False when the loop did
        not end in time (its socket is then left to it)."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        thread = self._thread
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("%s thread did not stop within %.1f s; abandoning it", self.name,
                            timeout_s)
                return False
            self._thread = None
        elif self._running.is_set():  # run() in another thread closes on its way out
            while self._running.is_set() and time.monotonic() < deadline:
                time.sleep(0.01)
            return not self._running.is_set()
        self._close()
        return True

    def _close(self) -> None:
        self.server.close()
        self._term()

    def _term(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.term()
