"""The real ``ftrun`` command with real processes: two launchers on localhost act as two
nodes of two ranks each. Every fault test asserts that the fault fired, what the launcher
did about it, and that the final weights equal the fault-free run's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import ROOT, TRAIN, Procs, free_port, pid_alive, read_events, result_line, wait_for

from ftrun.testing.procs import request_launcher_stacks

# These tests check exact steps (resumed from, persisted): no snapshot may be skipped.
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("exact_steps")]

STEPS = "6"


def two_nodes(procs: Procs, run_id: str, port: int, *extra: str, nnodes: str = "2",
              train_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
              steps: str = STEPS) -> list[subprocess.Popen[str]]:
    common = [
        "--nnodes", nnodes, "--nproc-per-node", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, *extra,
        TRAIN, "--steps", steps, *train_args,
    ]
    return [procs.ftrun(*common, env=env, name=f"node{i}") for i in range(2)]


@pytest.fixture(scope="module")
def baseline_hash(tmp_path_factory: pytest.TempPathFactory) -> str:
    """params_xxh3 of the fault-free two-node run."""
    tmp = tmp_path_factory.mktemp("baseline")
    procs = Procs(tmp)
    env = {"FTRUN_STATE_DIR": str(tmp / "state")}
    try:
        nodes = two_nodes(procs, "baseline", free_port(), env=env)
        for node in nodes:
            assert procs.wait(node, 150) == 0, procs.output(node)[-3000:]
        outputs = "".join(procs.output(n) for n in nodes)
        return result_line(outputs).split("params_xxh3=")[1].strip()
    finally:
        procs.cleanup()


def _job_result(procs: Procs, nodes: list[subprocess.Popen[str]], timeout_s: float) -> str:
    for node in nodes:
        code = procs.wait(node, timeout_s)
        assert code == 0, f"exit {code}:\n{procs.output(node)[-4000:]}"
    return result_line("".join(procs.output(n) for n in nodes)).split("params_xxh3=")[1].strip()


def _fault_marker(state_dir: Path, run_id: str, rank: int, step: int) -> dict:
    marker = state_dir / "jobs" / run_id / f"fault-fired-rank{rank}-step{step}"
    assert marker.exists(), f"the fault never fired: {marker} is missing"
    return json.loads(marker.read_text())


def test_killed_worker_restarts_and_matches_fault_free(procs: Procs, state_dir: Path, tmp_path: Path,
                                                        baseline_hash: str) -> None:
    run_id = f"kill-{uuid.uuid4().hex[:8]}"
    result = tmp_path / "result.json"
    # Replication off: with it, a store keeps the newest durable step and a rank may skip
    # step 2's snapshot until step 1 is durable (tests/test_replica_integ.py covers that).
    nodes = two_nodes(procs, run_id, free_port(), "--max-restarts", "2", "--replicas", "1",
                      train_args=("--fail-at-step", "3", "--fail-rank", "1", "--fail-mode", "kill",
                                  "--snapshot-every", "1", "--result", str(result)))
    assert _job_result(procs, nodes, 200) == baseline_hash
    # Both nodes resumed from their in-memory snapshots of the last completed step: step 2,
    # or step 1 when step 2's copy was still in flight as rank 1 died in step 3 (CI, loaded).
    resumed = json.loads(result.read_text())["resumed_from"]
    assert resumed in ([2], [1]), resumed
    outputs = "".join(procs.output(n) for n in nodes)
    for rank in (0, 1):
        assert f"rank {rank} resumed from step {resumed[0]} " in outputs
    assert "from memory" in outputs and "from disk" not in outputs
    fired = _fault_marker(state_dir, run_id, 1, 3)
    events = read_events(state_dir, run_id)
    failures = [e for e in events if e["type"] == "worker_failure" and e["rank"] == 1]
    assert failures and failures[0]["signal"] == "SIGKILL" and failures[0]["pid"] == fired["pid"]
    assert any(e["type"] == "restart" for e in events)


def test_stopped_worker_is_killed_promptly(procs: Procs, state_dir: Path, baseline_hash: str) -> None:
    # The process-group timeout is far longer than the test's budget: only the launcher's
    # own detection can bring this job back in time.
    run_id = f"stop-{uuid.uuid4().hex[:8]}"
    nodes = two_nodes(procs, run_id, free_port(), "--max-restarts", "2", "--hang-timeout", "3",
                      train_args=("--fail-at-step", "3", "--fail-rank", "2", "--fail-mode", "stop",
                                  "--pg-timeout", "900"))
    assert _job_result(procs, nodes, 200) == baseline_hash
    fired = _fault_marker(state_dir, run_id, 2, 3)
    events = read_events(state_dir, run_id)
    hangs = [e for e in events if e["type"] == "hang_detected"]
    assert hangs and hangs[0]["pid"] == fired["pid"] and "stopped" in hangs[0]["reason"]
    assert not pid_alive(fired["pid"])


def _load_demo():
    spec = importlib.util.spec_from_file_location("ftrun_demo", ROOT / "examples" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_stopped_rank_is_suspect_in_status_at_once(procs: Procs, state_dir: Path, tmp_path: Path,
                                                   baseline_hash: str) -> None:
    """A SIGSTOPped rank reads suspect and the job degraded long before ftrun kills it."""
    run_id = f"suspect-{uuid.uuid4().hex[:8]}"
    ckpt = tmp_path / "ckpt"
    # --hang-timeout 60: a stopped rank is killed after 20 s; it must show as suspect first.
    # --on-hang warn: the coordinator names a rank that stopped reporting while the others wait
    # within ~3 s, and would restart it before the first status command (a subprocess: 3-7 s
    # on a loaded 2-CPU machine) could see it suspect (CI, 2026-11-29).
    nodes = two_nodes(procs, run_id, free_port(), "--max-restarts", "2", "--hang-timeout", "60",
                      "--on-hang", "warn", "--persist-dir", str(ckpt),
                      train_args=("--fail-at-step", "3", "--fail-rank", "2", "--fail-mode", "stop",
                                  "--pg-timeout", "900"))
    status_cmd = [sys.executable, "-m", "ftrun", "status", run_id]

    def suspect_seen() -> tuple[int, dict] | None:
        out = subprocess.run([*status_cmd, "--json"], capture_output=True, text=True, timeout=60,
                             cwd=ROOT)
        if out.returncode not in (0, 3):
            return None
        doc = json.loads(out.stdout)
        suspects = [w for n in doc["nodes"] for w in n["workers"] if w["health"] == "suspect"]
        return (out.returncode, doc) if any(w["rank"] == 2 for w in suspects) else None

    code, doc = wait_for(suspect_seen, 150, "status to show rank 2 suspect", interval_s=0.2)
    fired = _fault_marker(state_dir, run_id, 2, 3)
    assert code == 3 and doc["health"] == "degraded", doc
    node = next(n for n in doc["nodes"] if 2 in n["ranks"])
    worker = next(w for w in node["workers"] if w["rank"] == 2)
    assert worker["pid"] == fired["pid"] and worker["cause"] == "stopped", worker
    assert "stopped" in worker["reason"] and worker["state"] == "running"
    assert 2 in node["suspect_ranks"] and doc["summary"]["ranks_suspect"] >= 1
    # The table, piped (no terminal): the node reads suspect, the job degraded, one line each.
    table = subprocess.run(status_cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    if table.returncode == 3:  # unless ftrun killed it already (a very slow machine)
        lines = table.stdout.splitlines()
        row = next(ln for ln in lines if ln.split()[:1] == [str(node["group_rank"])])
        assert "suspect (2" in row, table.stdout
        assert any(ln.startswith(f"job {run_id}: degraded") for ln in lines), table.stdout
        assert any(ln.startswith("suspect: rank 2 ") for ln in lines), table.stdout
    try:
        os.kill(fired["pid"], signal.SIGCONT)
    except ProcessLookupError:
        pass
    assert _job_result(procs, nodes, 200) == baseline_hash
    events = read_events(state_dir, run_id)
    mine = [e for e in events if e.get("pid") == fired["pid"]]
    assert any(e["type"] == "rank_suspect" and e["cause"] == "stopped" and e["rank"] == 2
               for e in mine), mine
    # Continued in time it recovers; otherwise its launcher killed it at 20 s and restarted
    # (the coordinator only warns here).
    assert any(e["type"] == "rank_cleared" for e in mine) or any(
        e["type"] == "hang_detected" and "stopped" in e["reason"] for e in mine), mine

    # Every command the demo prints at its end works on such an ended job.
    demo = _load_demo()
    hints = demo.hints(state_dir, run_id, ckpt)
    text = demo.format_hints(state_dir, hints)
    assert all(h.line() in text for h in hints)
    for hint in hints:
        out = subprocess.run(hint.argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert out.returncode == 0, (hint.line(), out.stdout[-2000:], out.stderr[-2000:])
        if hint.argv[:1] == ["grep"]:
            assert '"type":"job_end"' in out.stdout
        elif "status" in hint.argv:
            assert run_id in out.stdout
        elif "inspect" in hint.argv:
            assert "step" in out.stdout.lower()
    assert not state_dir.exists()  # the last hint removed the demo's files


def test_live_job_status_secret_signals_and_lost_launcher(procs: Procs, state_dir: Path, tmp_path: Path) -> None:
    run_id = f"live-{uuid.uuid4().hex[:8]}"
    result = tmp_path / "result.json"
    # Enough steps for the job to outlive the checks below.
    nodes = two_nodes(procs, run_id, free_port(), "--max-restarts", "3", nnodes="1:2", steps="40",
                      train_args=("--step-sleep", "0.5", "--result", str(result)))
    status_cmd = [sys.executable, "-m", "ftrun", "status", run_id]

    def status_json() -> dict | None:
        out = subprocess.run([*status_cmd, "--json"], capture_output=True, text=True, timeout=60, cwd=ROOT)
        if out.returncode not in (0, 3):
            return None
        doc = json.loads(out.stdout)
        running = [w for n in doc["nodes"] for w in n["workers"] if w["state"] == "running" and w["pid"]]
        committed = (doc.get("snapshots") or {}).get("committed_step")
        return doc if len(doc["nodes"]) == 2 and len(running) == 4 and committed else None

    doc = wait_for(status_json, 120, "status to show 2 nodes, 4 running ranks, a commit",
                   interval_s=1)
    assert doc["version"] == 1 and doc["summary"]["ranks"] == 4
    assert len(doc["snapshots"]["stores"]) == 2
    assert sorted(r for n in doc["nodes"] for r in n["ranks"]) == [0, 1, 2, 3]

    table = subprocess.run(status_cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert table.returncode == 0 and run_id in table.stdout and "committed step" in table.stdout

    wrong = subprocess.run(status_cmd, capture_output=True, text=True, timeout=60, cwd=ROOT,
                           env={**os.environ, "FTRUN_SECRET": "not-the-job-secret-at-all"})
    assert wrong.returncode == 6, wrong.stderr
    assert "secret" in wrong.stderr and "Traceback" not in wrong.stderr
    events = read_events(state_dir, run_id)
    assert any(e["type"] == "auth_failure" for e in events)

    # SIGUSR1 (Slurm's time-limit warning) reaches the workers and does not stop them.
    host_pid = json.loads((state_dir / "jobs" / run_id / "job.json").read_text())["pid"]
    host_node = next(n for n in nodes if n.pid == host_pid)
    other = next(n for n in nodes if n is not host_node)
    os.kill(other.pid, signal.SIGUSR1)
    wait_for(lambda: "received SIGUSR1" in procs.output(other), 30, "the workers to report SIGUSR1")
    # SIGRTMIN+5 makes a launcher print its threads' stacks, and only that.
    assert request_launcher_stacks(host_node.pid)
    wait_for(lambda: "ftrun/launcher/agent.py" in procs.output(host_node).partition(
        "most recent call first")[2], 30, "the launcher's stacks")
    assert host_node.poll() is None

    # kill -9 the non-host launcher: its workers must die with it, and the survivor,
    # allowed to run alone by --nnodes 1:2, finishes the job.
    victim_node = next(e["node"] for e in read_events(state_dir, run_id)
                       if e["type"] == "node_joined" and e["node"].endswith(f"/{other.pid}"))
    victim_pids = {pid for e in read_events(state_dir, run_id)
                   if e["type"] == "workers_started" and e["node"] == victim_node
                   for pid in e["pids"].values()}
    assert len(victim_pids) >= 2
    other.kill()
    other.wait(timeout=30)
    wait_for(lambda: not any(pid_alive(p) for p in victim_pids), 15, "the dead launcher's workers to exit")
    assert procs.wait(host_node, 240) == 0, procs.output(host_node)[-4000:]
    assert json.loads(result.read_text())["world_size"] == 2
    events = read_events(state_dir, run_id)
    assert any(e["type"] == "node_lost" and e["node"] == victim_node for e in events) or any(
        e["type"] == "rendezvous" and e["group_world_size"] == 1 for e in events)


EXIT_THEN_LOSE_HOST = """\
import json, os, signal
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
host = json.loads(open(os.environ["JOB_JSON"]).read())["pid"]  # the store's launcher
launcher = int(os.environ["FTRUN_LAUNCHER_PID"])
mine = torch.tensor([launcher, int(launcher == host)])
every = [torch.zeros(2, dtype=torch.long) for _ in range(dist.get_world_size())]
dist.all_gather(every, mine)
dist.destroy_process_group()
# The training is done everywhere. The highest rank not on the store's launcher takes its
# own launcher down before that launcher reaches the exit barrier.
victim = max(r for r, t in enumerate(every) if not t[1])
if int(os.environ["RANK"]) == victim:
    open(os.environ["VICTIM_FILE"], "w").write(str(launcher))
    os.kill(launcher, signal.SIGKILL)
"""


def test_a_node_lost_after_its_workers_finished_is_not_waited_for_at_exit(
        procs: Procs, state_dir: Path, tmp_path: Path) -> None:
    """3 launchers, one rank each; every rank finishes, then one launcher is SIGKILLed before
    it reaches the exit barrier. The coordinator declares it lost, the survivors drop it from
    the rendezvous and leave the exit barrier without it (torch's barrier waits 300 s for it)
    and exit 0."""
    run_id = f"exitlost-{uuid.uuid4().hex[:8]}"
    script = tmp_path / "exit_then_lose_host.py"
    script.write_text(EXIT_THEN_LOSE_HOST)
    victim_file = tmp_path / "victim"
    env = {"JOB_JSON": str(state_dir / "jobs" / run_id / "job.json"),
           "VICTIM_FILE": str(victim_file)}
    port = free_port()
    nodes = [procs.ftrun("--nnodes", "3", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
                         "--node-timeout", "6", str(script), env=env, name=f"node{i}")
             for i in range(3)]
    wait_for(victim_file.exists, 120, "the victim rank to kill its launcher")
    victim_pid = int(victim_file.read_text())
    [victim] = [n for n in nodes if n.pid == victim_pid]
    survivors = [n for n in nodes if n is not victim]
    victim.wait(timeout=30)
    assert victim.returncode == -signal.SIGKILL
    for node in survivors:  # well within torch's 300 s exit barrier
        assert procs.wait(node, 150) == 0, procs.output(node)[-4000:]
    events = read_events(state_dir, run_id)
    victim_node = next(e["node"] for e in events
                       if e["type"] == "node_joined" and e["node"].endswith(f"/{victim_pid}"))
    assert any(e["type"] == "node_lost" and e["node"] == victim_node for e in events), events
    left = [e for e in events if e["type"] == "exit_barrier_left"]
    # (Both survivors usually say so; one that learns of the loss after the store's launcher
    # left finds the store gone and exits too.)
    assert left and all(len(e["lost"]) == 1 and e["lost"][0].endswith(f"_{victim_pid}_0")
                        and e["finished"] == 2 for e in left), left  # its rdzv name
    assert "which the coordinator declared lost: not waiting for it" in \
        "".join(procs.output(n) for n in survivors)


def test_sigterm_stops_the_job_gracefully_and_persists(procs: Procs, state_dir: Path,
                                                      tmp_path: Path) -> None:
    from ftrun import jobs
    from ftrun.coordinator.client import request
    from ftrun.snapshot import persist

    ckpt = tmp_path / "ckpt"
    run_id = f"term-{uuid.uuid4().hex[:8]}"
    job = procs.ftrun("--standalone", "--rdzv-id", run_id, "--nproc-per-node", "2",
                      "--persist-dir", str(ckpt), TRAIN, "--steps", "1000", "--step-sleep", "0.2")
    wait_for(lambda: (state_dir / "jobs" / run_id / "job.json").exists(), 90, "the job file")
    endpoint = jobs.read_job_file(run_id).endpoint
    secret = jobs.load_secret(run_id, create=False)

    def committed() -> int | None:
        doc = request(endpoint, secret, run_id, "status_request", {}, timeout_s=5).body["doc"]
        step = (doc.get("snapshots") or {}).get("committed_step")
        return step if step and step >= 2 else None

    wait_for(committed, 120, "a committed snapshot", interval_s=0.2)
    pids = [p for e in read_events(state_dir, run_id) if e["type"] == "workers_started"
            for p in e["pids"].values()]
    job.send_signal(signal.SIGTERM)
    code = procs.wait(job, 120)
    assert code == 128 + signal.SIGTERM, procs.output(job)[-3000:]
    assert not any(pid_alive(p) for p in pids)
    # The store wrote the newest committed snapshot on its way out, and removed its segments.
    done = persist.latest_complete(ckpt)
    assert done is not None and done[0] >= 2 and done[1] == 2
    from ftrun.snapshot import segment as shm

    assert not shm.list_segments(shm.job_prefix(run_id))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--standalone", "no/such/script.py"], "training script 'no/such/script.py' not found"),
        (["--no-such-flag", "x.py"], "unrecognized arguments: --no-such-flag"),
        (["--hang-timeout", "-2", TRAIN], "--hang-timeout must be >= 0"),
    ],
)
def test_bad_input_is_one_clear_line(procs: Procs, state_dir: Path, argv: list[str], message: str) -> None:
    proc = procs.ftrun(*argv)
    assert procs.wait(proc, 60) == 2
    out = procs.output(proc)
    assert message in out and "Traceback" not in out


def test_launchers_given_coordinator_detect_a_collective_hang(procs: Procs, state_dir: Path,
                                                              baseline_hash: str) -> None:
    """Launchers given ``--coordinator HOST:PORT`` read nothing from the rendezvous store:
    the coordinator's answer to their hello says where the ranks report their collectives.
    Rank 1 enters a collective nobody else enters; the coordinator names it, its launcher
    kills it on the coordinator's order, and the job ends as the fault-free run does.
    The launchers' own ``--on-hang warn`` does not apply (the coordinator's ``restart``
    does), and each launcher says so."""
    run_id = f"given-{uuid.uuid4().hex[:8]}"
    port = free_port()
    coord = procs.ftrun("coordinator", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
                        name="coordinator")
    job_file = state_dir / "jobs" / run_id / "job.json"
    wait_for(job_file.exists, 60, "the coordinator's job file")
    endpoint = json.loads(job_file.read_text())["endpoint"]
    nodes = two_nodes(procs, run_id, port, "--max-restarts", "2", "--coordinator", endpoint,
                      "--rdzv-conf", "is_host=0", "--on-hang", "warn",
                      train_args=("--fail-at-step", "3", "--fail-rank", "1",
                                  "--fail-mode", "collective-hang", "--pg-timeout", "900"))
    assert _job_result(procs, nodes, 200) == baseline_hash
    _fault_marker(state_dir, run_id, 1, 3)
    events = read_events(state_dir, run_id)
    hangs = [e for e in events if e["type"] == "detection" and e["kind"] == "hang"]
    assert hangs and hangs[0]["ranks"] == [1] and hangs[0]["action"] == "restart", hangs
    assert any(e["type"] == "directive_acked" and e.get("action") == "restart" for e in events)
    for node in nodes:
        assert procs.output(node).count("--on-hang warn here, restart at the coordinator") == 1
    mismatches = [e for e in events if e["type"] == "policy_mismatch"]
    assert len(mismatches) == 2 and all(
        (e["on_hang"], e["coordinator_on_hang"]) == ("warn", "restart") for e in mismatches)
    coord.send_signal(signal.SIGTERM)
    assert procs.wait(coord, 30) == 0


def test_standalone_coordinator_outlives_any_launcher(procs: Procs, state_dir: Path,
                                                      tmp_path: Path) -> None:
    """With `ftrun coordinator` holding the rendezvous store, no launcher is special."""
    run_id = f"coord-{uuid.uuid4().hex[:8]}"
    port = free_port()
    result = tmp_path / "result.json"
    coord = procs.ftrun("coordinator", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
                        name="coordinator")
    wait_for(lambda: (state_dir / "jobs" / run_id / "job.json").exists(), 60, "the coordinator")
    nodes = two_nodes(procs, run_id, port, "--max-restarts", "3", nnodes="1:2", steps="30",
                      train_args=("--step-sleep", "0.3", "--result", str(result)))

    def started_on_both() -> bool:
        ranks: dict[str, set[int]] = {}
        for e in read_events(state_dir, run_id):
            if e["type"] == "workers_started":
                ranks[e["node"]] = set(e["ranks"])
        return len(ranks) == 2 and set().union(*ranks.values()) == {0, 1, 2, 3}

    wait_for(started_on_both, 120, "workers on both nodes")
    first = nodes[0]
    first.kill()  # kill -9 whichever launcher started first: the job goes on
    first.wait(timeout=30)
    assert procs.wait(nodes[1], 240) == 0, procs.output(nodes[1])[-4000:]
    assert json.loads(result.read_text())["world_size"] == 2
    coord.send_signal(signal.SIGTERM)
    assert procs.wait(coord, 30) == 0
