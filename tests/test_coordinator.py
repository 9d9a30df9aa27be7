"""The coordinator, its clients and ``ftrun status`` against a real in-process coordinator."""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import zmq
from conftest import free_port
from conftest import wait_for as harness_wait_for

from ftrun import exit_codes, jobs, protocol
from ftrun.cli.status import run_status
from ftrun.coordinator.client import NodeReporter, policy_mismatch, request
from ftrun.coordinator.server import (
    ENDPOINT_KEY,
    Coordinator,
    health_of,
    lookup_endpoint,
    publish_endpoint,
)
from ftrun.errors import AuthError, FtrunError, ProtocolError, UnreachableError
from ftrun.protocol import handshake, transport

pytestmark = pytest.mark.timeout(60)

JOB = "job-test"
SECRET = b"0123456789abcdef0123456789abcdef"
REPO = Path(__file__).resolve().parent.parent


# The harness's wait, with this module's defaults: a short deadline, polled finely.
wait_for = functools.partial(harness_wait_for, timeout_s=5.0, what="condition", interval_s=0.02)


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FTRUN_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("FTRUN_SECRET", raising=False)
    return tmp_path / "state"


@pytest.fixture
def make_coordinator(tmp_path: Path) -> Iterator[Callable[..., Coordinator]]:
    started: list[Coordinator] = []

    def make(**kw: Any) -> Coordinator:
        kw.setdefault("bind_host", "127.0.0.1")
        kw.setdefault("events_file", tmp_path / "events.jsonl")
        c = Coordinator(kw.pop("run_id", JOB), kw.pop("secret", SECRET), **kw)
        c.start()
        started.append(c)
        return c

    yield make
    for c in started:
        c.stop(timeout_s=2)


@pytest.fixture
def coordinator(make_coordinator: Callable[..., Coordinator]) -> Coordinator:
    return make_coordinator()


def workers_state(restarts: int = 0) -> dict[str, Any]:
    return {
        "state": "healthy",
        "group_rank": 0,
        "group_world_size": 1,
        "restarts": restarts,
        "max_restarts": 3,
        "workers": [
            {"local_rank": i, "rank": i, "pid": 1000 + i, "state": "healthy", "exitcode": None}
            for i in range(2)
        ],
        "last_error": None,
    }


def status(c: Coordinator, secret: bytes = SECRET, timeout_s: float = 3.0) -> dict[str, Any]:
    reply = request(c.endpoint, secret, JOB, "status_request", {}, timeout_s=timeout_s)
    assert reply.kind == "status_reply"
    return reply.body["doc"]


def test_import_does_not_load_torch() -> None:
    code = ("import sys, ftrun.protocol, ftrun.coordinator.server, ftrun.coordinator.client, "
            "ftrun.cli.status; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30, cwd=REPO)


def test_endpoint_and_job_start(coordinator: Coordinator, tmp_path: Path) -> None:
    host, port = protocol.split_endpoint(coordinator.endpoint)
    assert host == "127.0.0.1" and port > 0
    doc = status(coordinator)
    assert doc["version"] == 1 and doc["run_id"] == JOB
    assert doc["health"] == "starting" and doc["nodes"] == []
    assert doc["coordinator"]["endpoint"] == coordinator.endpoint
    assert doc["coordinator"]["pid"] == os.getpid()
    assert [e["type"] for e in doc["events_tail"]] == ["job_start"]
    assert doc["recoveries"] == {"count": 0, "recent": []}
    first = json.loads((tmp_path / "events.jsonl").read_text().splitlines()[0])
    assert first["type"] == "job_start" and first["seq"] == 1 and first["node"] is None


@pytest.mark.parametrize("detection", [True, False])
def test_hello_answer_says_where_ranks_report(make_coordinator: Callable[..., Coordinator],
                                              detection: bool) -> None:
    """A launcher given --coordinator learns the detection endpoint from the answer to its
    hello ("" when the coordinator runs no detection)."""
    from ftrun.coordinator.detect import DetectConfig

    c = make_coordinator(detection=DetectConfig(on_hang="isolate") if detection else None)
    answers: list[dict[str, Any]] = []
    reporter = NodeReporter(c.endpoint, SECRET, JOB, "host-h/1", "host-h", workers_state,
                            interval_s=0.05, on_hello=answers.append)
    reporter.start()
    try:
        assert reporter.wait_hello(10), "the coordinator never answered hello"
        assert len(answers) == 1
        assert answers[0]["detect"] == (c.detect_endpoint if detection else "")
        if detection:
            assert answers[0]["detect"] and answers[0]["detect"] != c.endpoint
            # The policy it acts on, so that a launcher whose flags differ says so.
            assert (answers[0]["on_hang"], answers[0]["on_slow"]) == ("isolate", "warn")
            said = policy_mismatch(answers[0], "restart", "warn")
            assert said is not None and "--on-hang restart here, isolate at the coordinator" \
                in said and "on-slow" not in said
            assert policy_mismatch(answers[0], "isolate", "warn") is None
        else:
            assert policy_mismatch(answers[0], "restart", "warn") is None
    finally:
        reporter.stop("succeeded", 0, timeout_s=3)
    assert len(answers) == 1


def test_reporter_heartbeats_events_and_bye(coordinator: Coordinator, tmp_path: Path) -> None:
    reporter = NodeReporter(coordinator.endpoint, SECRET, JOB, "host-a/1", "host-a",
                            lambda: workers_state(restarts=1), interval_s=0.05)
    reporter.start()
    try:
        node = wait_for(lambda: [n for n in coordinator.status_document()["nodes"]
                                 if n["workers"]], what="a heartbeat")[0]
        assert node["node_id"] == "host-a/1" and node["host"] == "host-a"
        assert node["pid"] == os.getpid() and node["group_rank"] == 0
        assert node["ranks"] == [0, 1] and node["restarts"] == 1 and node["max_restarts"] == 3
        assert node["state"] == "healthy" and not node["lost"]
        assert [w["pid"] for w in node["workers"]] == [1000, 1001]
        assert node["last_heartbeat_age_s"] < 2
        doc = status(coordinator)
        assert doc["health"] == "healthy"
        assert doc["summary"] == {**doc["summary"], "nodes": 1, "nodes_lost": 0, "ranks": 2,
                                  "workers_running": 2, "restarts": 1}
        for i in range(20):
            reporter.event("worker_failure" if i % 2 else "restart", attempt=i, why="x" * i)
    finally:
        reporter.stop("succeeded", 0, timeout_s=3)
    events = wait_for(lambda: [e for e in coordinator.events() if e["type"] == "node_left"]
                      and coordinator.events(), what="bye")
    mine = [e for e in events if e["type"] in ("restart", "worker_failure")]
    assert [e["attempt"] for e in mine] == list(range(20))
    assert all(e["node"] == "host-a/1" for e in mine)
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    types = [e["type"] for e in events]
    assert types.index("node_joined") < types.index("restart") < types.index("node_left")
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert lines == events
    assert reporter.sent["bye"] == 1 and reporter.sent["event"] == 20
    doc = status(coordinator)
    assert doc["health"] == "finished"
    assert doc["nodes"][0]["left"] and doc["nodes"][0]["exitcode"] == 0
    assert doc["summary"]["events"] == events[-1]["seq"]
    reply = request(coordinator.endpoint, SECRET, JOB, "events_request",
                    {"since": events[-3]["seq"]})
    assert reply.body["events"] == events[-2:] and reply.body["more"] is False


def test_node_lost_after_timeout_and_rejoin(make_coordinator: Callable[..., Coordinator]) -> None:
    c = make_coordinator(node_timeout_s=0.3)
    hello = {"node_id": "host-b/7", "host": "host-b", "pid": 7}
    assert request(c.endpoint, SECRET, JOB, "hello", hello, sender="host-b/7").kind == "ack"
    assert c.status_document()["nodes"][0]["lost"] is False
    wait_for(lambda: c.status_document()["nodes"][0]["lost"], timeout_s=5, what="node_lost")
    doc = c.status_document()
    assert doc["health"] == "degraded" and doc["summary"]["nodes_lost"] == 1
    lost = [e for e in c.events() if e["type"] == "node_lost"]
    assert len(lost) == 1 and lost[0]["node"] == "host-b/7"
    heartbeat = {**workers_state(), "node_id": "host-b/7", "host": "host-b", "pid": 7}
    frames = protocol.encode("heartbeat", heartbeat, secret=SECRET, job=JOB, sender="t",
                             term=c.incarnation)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    handshake.join(sock, SECRET)
    sock.connect(protocol.zmq_url(c.endpoint))
    try:
        sock.send_multipart(frames)
        wait_for(lambda: not c.status_document()["nodes"][0]["lost"], what="rejoin")
    finally:
        sock.close(0)
    joined = [e for e in c.events() if e["type"] == "node_joined"]
    assert joined[-1].get("rejoined") is True


def test_wrong_secret(coordinator: Coordinator, caplog: pytest.LogCaptureFixture) -> None:
    server_log = logging.getLogger(handshake.__name__)
    server_log.addHandler(caplog.handler)
    caplog.handler.setLevel(logging.WARNING)
    try:
        # An AuthError, not a timeout (UnreachableError): the refused handshake is told.
        with pytest.raises(AuthError, match="refused our secret at its handshake"):
            request(coordinator.endpoint, b"wrong-secret-wrong-secret", JOB, "status_request",
                    {}, timeout_s=5)
    finally:
        server_log.removeHandler(caplog.handler)
    assert any("coordinator: refused a connection from 127.0.0.1 at the handshake"
               in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert coordinator.counters["auth_failures"] >= 1  # each handshake it retried
    [event] = [e for e in coordinator.events() if e["type"] == "auth_failure"]  # rate-limited
    assert event["peer"] == "127.0.0.1" and "at the handshake" in event["reason"]
    assert status(coordinator)["run_id"] == JOB  # still serving


def test_garbage_does_not_crash(coordinator: Coordinator) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    handshake.join(sock, SECRET)  # past the handshake: the messages themselves are refused
    sock.connect(protocol.zmq_url(coordinator.endpoint))
    try:
        for frames in ([b"x"], [b"a"] * 5, [b"y" * (protocol.MAX_MESSAGE_BYTES - 10), b"z" * 32],
                       [b"x"] * 2000):
            sock.send_multipart(frames)
        assert not sock.poll(300), "unauthenticated garbage must not be answered"
        # A wrong MAC gets only the fixed, unsigned refusal.
        for frames in ([b"{}", b"\0" * 32], [b"", b"\1" * 32]):
            sock.send_multipart(frames)
            assert sock.poll(3000)
            assert sock.recv_multipart() == [protocol.AUTH_REFUSED]
        # Authentic but invalid: answered with an error that names the problem.
        bad = json.dumps({"v": protocol.VERSION, "kind": "reboot", "job": JOB, "sender": "t",
                          "ts": time.time(), "id": "ab", "body": {}}).encode()
        sock.send_multipart([bad, hmac.new(SECRET, bad, hashlib.sha256).digest()])
        assert sock.poll(3000), "no error reply to an authentic invalid message"
        reply = protocol.decode(sock.recv_multipart(), secret=SECRET, job=JOB)
        assert reply.kind == "error" and "unknown message kind" in reply.body["message"]
        assert reply.body["error"] == "ProtocolError"
    finally:
        sock.close(0)
    assert coordinator.counters["bad_messages"] == 5
    assert coordinator.counters["auth_failures"] == 2
    assert status(coordinator)["run_id"] == JOB
    assert [e for e in coordinator.events() if e["type"] == "bad_message"]


def test_wrong_job_is_answered_with_error(coordinator: Coordinator) -> None:
    with pytest.raises(ProtocolError):
        request(coordinator.endpoint, SECRET, "other-job", "status_request", {}, timeout_s=3)


def test_reporter_survives_coordinator_restart(make_coordinator: Callable[..., Coordinator],
                                               tmp_path: Path) -> None:
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    calls = {"n": 0}

    def flaky_state() -> dict[str, Any]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("state not ready")
        return workers_state()

    reporter = NodeReporter(endpoint, SECRET, JOB, "host-c/3", "host-c", flaky_state,
                            interval_s=0.05)
    reporter.start()  # the coordinator is not up yet
    try:
        time.sleep(0.2)
        first = make_coordinator(port=port)
        assert first.endpoint == endpoint
        wait_for(lambda: first.status_document()["nodes"], what="node on first coordinator")
        first.stop(timeout_s=2)
        second = make_coordinator(port=port, events_file=tmp_path / "events2.jsonl")
        wait_for(lambda: [n for n in second.status_document()["nodes"] if n["workers"]],
                 timeout_s=10, what="node on restarted coordinator")
    finally:
        reporter.stop("stopped", 1, timeout_s=2)
    assert calls["n"] > 1


def test_reporter_stop_is_bounded_without_coordinator() -> None:
    reporter = NodeReporter(f"127.0.0.1:{free_port()}", SECRET, JOB, "n/1", "n",
                            workers_state, interval_s=0.05)
    reporter.start()
    reporter.event("rendezvous", round=1)
    started = time.monotonic()
    reporter.stop("failed", 1, timeout_s=0.5)
    assert time.monotonic() - started < 2


def test_health_rules() -> None:
    def node(**kw: Any) -> dict[str, Any]:
        base = {"state": "healthy", "restarts": 0, "max_restarts": 3, "workers": [],
                "lost": False, "left": False, "exitcode": None}
        return {**base, **kw}

    failed_worker = [{"rank": 0, "state": "failed", "exitcode": 1}]
    assert health_of([]) == "starting"
    assert health_of([node(state="init")], expected_min_nodes=2) == "starting"
    assert health_of([node(), node()]) == "healthy"
    assert health_of([node(), node(lost=True)]) == "degraded"
    assert health_of([node(state="restarting", restarts=1)]) == "degraded"
    assert health_of([node(state="rendezvous", restarts=0)]) == "healthy"
    assert health_of([node(workers=failed_worker, restarts=1)]) == "degraded"
    assert health_of([node(workers=failed_worker, restarts=3)]) == "failed"
    assert health_of([node(), node(state="failed", lost=True)]) == "failed"
    assert health_of([node(state="succeeded"), node(state="stopped", left=True,
                                                    exitcode=0)]) == "finished"
    assert health_of([node(), node(state="stopped", left=True, exitcode=1)]) == "degraded"
    suspect = [{"rank": 0, "state": "running", "exitcode": None, "health": "suspect"},
               {"rank": 1, "state": "running", "exitcode": None, "health": "ok"}]
    assert health_of([node(), node(workers=suspect)]) == "degraded"
    # A verdict from before the worker exited, or from a launcher that left, is stale.
    assert health_of([node(workers=[{**suspect[0], "exitcode": 0}])]) == "healthy"
    assert health_of([node(), node(workers=suspect, left=True, exitcode=0)]) == "healthy"


class FakeStore:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.data[key] = value

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        if not all(k in self.data for k in keys):
            raise RuntimeError(f"Wait timeout after {timeout}")

    def get(self, key: str) -> bytes:
        return self.data[key]


def test_publish_and_lookup_endpoint() -> None:
    store = FakeStore()
    with pytest.raises(UnreachableError, match="no coordinator endpoint"):
        lookup_endpoint(store, timeout_s=0.1)
    publish_endpoint(store, "node0:1234")
    assert store.data[ENDPOINT_KEY] == b"node0:1234"
    assert lookup_endpoint(store, timeout_s=0.1) == "node0:1234"


# -- ftrun status -----------------------------------------------------------------------------


def write_job(run_id: str, endpoint: str) -> None:
    jobs.write_job_file(jobs.JobFile(run_id=run_id, endpoint=endpoint, host=socket.gethostname(),
                                     pid=os.getpid(), started_at=time.time()))


def test_run_status_json(state_dir: Path, make_coordinator: Callable[..., Coordinator],
                         capsys: pytest.CaptureFixture[str]) -> None:
    secret = jobs.load_secret(JOB, create=True)
    c = make_coordinator(secret=secret)
    write_job(JOB, c.endpoint)
    reporter = NodeReporter(c.endpoint, secret, JOB, "host-a/1", "host-a", workers_state,
                            interval_s=0.05)
    reporter.start()
    try:
        wait_for(lambda: c.status_document()["nodes"], what="node")
        code = run_status(JOB, endpoint=None, json_out=True, watch=False, no_headers=False,
                          state_dir=None, timeout_s=3)
        out = capsys.readouterr().out
        doc = json.loads(out)
        assert code == exit_codes.OK and out.endswith("}\n")
        assert doc["run_id"] == JOB and doc["nodes"][0]["node_id"] == "host-a/1"

        code = run_status(JOB, endpoint=None, json_out=False, watch=False, no_headers=False,
                          state_dir=None, timeout_s=3)
        out = capsys.readouterr().out
        assert code == exit_codes.OK
        assert "last heartbeat" in out and "0-1" in out and "0/3" in out and "healthy" in out
        run_status(JOB, endpoint=None, json_out=False, watch=False, no_headers=True,
                   state_dir=None, timeout_s=3)
        out = capsys.readouterr().out
        assert "last heartbeat" not in out and "0-1" in out and "job " not in out

        sleeps = {"n": 0}

        def fake_sleep(_s: float) -> None:
            sleeps["n"] += 1
            if sleeps["n"] >= 3:
                raise KeyboardInterrupt

        import ftrun.cli.status as status_mod

        orig_sleep = status_mod.time.sleep
        status_mod.time.sleep = fake_sleep  # type: ignore[assignment]
        try:
            code = run_status(JOB, endpoint=c.endpoint, json_out=True, watch=True,
                              no_headers=False, state_dir=None, interval_s=0.1, timeout_s=3)
        finally:
            status_mod.time.sleep = orig_sleep  # type: ignore[assignment]
        lines = capsys.readouterr().out.splitlines()
        assert code == exit_codes.OK and len(lines) == 3
        assert all(json.loads(line)["run_id"] == JOB for line in lines)
    finally:
        reporter.stop("succeeded", 0)


def test_status_table_without_a_terminal(state_dir: Path, make_coordinator: Callable[..., Coordinator],
                                        capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Piped (capsys is no tty): one line per node however long the error; all of it in --json."""
    secret = jobs.load_secret(JOB, create=True)
    c = make_coordinator(secret=secret)
    write_job(JOB, c.endpoint)
    error = ("rank 1 exited with code 13: Traceback (most recent call last):\n"
             + "".join(f'  File "train.py", line {i}, in step\n' for i in range(40))
             + "RuntimeError: " + "x" * 300)

    def state() -> dict[str, Any]:
        doc = workers_state(restarts=1)
        doc["last_error"] = error
        doc["workers"][1].update(health="suspect", cause="stopped", step=7,
                                 reason="stopped (SIGSTOP or a debugger) for 2.5 s")
        return doc

    reporter = NodeReporter(c.endpoint, secret, JOB, "host-a/1", "host-a", state, interval_s=0.05)
    reporter.start()
    try:
        wait_for(lambda: c.status_document()["nodes"], what="node")
        code = run_status(JOB, endpoint=None, json_out=True, watch=False, no_headers=False,
                          state_dir=None, timeout_s=3)
        doc = json.loads(capsys.readouterr().out)
        assert code == exit_codes.DEGRADED and doc["health"] == "degraded"
        node = doc["nodes"][0]
        assert node["last_error"] == error and node["suspect_ranks"] == [1]
        assert doc["summary"]["ranks_suspect"] == 1
        ok, bad = node["workers"]
        assert ok["health"] == "ok" and ok["cause"] is None and ok["progress_age_s"] is None
        assert bad["cause"] == "stopped" and bad["step"] == 7

        for columns in (None, "80", "60"):
            if columns is None:
                monkeypatch.delenv("COLUMNS", raising=False)
            else:
                monkeypatch.setenv("COLUMNS", columns)
            code = run_status(JOB, endpoint=None, json_out=False, watch=False, no_headers=False,
                              state_dir=None, timeout_s=3)
            lines = capsys.readouterr().out.splitlines()
            assert code == exit_codes.DEGRADED
            # Header, the node's one row, then the summary and the suspect line.
            assert lines[0].startswith("no") and lines[1].startswith("0 "), lines
            assert "suspect (1)" in lines[1] or columns == "60", lines
            assert lines[2].startswith(f"job {JOB}: degraded"), lines
            assert any(ln.startswith("suspect: rank 1 (node 0, host-a, pid 1001): stopped")
                       for ln in lines[2:]), lines
            if columns is None:
                assert "rank 1 exited with code 13: Traceback" in lines[1]
                assert lines[1].rstrip().endswith("…") and len(lines[1]) <= 200
                assert "1 running" not in lines[2] and "2 running, 1 suspect" in lines[2]
            else:
                assert all(len(ln) <= int(columns) for ln in lines[:2]), lines
    finally:
        reporter.stop("succeeded", 0)


def test_run_status_wrong_secret(state_dir: Path, make_coordinator: Callable[..., Coordinator],
                                 capsys: pytest.CaptureFixture[str]) -> None:
    jobs.load_secret(JOB, create=True)
    c = make_coordinator()  # runs with a different secret
    write_job(JOB, c.endpoint)
    code = run_status(JOB, endpoint=None, json_out=True, watch=False, no_headers=False,
                      state_dir=None, timeout_s=3)
    err = capsys.readouterr().err
    assert code == exit_codes.AUTH
    assert "refused our secret" in err and len(err.strip().splitlines()) == 1


def test_run_status_unknown_job(state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = run_status("nope", endpoint=None, json_out=False, watch=False, no_headers=False,
                      state_dir=None)
    captured = capsys.readouterr()
    assert code == exit_codes.NOT_FOUND
    assert "no job 'nope'" in captured.err and "Traceback" not in captured.err
    assert captured.out == ""


def test_run_status_unreachable(state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    jobs.load_secret(JOB, create=True)
    write_job(JOB, f"127.0.0.1:{free_port()}")
    started = time.monotonic()
    code = run_status(JOB, endpoint=None, json_out=False, watch=False, no_headers=False,
                      state_dir=None, timeout_s=0.3)
    assert time.monotonic() - started < 3
    err = capsys.readouterr().err
    assert code == exit_codes.UNREACHABLE
    assert "did not answer within 0.3 s" in err and len(err.strip().splitlines()) == 1


def test_run_status_lists_jobs(state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_status(None, endpoint=None, json_out=True, watch=False, no_headers=False,
                      state_dir=None) == exit_codes.OK
    assert json.loads(capsys.readouterr().out) == {"version": 1, "jobs": []}
    write_job("job-a", "127.0.0.1:1")
    jobs.write_job_file(jobs.JobFile(run_id="job-b", endpoint="h:2", host="elsewhere", pid=1,
                                     started_at=time.time() + 1))
    assert run_status(None, endpoint=None, json_out=True, watch=False, no_headers=False,
                      state_dir=None) == exit_codes.OK
    listed = json.loads(capsys.readouterr().out)["jobs"]
    assert [j["run_id"] for j in listed] == ["job-b", "job-a"]
    assert listed[0]["live"] is None and listed[1]["live"] is True
    assert run_status(None, endpoint=None, json_out=False, watch=False, no_headers=False,
                      state_dir=None) == exit_codes.OK
    out = capsys.readouterr().out
    assert "job-a" in out and "run id" in out


# -- the standalone coordinator (imports torch, in a subprocess) -------------------------------


@pytest.mark.timeout(120)
def test_run_standalone(state_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO);"
        "from ftrun.coordinator.server import run_standalone;"
        f"sys.exit(run_standalone('sa-job', '127.0.0.1:{port}', state_dir=None, "
        "node_timeout_s=5.0, bind_host='127.0.0.1'))"
    )
    log_file = (tmp_path / "standalone.log").open("w")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=dict(os.environ),
                            stderr=log_file)
    try:
        job_file = state_dir / "jobs" / "sa-job" / "job.json"
        wait_for(job_file.exists, timeout_s=60, what="the standalone coordinator's job file")
        job = jobs.read_job_file("sa-job")
        assert job.rdzv_endpoint == f"127.0.0.1:{port}" and job.pid == proc.pid
        secret = jobs.load_secret("sa-job", create=False)
        reply = request(job.endpoint, secret, "sa-job", "status_request", {}, timeout_s=5)
        assert reply.body["doc"]["run_id"] == "sa-job"

        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        assert lookup_endpoint(store, timeout_s=5) == job.endpoint
        del store
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        log_file.close()


def test_stop_is_prompt(make_coordinator: Callable[..., Coordinator]) -> None:
    c = make_coordinator()
    started = time.monotonic()
    c.stop(timeout_s=2)
    assert time.monotonic() - started < 1


def test_serve_forever_in_foreground() -> None:
    c = Coordinator(JOB, SECRET, bind_host="127.0.0.1")
    stop = threading.Event()
    endpoint = c.bind()
    t = threading.Thread(target=c.serve_forever, args=(stop,), daemon=True)
    t.start()
    try:
        doc = request(endpoint, SECRET, JOB, "status_request", {}, timeout_s=3).body["doc"]
        assert doc["health"] == "starting"
    finally:
        stop.set()
        t.join(3)
    assert not t.is_alive()


def test_invalid_state_still_heartbeats(coordinator: Coordinator) -> None:
    def bad_state() -> dict[str, Any]:
        return {**workers_state(restarts=2), "workers": [{"rank": "zero"}], "bogus": 1}

    reporter = NodeReporter(coordinator.endpoint, SECRET, JOB, "host-d/4", "host-d", bad_state,
                            interval_s=0.05)
    reporter.start()
    try:
        node = wait_for(lambda: [n for n in coordinator.status_document()["nodes"]
                                 if n["last_error"]], what="fallback heartbeat")[0]
    finally:
        reporter.stop("stopped", 0, timeout_s=2)
    assert node["last_error"].startswith("invalid heartbeat:")
    assert node["state"] == "healthy" and node["restarts"] == 2 and node["workers"] == []


# -- directives -------------------------------------------------------------------------------


class LossyLink:
    """A forwarder between one client and the coordinator that drops chosen replies.

    The client connects to ``endpoint``; each of its messages goes on to the coordinator over
    a DEALER socket, and each reply comes back unless ``drop(kind)`` says to lose it (the
    dropped kinds are counted in ``dropped``). Messages pass unchanged: the signatures hold.
    """

    def __init__(self, target: str, drop: Callable[[str], bool]) -> None:
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._front = self._ctx.socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        self._served = handshake.serve(self._front, SECRET, "lossy link")
        port = self._front.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"127.0.0.1:{port}"
        self._back = self._ctx.socket(zmq.DEALER)
        self._back.setsockopt(zmq.LINGER, 0)
        handshake.join(self._back, SECRET)
        self._back.connect(f"tcp://{target}")
        self._drop = drop
        self.dropped: list[str] = []
        self.forwarded: list[str] = []
        self._identity: bytes | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        poller.register(self._back, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                frames = sock.recv_multipart()
                if sock is self._front:
                    self._identity = frames[0]
                    self._back.send_multipart(frames[1:])
                    continue
                kind = json.loads(frames[0])["kind"]
                if self._drop(kind):
                    self.dropped.append(kind)
                elif self._identity is not None:
                    self.forwarded.append(kind)
                    self._front.send_multipart([self._identity, *frames])
        self._front.close(0)
        self._back.close(0)
        self._served.release()
        self._ctx.term()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def test_directive_survives_a_lost_reply_and_is_delivered_once(
        coordinator: Coordinator) -> None:
    lost: list[str] = []

    def drop_first_directives(kind: str) -> bool:
        if kind == "directives" and not lost:
            lost.append(kind)
            return True
        return False

    link = LossyLink(coordinator.endpoint, drop_first_directives)
    got: list[dict[str, Any]] = []
    reporter = NodeReporter(link.endpoint, SECRET, JOB, "host-a/1", "host-a", workers_state,
                            interval_s=0.05, on_directive=got.append)
    reporter.start()
    try:
        wait_for(lambda: coordinator.status_document()["nodes"], what="the node to join")
        did = coordinator.direct("host-a/1", "restart", {"ranks": [1], "reason": "test"})
        wait_for(lambda: any(e["type"] == "directive_acked" for e in coordinator.events()),
                 what="the directive to be acked")
        # Heartbeats go on: later replies never carry it again, nor deliver it twice.
        sent = reporter.sent["heartbeat"]
        wait_for(lambda: reporter.sent["heartbeat"] >= sent + 5, what="more heartbeats")
    finally:
        reporter.stop("succeeded", 0)
        link.close()
    assert lost == ["directives"], "the fault (a lost directives reply) did not fire"
    assert got == [{"id": did, "action": "restart", "data": {"ranks": [1], "reason": "test"}}]
    assert reporter.directives == 1
    events = [e for e in coordinator.events() if e["type"].startswith("directive")]
    assert [e["type"] for e in events] == ["directive", "directive_acked"]
    assert events[0]["id"] == did and events[0]["action"] == "restart"
    assert events[1]["id"] == did and events[1]["sent"] >= 2  # resent after the lost reply
    assert coordinator.pending_directives() == []


def test_a_directive_seen_before_a_start_over_does_not_run_again() -> None:
    """A start-over (the coordinator's term learned, a failover, a retarget) stops acking the
    directives seen so far but remembers them: the same directive sent again is acked again
    and not run a second time."""
    from collections import deque

    got: list[dict[str, Any]] = []
    reporter = NodeReporter("127.0.0.1:9", SECRET, JOB, "host-c/1", "host-c", workers_state,
                            interval_s=0.05, on_directive=got.append)
    d = {"id": "abc123", "action": "probe", "data": {"peers": [], "size": 1}}
    reporter._directive(d)
    assert reporter._acked() == ["abc123"]
    reporter._start_over(deque())
    assert reporter._acked() == []  # not acked to a new coordinator
    reporter._directive(dict(d))  # the same coordinator sends it again: acked, not run
    assert [x["id"] for x in got] == ["abc123"] and reporter.directives == 1
    assert reporter._acked() == ["abc123"]


def test_directive_resent_until_acked_is_delivered_once(coordinator: Coordinator) -> None:
    """Acks lost on the way (every heartbeat's reply carries the directive again until the
    coordinator reads an ack): the launcher still runs it once."""
    link = LossyLink(coordinator.endpoint, lambda kind: False)
    got: list[dict[str, Any]] = []
    reporter = NodeReporter(link.endpoint, SECRET, JOB, "host-b/1", "host-b", workers_state,
                            interval_s=0.05, on_directive=got.append)
    reporter.start()
    try:
        wait_for(lambda: coordinator.status_document()["nodes"], what="the node to join")
        ids = [coordinator.direct("host-b/1", "probe", {"peers": [], "size": 1024}),
               coordinator.direct("host-b/1", "isolate", {"reason": "r", "evidence": {}})]
        wait_for(lambda: len([e for e in coordinator.events()
                              if e["type"] == "directive_acked"]) == 2, what="two acks")
    finally:
        reporter.stop("succeeded", 0)
        link.close()
    assert [d["id"] for d in got] == ids and reporter.directives == 2
    assert link.forwarded.count("directives") >= 1


def test_directive_refused_for_unknown_node_or_action(coordinator: Coordinator) -> None:
    with pytest.raises(FtrunError, match="unknown"):
        coordinator.direct("nobody/1", "restart", {"ranks": [0], "reason": "x"})
    reporter = NodeReporter(coordinator.endpoint, SECRET, JOB, "host-c/1", "host-c",
                            workers_state, interval_s=0.05)
    reporter.start()
    try:
        wait_for(lambda: coordinator.status_document()["nodes"], what="the node to join")
        with pytest.raises(FtrunError, match="unknown directive action"):
            coordinator.direct("host-c/1", "reboot", {})
        with pytest.raises(FtrunError, match="cannot be sent"):
            coordinator.direct("host-c/1", "restart", {"ranks": [float("nan")]})
    finally:
        reporter.stop("succeeded", 0)


def test_directives_dropped_when_the_node_leaves(coordinator: Coordinator) -> None:
    reporter = NodeReporter(coordinator.endpoint, SECRET, JOB, "host-d/1", "host-d",
                            workers_state, interval_s=60)  # one heartbeat: none acks
    reporter.start()
    try:
        wait_for(lambda: coordinator.status_document()["nodes"], what="the node to join")
        did = coordinator.direct("host-d/1", "restart", {"ranks": [0], "reason": "x"})
        assert [d["id"] for d in coordinator.pending_directives()] == [did]
    finally:
        reporter.stop("succeeded", 0)
    wait_for(lambda: not coordinator.pending_directives(), what="the directive to be dropped")
    dropped = [e for e in coordinator.events() if e["type"] == "directive_dropped"]
    assert dropped and dropped[0]["id"] == did and dropped[0]["why"] == "node left"


def test_keepalives_keep_the_workers_and_a_stale_one_asks_for_a_full_heartbeat(
        coordinator: Coordinator) -> None:
    from ftrun.coordinator.client import HeartbeatComposer
    from ftrun.coordinator.directives import REPORT_ACTION

    composer = HeartbeatComposer("host-k/1", "host-k", 1)
    client = transport.Client(coordinator.endpoint, SECRET, JOB, "host-k/1", resend_stale=True)
    try:
        kind, body = composer.compose(workers_state(), 0.0)
        assert kind == "heartbeat" and body["serial"] == 1
        client.send(kind, body)
        kind, body = composer.compose({**workers_state(), "last_error": None}, 1.0)
        assert kind == "keepalive" and body == {"node_id": "host-k/1", "same": 1}
        client.send(kind, body)
        # Both were signed for no term: the coordinator's refusals name its incarnation, and
        # the client (resend_stale, as the coordinator's clients are) sends them again.
        client.poll(1.0)
        wait_for(lambda: coordinator.status_document()["nodes"], what="the node")
        node = coordinator.status_document()["nodes"][0]
        assert node["ranks"] == [0, 1] and not node["workers_stale"]
        # A changed state makes the next heartbeat full.
        kind, _ = composer.compose({**workers_state(), "state": "restarting"}, 2.0)
        assert kind == "heartbeat"
        # A keep-alive naming a full heartbeat this coordinator never read is answered with
        # a request for a full one.
        reply = client.request("keepalive", {"node_id": "host-k/1", "same": 99}, "directives",
                               3.0)
        assert [d["action"] for d in reply.body["directives"]] == [REPORT_ACTION]
        assert coordinator.status_document()["nodes"][0]["workers_stale"] is True
    finally:
        client.close()


def test_a_message_captured_before_a_restart_is_refused_after_it(
        make_coordinator: Callable[..., Coordinator], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """A coordinator without failover (standalone, or hosted by the c10d store's launcher)
    signs for an incarnation of its own, new at each start. A heartbeat captured on the wire
    (here: one saying the node failed) is taken once by the coordinator it was sent to, and
    refused by the next one on the same endpoint (stale term, logged with the peer); a
    launcher's reporter that ran through the restart follows the new incarnation, and the
    event it queued while the coordinator was down is delivered, not lost."""
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    first = make_coordinator(port=port)
    reporter = NodeReporter(endpoint, SECRET, JOB, "host-r/1", "host-r", workers_state,
                            interval_s=0.05)
    reporter.start()
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    handshake.join(raw, SECRET)
    raw.connect(f"tcp://{endpoint}")
    try:
        wait_for(lambda: first.status_document()["nodes"], what="the reporter's node")
        captured = [bytes(f) for f in protocol.encode(
            "heartbeat", {**workers_state(), "state": "failed", "node_id": "host-x/9",
                          "host": "host-x", "pid": 9, "last_error": "captured"},
            secret=SECRET, job=JOB, sender="launcher:host-x/9", term=first.incarnation)]
        raw.send_multipart(captured)
        wait_for(lambda: any(n["node_id"] == "host-x/9" for n in
                             first.status_document()["nodes"]), what="the original taken")
        first.stop(timeout_s=2)
        reporter.event("while_down", note="queued while the coordinator was down")
        from ftrun.coordinator.detect import DetectConfig

        second = make_coordinator(port=port, events_file=tmp_path / "events2.jsonl",
                                  detection=DetectConfig())
        assert second.incarnation != first.incarnation
        # Its detection service signs for the same incarnation (tests/test_detect_service.py).
        assert second._detection._service.server.term == second.incarnation
        with caplog.at_level(logging.WARNING, logger=transport.__name__):
            raw.send_multipart(captured)
            wait_for(lambda: second.counters["stale_terms"] >= 1, what="the replay refused")
            wait_for(lambda: [n for n in second.status_document()["nodes"]
                              if n["node_id"] == "host-r/1" and n["workers"]],
                     timeout_s=10, what="the reporter's node on the restarted coordinator")
            wait_for(lambda: "while_down" in (tmp_path / "events2.jsonl").read_text(),
                     timeout_s=10, what="the event queued while it was down")
        assert not [n for n in second.status_document()["nodes"] if n["node_id"] == "host-x/9"]
        refused = [r.getMessage() for r in caplog.records if "stale term" in r.getMessage()]
        assert refused and "signed for coordinator term" in refused[0] \
            and "127.0.0.1" in refused[0], refused
    finally:
        raw.close(0)
        reporter.stop("stopped", 1, timeout_s=2)
