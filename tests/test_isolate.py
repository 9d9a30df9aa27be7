"""Isolating a host: the launcher's flags, and the real launcher carrying out ``isolate``.

The integration tests run real ``ftrun`` launchers (two nodes of two ranks on localhost, each
with its own shared-memory directory). The node to isolate runs the real launcher through a
small driver that delivers the directive to the launcher's directive entry point
(``AgentContext.on_directive``, which the node reporter calls for every new directive from the
coordinator) once the test says so; everything from there on is the product's own path.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FULL_MATRIX, ROOT, TRAIN, Procs, free_port, read_events, wait_for

from ftrun import exit_codes, knobs
from ftrun.errors import ConfigError
from ftrun.launcher.args import build_parser, ftrun_options

# ---- flags ---------------------------------------------------------------------------------


def options(argv: list[str]):  # noqa: ANN201
    return ftrun_options(build_parser().parse_args([*argv, "train.py"]))


def test_detection_flags_default_and_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    for knob in (knobs.ON_HANG, knobs.ON_SLOW, knobs.ISOLATE_HOOK):
        monkeypatch.delenv(knob.name, raising=False)
    opts = options([])
    assert (opts.on_hang, opts.on_slow, opts.isolate_hook) == ("restart", "warn", None)
    opts = options(["--on-hang", "isolate", "--on_slow", "isolate",
                    "--isolate-hook", "scontrol update state=drain nodename="])
    assert (opts.on_hang, opts.on_slow) == ("isolate", "isolate")
    assert opts.isolate_hook == "scontrol update state=drain nodename="


def test_detection_flags_from_the_environment_and_flag_wins(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTRUN_ON_HANG", "warn")
    monkeypatch.setenv("FTRUN_ON_SLOW", "isolate")
    monkeypatch.setenv("FTRUN_ISOLATE_HOOK", "drain.sh")
    opts = options([])
    assert (opts.on_hang, opts.on_slow, opts.isolate_hook) == ("warn", "isolate", "drain.sh")
    assert options(["--on-hang", "restart"]).on_hang == "restart"


def test_bad_detection_values_are_refused(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:  # argparse: exit 2, as for any torchrun flag
        options(["--on-slow", "restart"])
    assert e.value.code == 2 and "invalid choice: 'restart'" in capsys.readouterr().err
    monkeypatch.setenv("FTRUN_ON_HANG", "kill")
    with pytest.raises(ConfigError, match="--on-hang must be one of warn, restart, isolate, "
                                          "got 'kill'"):
        options([])
    monkeypatch.delenv("FTRUN_ON_HANG")
    with pytest.raises(ConfigError, match="--isolate-hook is empty"):
        options(["--isolate-hook", "  "])


def test_help_renders(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert "--on-hang {warn,restart,isolate}" in out and "at or below 3%" in out


def test_the_coordinator_gets_the_detection_config() -> None:
    from ftrun.launcher.launch import _detection_config

    config = _detection_config(options(["--on-hang", "isolate", "--isolate-hook", "x"]))
    fields = config if isinstance(config, dict) else vars(config)
    assert (fields["on_hang"], fields["on_slow"], fields["isolate_hook"]) == ("isolate", "warn",
                                                                              "x")


# ---- the real launcher ---------------------------------------------------------------------

DRIVER = '''\
"""Run the real ftrun launcher; deliver an isolate directive when the trigger file appears
and the agent is where ISOLATE_WHEN says (healthy: running its workers; rendezvous: in a
rendezvous wait)."""
import logging, os, sys, threading, time
from pathlib import Path

from ftrun import log
from ftrun.launcher import launch

contexts = []


class Recording(launch.AgentContext):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        contexts.append(self)


launch.AgentContext = Recording


def deliver():
    trigger, when = Path(os.environ["ISOLATE_TRIGGER"]), os.environ["ISOLATE_WHEN"]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        agent = contexts[0].agent if contexts else None
        ready = agent is not None and (agent.in_rendezvous if when == "rendezvous"
                                       else agent.node_state()["state"] == when)
        if trigger.exists() and ready:
            contexts[0].on_directive({"id": "iso-1", "action": "isolate", "data": {
                "reason": "rank 3 hung in all_reduce seq 7", "evidence": {"pg": "0", "seq": 7}}})
            return
        time.sleep(0.05)


threading.Thread(target=deliver, daemon=True).start()
log.configure()
code = launch.run(sys.argv[1:])
sys.stdout.flush()
sys.stderr.flush()
logging.shutdown()
os._exit(code)
'''


@pytest.fixture
def shm_root() -> Iterator[Path]:
    root = Path("/dev/shm") / f"ftrun-test-isolate-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def driven(procs: Procs, tmp_path: Path, args: list[str], env: dict[str, str],
           name: str) -> subprocess.Popen[str]:
    """The real launcher run through DRIVER, reaped by ``procs`` like any ftrun."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    out = open(tmp_path / f"{name}.log", "w+")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, str(driver), *args], stdout=out,
                            stderr=subprocess.STDOUT, text=True, env=full_env, cwd=ROOT,
                            start_new_session=True)
    proc.log_path = out.name  # type: ignore[attr-defined]
    procs.procs.append(proc)
    return proc


ISOLATED_LINE = "was isolated by the job's coordinator: rank 3 hung in all_reduce seq 7"


@pytest.mark.integration
@pytest.mark.parametrize("replicas", [pytest.param("2", marks=FULL_MATRIX), "1"])
def test_isolated_node_exits_8_and_the_other_goes_on(procs: Procs, state_dir: Path,
                                                     tmp_path: Path, shm_root: Path,
                                                     replicas: str) -> None:
    """Node 1 is isolated mid-training: its launcher kills its workers and exits 8 with the
    reason, and node 0 (which hosts the rendezvous) re-rendezvous alone: the rendezvous was
    not closed. With replicas (the default), node 0 resumes its 2 ranks from the 4 ranks'
    step in memory, node 1's shards from the replicas node 0 holds, and finishes. With
    ``--replicas 1`` no live memory holds node 1's shards and nothing is persisted: node 0
    stops with an error that names the committed step and what to do, never going on from
    step 0 without a word."""
    run_id = f"iso-{uuid.uuid4().hex[:8]}"
    steps_log = tmp_path / "steps.jsonl"
    trigger = tmp_path / "isolate-now"
    port = free_port()
    args = ["--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, "--max-restarts",
            "3" if replicas == "2" else "1", "--replicas", replicas, TRAIN, "--steps", "14",
            "--step-sleep", "0.3", "--pg-timeout", "900", "--step-log", str(steps_log)]
    (shm_root / "node0").mkdir()
    (shm_root / "node1").mkdir()
    node0 = procs.ftrun(*args, env={"FTRUN_SHM_DIR": str(shm_root / "node0")}, name="node0")
    wait_for(lambda: "coordinator of job" in procs.output(node0), 60, "node 0's coordinator")
    node1 = driven(procs, tmp_path, args,
                   {"FTRUN_SHM_DIR": str(shm_root / "node1"), "ISOLATE_TRIGGER": str(trigger),
                    "ISOLATE_WHEN": "healthy"}, "node1")

    def two_node_steps() -> bool:
        lines = steps_log.read_text().splitlines() if steps_log.exists() else []
        return len(lines) >= 3
    wait_for(two_node_steps, 180, "three steps of the two-node job")
    if replicas == "2":  # a step replicated in full: what a lost host cannot take with it
        def durable() -> bool:
            out = subprocess.run([sys.executable, "-m", "ftrun", "status", run_id, "--json"],
                                 capture_output=True, text=True, timeout=60,
                                 env={**os.environ, "FTRUN_STATE_DIR": str(state_dir)})
            snaps = (json.loads(out.stdout).get("snapshots") or {}) if out.stdout else {}
            return (snaps.get("durable_step") or 0) >= 1
        wait_for(durable, 60, "a durable step", interval_s=0.3)
    trigger.touch()

    code = procs.wait(node1, 120)
    out1 = procs.output(node1)
    assert code == exit_codes.ISOLATED, f"exit {code}:\n{out1[-4000:]}"
    assert ISOLATED_LINE in out1 and "exits with code 8" in out1, out1[-4000:]

    code = procs.wait(node0, 240)
    out0 = procs.output(node0)
    if replicas == "2":
        assert code == 0, f"node 0 exit {code}:\n{out0[-4000:]}"
        assert "RendezvousClosedError" not in out0 and "ftrun-example: step=" in out0
        resumed = re.findall(r"resumed from step (\d+) .*, from memory, resharded from 4 ranks",
                             out0)
        assert resumed and int(resumed[-1]) >= 1, out0[-4000:]
    else:
        assert code != 0, out0[-4000:]
        error = re.search(r"RestoreError: the job had committed step (\d+), but this restore "
                          r"found no step held in full by the job's live stores \(step \d+ of "
                          r"4 ranks lacks rank\(s\) 2, 3\)", out0)
        assert error and int(error[1]) >= 1, out0[-4000:]
        assert "relaunch with --start-fresh (or set FTRUN_START_FRESH=1)" in out0

    events = read_events(state_dir, run_id)
    isolated = [e for e in events if e["type"] == "node_isolated"]
    assert len(isolated) == 1 and isolated[0]["reason"] == "rank 3 hung in all_reduce seq 7"
    assert isolated[0]["evidence"] == {"pg": "0", "seq": 7} and isolated[0]["killed"]
    after = events[events.index(isolated[0]):]
    alone = [e for e in after if e["type"] == "rendezvous" and e["group_world_size"] == 1]
    assert alone, "node 0 never re-rendezvoused without node 1"
    left = [e for e in events if e["type"] == "node_left" and e.get("state") == "isolated"]
    assert left and left[0]["exitcode"] == exit_codes.ISOLATED


@pytest.mark.integration
def test_isolate_interrupts_a_rendezvous_wait(procs: Procs, state_dir: Path, tmp_path: Path,
                                              shm_root: Path) -> None:
    """A node waiting for a second node that never comes is isolated within its wait: it
    exits 8 long before the rendezvous would time out."""
    run_id = f"iso-wait-{uuid.uuid4().hex[:8]}"
    trigger = tmp_path / "isolate-now"
    trigger.touch()
    (shm_root / "node0").mkdir()
    node = driven(procs, tmp_path, [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", run_id,
        "--rdzv-conf", "join_timeout=600", TRAIN, "--steps", "2"],
        {"FTRUN_SHM_DIR": str(shm_root / "node0"), "ISOLATE_TRIGGER": str(trigger),
         "ISOLATE_WHEN": "rendezvous"}, "waiting")
    code = procs.wait(node, 120)
    out = procs.output(node)
    assert code == exit_codes.ISOLATED, f"exit {code}:\n{out[-4000:]}"
    assert ISOLATED_LINE in out, out[-4000:]
    assert "an isolate directive interrupts this node's rendezvous wait" in out, out[-4000:]
    events = read_events(state_dir, run_id)
    assert [e["type"] for e in events].count("node_isolated") == 1
    assert not any(e["type"] == "workers_started" for e in events)


# ---- restart and probe directives on a real agent --------------------------------------------


class Events:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def event(self, type: str, **data: object) -> None:  # noqa: A002 - the EventSink protocol
        self.events.append((type, data))

    def of(self, type: str) -> list[dict]:  # noqa: A002
        return [d for t, d in self.events if t == type]


def test_restart_and_probe_directives_on_a_real_agent(tmp_path: Path) -> None:
    """A real FtrunAgent (torch's static rendezvous, two workers): a restart directive naming
    rank 1 SIGKILLs that worker on the agent's thread and torch restarts the group, which
    then succeeds; a probe directive is handed to run_probe; an unknown action is ignored."""
    import threading

    from torch.distributed.elastic.agent.server.api import WorkerSpec, WorkerState
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from ftrun.launcher.agent import AgentContext, FtrunAgent

    script = tmp_path / "worker.py"
    script.write_text(
        "import os, time\n"
        "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
        "    time.sleep(120)\n")
    handler = get_rendezvous_handler(RendezvousParameters(
        backend="static", endpoint=f"127.0.0.1:{free_port()}", run_id="directives",
        min_nodes=1, max_nodes=1, rank=0))
    spec = WorkerSpec(role="trainer", local_world_size=2, rdzv_handler=handler,
                      entrypoint=sys.executable, args=(str(script),), max_restarts=1,
                      monitor_interval=0.1)
    sink = Events()
    probes: list[dict] = []
    ctx = AgentContext(node_id="n0", host="h0", node_dir=tmp_path, hang_timeout_s=0,
                       sink=sink, run_probe=probes.append)
    agent = FtrunAgent(ctx=ctx, spec=spec,
                       logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")))

    def direct() -> None:
        wait_for(lambda: len(agent.worker_pids()) == 2, 60, "two workers")
        ctx.on_directive({"id": "p-1", "action": "probe", "data": {"peers": [], "size": 1}})
        ctx.on_directive({"id": "x-1", "action": "reboot", "data": {}})
        ctx.on_directive({"id": "r-1", "action": "restart",
                          "data": {"ranks": [1, 7], "reason": "rank 1 never entered seq 9"}})

    thread = threading.Thread(target=direct, daemon=True)
    thread.start()
    result = agent.run()
    thread.join(5)
    assert result.state == WorkerState.SUCCEEDED, result
    [restart] = sink.of("directive_restart")
    assert restart == {"id": "r-1", "ranks": [1, 7], "killed": [1],
                       "reason": "rank 1 never entered seq 9"}
    failures = {f["rank"]: f["signal"] for f in sink.of("worker_failure")}
    assert failures.get(1) == "SIGKILL", failures
    assert len(sink.of("restart")) == 1 and len(sink.of("workers_started")) == 2
    assert [p["id"] for p in probes] == ["p-1"]
    assert not sink.of("node_isolated")
