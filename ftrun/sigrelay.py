"""Signal handlers that only take note, and a thread that acts on the note.

A Python signal handler runs on the main thread between two bytecodes of whatever that
thread was doing, possibly inside ``threading.Event.set`` or a logging call that holds a
lock. A handler that takes the same lock waits for itself forever. Signals do arrive close
together: Slurm signals every process of a job step, and the launcher forwards the same
signal again, so a store got SIGUSR1 twice within microseconds, and its second handler
blocked on the lock of the ``Event`` the first one was setting (the store stopped answering
its ranks and never wrote the step). The handler here writes the signal number to a pipe (one
system call, no lock); :class:`SignalRelay`'s thread reads it and calls the action there.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

# How often the relay's thread looks whether it was closed while no signal came.
WAKE_S = 1.0


class SignalRelay:
    """``act(signum)`` on a thread of its own for each of ``signums`` the process receives.

    Each run of the handler is acted on once, in order (Python runs a handler once for
    deliveries that came before it could run it). The handlers are installed by :meth:`start`
    (main thread only) and the previous ones put back by :meth:`close`.
    """

    def __init__(self, act: Callable[[int], None], *signums: int,
                 name: str = "ftrun-signals") -> None:
        self._act = act
        self._signums = signums
        self._name = name
        self._previous: dict[int, Any] = {}
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> SignalRelay:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        for sig in self._signums:
            try:
                self._previous[sig] = signal.signal(sig, self._note)
            except ValueError:  # not the main thread
                log.warning("cannot install a %s handler outside the main thread",
                            signal.Signals(sig).name)
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        if self._closed.is_set():
            return  # the thread closes the pipe: writing to its number again could hit a reused fd
        for sig, handler in self._previous.items():
            try:
                signal.signal(sig, handler)
            except (ValueError, TypeError):
                pass
        self._previous.clear()
        self._closed.set()
        self._wake(0)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        self._thread = None

    def _note(self, signum: int, _frame: Any) -> None:
        self._wake(signum)

    def _wake(self, signum: int) -> None:
        try:
            os.write(self._write_fd, bytes([signum]))
        except OSError:
            # Full (tens of thousands of signals not yet read) or closed: the thread has
            # wake-ups enough, or is gone.
            pass

    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                ready, _, _ = select.select([self._read_fd], [], [], WAKE_S)
                if not ready:
                    continue
                for signum in os.read(self._read_fd, 256):
                    if signum and not self._closed.is_set():
                        try:
                            self._act(signum)
                        except Exception:  # noqa: BLE001 - the next signal is acted on too
                            log.exception("acting on signal %s failed", signal.Signals(signum).name)
        finally:
            os.close(self._read_fd)
            os.close(self._write_fd)
