"""Shared fixtures: private state dirs, real ftrun processes that are always reaped.

The helpers are ftrun.testing's (one harness for tests and benchmarks); they are imported
here under the names the test modules import from ``conftest``.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from ftrun.testing import TRAIN, Procs, free_port, pid_alive, read_events, result_line, wait_for

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["ROOT", "TRAIN", "Procs", "free_port", "load_train", "pid_alive", "read_events",
           "result_line", "wait_for"]


def load_train() -> ModuleType:
    """examples/train.py imported as a module (its functions, parse_args, ...)."""
    spec = importlib.util.spec_from_file_location("ftrun_example_train", TRAIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def exact_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """For tests that check which step a restart resumes from or which step is persisted.

    By default a snapshot whose buffer the store has not released by the next
    optimizer.step() is skipped (training never waits). On a loaded 2-core machine with
    millisecond steps that happens now and then, and the step checked would move. These
    tests let each step wait for its buffer instead (--snapshot-wait); the default path,
    with skips and a restart, is tested bit-identical in tests/test_snapshot_stall.py.
    """
    monkeypatch.setenv("FTRUN_SNAPSHOT_WAIT", "60")


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "state"
    monkeypatch.setenv("FTRUN_STATE_DIR", str(d))
    monkeypatch.delenv("FTRUN_SECRET", raising=False)
    return d


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.cleanup()


# scripts/test.sh runs the suite on two pytest-xdist workers (FTRUN_TEST_WORKERS), one file per worker at a time
# (scripts/test.sh: -n 2 --dist loadfile). A worker takes the next file in collection order
# when it is free: the longest files go first, so that no long one starts last and runs
# alone at the end. Seconds per file in a serial CI run on the 2-CPU development machine.
# The long matrices' further cells run with FTRUN_FULL_MATRIX=1 (scripts/test.sh -m
# full_matrix, or the whole suite); CI runs one cell of each (its time budget: ~40 min).
def null_greeting(host: str, port: int) -> socket.socket:
    """A connection opened the way a ZeroMQ peer without ftrun's handshake opens one: a ZMTP
    3.0 greeting offering the NULL mechanism, then nothing. Kept open, it is the server that
    ends it at the mechanism mismatch: counted and logged as a refused handshake every time
    (a ZeroMQ socket of that kind sometimes closes first: a handshake cut short, which
    servers do not count). Close it when done."""
    conn = socket.create_connection((host, port), timeout=10)
    conn.sendall(b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00")
                 + b"\x00" + bytes(31))
    return conn


def full_matrix() -> bool:
    """Whether the long matrices' further cells run (FTRUN_FULL_MATRIX=1)."""
    return os.environ.get("FTRUN_FULL_MATRIX") == "1"


FULL_MATRIX = pytest.mark.skipif(
    not full_matrix(), reason="a further cell of a long matrix: run it with FTRUN_FULL_MATRIX=1")

LONGEST_FILES = {  # seconds, one process, CI machine (clean-clone run of 2026-11-29 05:00)
    "test_node_loss.py": 555, "test_launcher_integ.py": 530, "test_snapshot_integ.py": 380,
    "test_framework_inplace.py": 310, "test_fault_points.py": 280, "test_user_ddp.py": 260,
    "test_inprocess.py": 250, "test_persist_integ.py": 220, "test_ec_integ.py": 155,
    "test_etcd_integ.py": 185, "test_report.py": 165, "test_warm.py": 140,
    "test_reshard_integ.py": 127, "test_failover_integ.py": 122, "test_replica_integ.py": 110,
    "test_collectives.py": 100, "test_data_position.py": 82, "test_isolate.py": 70,
    "test_lightning.py": 61, "test_snapshot_stall.py": 51, "test_catalog.py": 32,
    "test_bind_host.py": 32, "test_torch_seams.py": 28, "test_snapshot_cadence.py": 28,
    "test_control_plane.py": 28, "test_ec_store.py": 22,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: -LONGEST_FILES.get(item.path.name, 0))  # stable: file order kept
