"""The launcher's handle on its node's snapshot store process: start, supervise, stop."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import asdict

from ftrun.store.api import StoreConfig

log = logging.getLogger(__name__)


class StoreProcess:
    def __init__(self, cfg: StoreConfig, env: dict[str, str]) -> None:
        self.cfg = cfg
        self._env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ftrun.store.store", "--config", json.dumps(asdict(self.cfg))],
            env={**os.environ, **self._env}, start_new_session=True,
        )
        log.info("snapshot store started (pid %d)", self.proc.pid)

    def check(self) -> int | None:
        """Restart the store if it died; returns the dead store's exit code, else None."""
        if self.proc is None or self.proc.poll() is None:
            return None
        code = self.proc.returncode
        self.restarts += 1
        log.error("snapshot store (pid %d) exited with %s; restarting it (its segments are "
                  "adopted, nothing is lost)", self.proc.pid, code)
        self.start()
        return code

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 120.0) -> None:
        """SIGTERM: the store persists the newest committed step (if configured), removes the
        job's segments and exits. Killed if it takes longer than ``timeout_s``."""
        if self.proc is None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.error("snapshot store did not exit in %.0f s; killing it", timeout_s)
            self.proc.kill()
            self.proc.wait(timeout=30)
