"""A small request/reply channel over one ZeroMQ DEALER socket, with the job's secret.

Used by ranks to talk to their node's store, and by the store to talk to the coordinator.
Replies are matched by kind; unrelated messages that arrive meanwhile (a store's
``snap_done`` for an earlier save) go to ``on_other``. Every wait is bounded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from ftrun import protocol
from ftrun.errors import FtrunError, ProtocolError, UnreachableError

log = logging.getLogger(__name__)


class Channel:
    def __init__(self, url: str, secret: bytes, job: str, sender: str,
                 on_other: Callable[[protocol.Message], None] | None = None) -> None:
        self.url = url
        self._secret = secret
        self._job = job
        self._sender = sender
        self._on_other = on_other
        self._lock = threading.Lock()
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket[Any] | None = None

    def _socket(self) -> zmq.Socket[Any]:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 1000)
            sock.setsockopt(zmq.RCVHWM, 1000)
            sock.setsockopt(zmq.SNDTIMEO, 1000)
            sock.connect(self.url)
            self._sock = sock
        return self._sock

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def send(self, kind: str, body: dict[str, Any]) -> bool:
        """Fire and forget; False when nobody is connected to take it."""
        frames = protocol.encode(kind, body, secret=self._secret, job=self._job,
                                 sender=self._sender)
        with self._lock:
            try:
                self._socket().send_multipart(frames)
                return True
            except zmq.Again:
                return False

    def drain(self) -> None:
        """Handle whatever has arrived, without waiting."""
        with self._lock:
            self._recv_until(None, 0.0)

    def request(self, kind: str, body: dict[str, Any], reply: str, timeout_s: float,
                attempts: int = 1) -> protocol.Message:
        """Send and wait for a message of kind ``reply``; resend after each timeout."""
        frames = protocol.encode(kind, body, secret=self._secret, job=self._job,
                                 sender=self._sender)
        with self._lock:
            for attempt in range(attempts):
                sock = self._socket()
                try:
                    sock.send_multipart(frames)  # queued until connected; SNDTIMEO bounds it
                except zmq.Again:
                    self._reset()
                    continue
                msg = self._recv_until(reply, timeout_s)
                if msg is not None:
                    return msg
                log.debug("%s to %s: no %s after %.1f s (attempt %d)", kind, self.url, reply,
                          timeout_s, attempt + 1)
                self._reset()  # a fresh connection drops replies meant for the lost request
        raise UnreachableError(f"no {reply} from {self.url} for {kind} within "
                               f"{attempts} x {timeout_s:g} s")

    def _recv_until(self, want: str | None, timeout_s: float) -> protocol.Message | None:
        sock = self._socket()
        deadline = time.monotonic() + timeout_s
        while True:
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not sock.poll(remaining_ms, zmq.POLLIN):
                return None
            frames = sock.recv_multipart()
            if frames == [protocol.AUTH_REFUSED]:
                raise FtrunError(f"{self.url} refused this job's secret")
            try:
                msg = protocol.decode(frames, secret=self._secret, job=self._job)
            except ProtocolError as e:
                log.warning("dropped a bad message from %s: %s", self.url, e)
                continue
            if want is not None and msg.kind == want:
                return msg
            if msg.kind == "error":
                raise FtrunError(f"{self.url}: {msg.body['message']}")
            if self._on_other is not None:
                self._on_other(msg)

    def close(self) -> None:
        with self._lock:
            self._reset()
