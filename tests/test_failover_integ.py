"""The host that runs the coordinator dies, and the job goes on (``--rdzv-backend etcd``).

3 hosts train examples/user_ddp.py (``@ftrun.resilient``, one rank per host) and a 4th waits
as the spare, all on network namespaces; a real 3-member etcd runs on the root side of their
bridge (an address of the bridge's own, reached from every host and from the root
namespace). The host whose launcher holds the coordinator role is killed: its launcher,
store, rank and memory. Checked in one run: another launcher takes the role (a larger term)
and every survivor moves to it (``coordinator_failover``); the job ends bit-identical to the
fault-free run, resuming from memory (replicas), never from disk (there is none);
``ftrun status --etcd`` answers from the root namespace before the kill and after it, naming
the new coordinator, and every rank reports its collectives to the new detection service.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FULL_MATRIX, ROOT, TRAIN, Procs, read_events, result_line, wait_for
from netns import KILL_AT, STEPS, Cluster, Job, cluster_fixture  # noqa: F401  (the fixture)
from test_etcd import require_etcd

from ftrun.launcher import etcd
from ftrun.testing.etcd import (
    USER_DDP_DIGEST,
    USER_DDP_STEPS,
    EtcdCluster,
    user_ddp_on_etcd,
)

log = logging.getLogger(__name__)

pytestmark = [pytest.mark.integration]


def _finish(c: Cluster, nodes: list[Any]) -> tuple[str, str]:
    """(params_xxh3 of the run, every launcher's output); every launcher must succeed."""
    out = c.succeed(nodes, 240)
    digests = re.findall(USER_DDP_DIGEST, out, re.M)
    assert len(digests) == 1, out[-4000:]
    return digests[0], out


def _status(run_id: str, endpoints: str) -> dict | None:
    """``ftrun status RUN --etcd ... --json`` from the root namespace."""
    done = subprocess.run([sys.executable, "-m", "ftrun", "status", run_id, "--etcd", endpoints,
                           "--json"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    if done.returncode not in (0, 3) or not done.stdout.strip():
        return None
    return json.loads(done.stdout)


def _step(out: Path, rank: int) -> int:
    path = out / f"pids-rank{rank}.log"
    lines = path.read_text().splitlines() if path.exists() else []
    return int(lines[-1].split()[0]) if lines else 0


def test_coordinator_host_killed_another_takes_over(cluster_factory, state_dir: Path,
                                                    exact_steps: None, tmp_path: Path) -> None:
    require_etcd()
    c = cluster_factory(4)
    root_addr = f"{c.subnet}.254"  # the bridge's own address, in the root namespace
    subprocess.run(["ip", "addr", "add", f"{root_addr}/24", "dev", c.bridge], check=True)
    with EtcdCluster(tmp_path / "etcd", host=root_addr) as cluster:
        endpoints = cluster.endpoints
        client = etcd.EtcdClient(endpoints, timeout_s=2)
        reference, _ = _finish(c, user_ddp_on_etcd(c, endpoints, f"ref-{uuid.uuid4().hex[:6]}", range(3),
                                       tmp_path / "ref"))

        run_id = f"failover-{uuid.uuid4().hex[:6]}"
        out = tmp_path / "faulted"
        nodes = user_ddp_on_etcd(c, endpoints, run_id, range(3), out)
        wait_for(lambda: min(_step(out, r) for r in range(3)) >= 1, 150, "every rank trains",
                 interval_s=0.1)
        nodes += user_ddp_on_etcd(c, endpoints, run_id, [3], out)  # the spare
        before = wait_for(lambda: _status(run_id, endpoints), 60, "ftrun status --etcd")
        old = etcd.read_coordinator(client, run_id)
        assert old is not None and before["coordinator"]["term"] == old.term, before
        holder = c.namespaces.index(old.host)
        training = {c.namespaces.index(e["node"].split("/")[0])
                    for e in read_events(state_dir, run_id) if e["type"] == "workers_started"}
        assert holder in training and len(training) == 3, (holder, training)
        wait_for(lambda: min(_step(out, r) for r in range(3)) >= KILL_AT, 150,
                 f"step {KILL_AT} on every rank", interval_s=0.1)

        t_kill = time.time()
        killed = c.kill_host(holder)
        step_at_kill = max(_step(out, r) for r in range(3))
        assert killed and step_at_kill < USER_DDP_STEPS, (killed, step_at_kill)  # mid-training

        def taken_over() -> dict | None:
            """The status once a new coordinator answers it and has its picture back from
            the survivors' reports: their nodes, the epoch's commits, durable steps."""
            doc = _status(run_id, endpoints)
            if not doc or doc["coordinator"].get("term", 0) <= old.term:
                return None
            snaps = doc.get("snapshots") or {}
            live = {n["host"] for n in doc["nodes"] if not (n["lost"] or n["left"])}
            rebuilt = (snaps.get("committed_step") or 0) >= KILL_AT - 1 and \
                (snaps.get("durable_step") or 0) >= KILL_AT - 2
            return doc if rebuilt and live >= survivors_training else None

        survivors_training = {c.hostname(h) for h in training if h != holder}
        after = wait_for(taken_over, 90, "ftrun status --etcd to name a new coordinator, "
                         "its picture rebuilt", interval_s=0.5)

        def detecting() -> dict | None:
            """The status once every rank of the new world, the survivors' restarted in
            place included, reports its collectives to the new detection service."""
            doc = _status(run_id, endpoints)
            suspects = ((doc or {}).get("detection") or {}).get("suspects") or {}
            return doc if suspects.get("ranks", 0) >= 3 else None

        detection = wait_for(detecting, 60, "every rank reporting to the new detection "
                             "service", interval_s=0.5)["detection"]
        digest, text = _finish(c, [p for p in nodes if p.host != holder])
        t_end = time.time()

    new = after["coordinator"]
    assert detection["endpoint"] != before["detection"]["endpoint"], detection
    assert new["endpoint"] != before["coordinator"]["endpoint"]
    assert not new["stepped_down"]
    assert digest == reference
    # Every rank resumed from one step in memory (the lost rank from its replica), none
    # from disk (there is none).
    resumed = set(re.findall(r"user-ddp: rank \d resumed from step (\d+)", text))
    events = read_events(state_dir, run_id)
    restores = [e for e in events if e["type"] == "restore" and e["ts"] > t_kill]
    assert len(resumed) == 1 and restores, (resumed, restores)
    assert all(e["source"].startswith("memory") and str(e["step"]) in resumed
               for e in restores), restores
    moves = [e for e in events if e["type"] == "coordinator_failover"]
    # Every launcher that was training moved; the spare did too if it had found the old
    # coordinator before the kill (a launcher starting later finds the new one in etcd).
    moved = {e["node"].split("/")[0] for e in moves}
    assert survivors_training <= moved <= survivors_training | {c.hostname(3)}, moves
    assert all(e["old_term"] == old.term and e["new_term"] == new["term"]
               and e["old_holder"] == old.node_id and e["ts"] > t_kill
               for e in moves), moves
    starts = [e for e in events if e["type"] == "job_start" and e.get("term") == new["term"]]
    assert starts and starts[0]["seq"] > max(e["seq"] for e in events
                                             if e["ts"] < t_kill), starts
    log.info("coordinator host %d (term %d) killed: term %d took over in %.1f s; job done "
             "%.1f s after the kill; resumed from %s", holder, old.term, new["term"],
             min(e["ts"] for e in moves) - t_kill, t_end - t_kill, resumed)
    assert re.search(r"coordinator failover: job \S+'s coordinator is now", text), text[-3000:]


def _finish_with_a_late_joiner(c: Cluster, job: Job, late: int) -> str:
    """The job's params_xxh3 once every launcher is done. Host ``late`` rejoined the job
    near its end: either in time (it then finishes with the others, and if it joined as
    they finished, the new world runs the training function once more from the last step,
    printing the same result again) or after the job ended, when its launcher exits saying
    so (the job's keys gone from etcd, or its round closed). Every other launcher must
    succeed."""
    outputs = []
    for p in job.live():
        code = c.wait(p, 240)
        out = c.output(p)
        if p.host == late and code != 0:  # type: ignore[attr-defined]
            # Its rendezvous finds the job's keys gone, or the round closed by the others.
            assert "while this launcher was away" in out, out[-4000:]
            continue
        assert code == 0, f"host {p.host} exited {code}:\n{out[-4000:]}"  # type: ignore[attr-defined]
        outputs.append(out)
    digests = set(re.findall(r"^ftrun-example: step=\d+ .*params_xxh3=(\w+)$",
                             "".join(outputs), re.M))
    assert len(digests) == 1, digests
    return digests.pop()


@contextlib.contextmanager
def _min_max_on_etcd(c: Cluster, state_dir: Path, tmp_path: Path,
                     name: str) -> Iterator[tuple[etcd.EtcdClient, Job, Any, int]]:
    """A ``--nnodes 2:3`` job on the 3 hosts of ``c`` and a 3-member etcd on the bridge,
    trained to step KILL_AT with a durable step: (etcd client, job, the coordinator's
    record, the durable step)."""
    require_etcd()
    root_addr = f"{c.subnet}.254"
    subprocess.run(["ip", "addr", "add", f"{root_addr}/24", "dev", c.bridge], check=True)
    with EtcdCluster(tmp_path / "etcd", host=root_addr) as cluster:
        client = etcd.EtcdClient(cluster.endpoints, timeout_s=2)
        job = Job(c, state_dir, name)
        job.start(range(3), "2:3", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                  cluster.endpoints)
        job.wait_step(KILL_AT)
        old = wait_for(lambda: etcd.read_coordinator(client, job.run_id), 30,
                       "the coordinator's record")
        other = (c.namespaces.index(old.host) + 1) % 3
        durable = job.wait_durable(KILL_AT - 2, host=other)["snapshots"]["durable_step"]
        yield client, job, old, durable


def _next_term(client: etcd.EtcdClient, job: Job, old: Any) -> Any:
    """The coordinator's record once another launcher holds the role under a larger term."""
    return wait_for(lambda: (r := etcd.read_coordinator(client, job.run_id)) and
                    r.term > old.term and r.endpoint and r, 60,
                    "another launcher to take the coordinator role", interval_s=0.2)


@FULL_MATRIX  # ~120 s; the failover itself is the test above, the shrink test_node_loss's
def test_coordinator_host_killed_under_min_max_the_others_go_on_resharded(
        cluster_factory, state_dir: Path, exact_steps: None, procs: Procs,
        tmp_path: Path) -> None:
    """``--nnodes 2:3`` on etcd, no spare: the host whose launcher holds the coordinator role
    is killed (launcher, store, rank, memory). Another launcher takes the role (a larger
    term); the 2 others go on, resharding the newest durable step from memory onto 2 ranks;
    the final weights equal the reference of tests/test_node_loss.py's MIN:MAX test (3 ranks
    to that step, persisted; 2 ranks from it), run here as two plain jobs."""
    c = cluster_factory(3)
    with _min_max_on_etcd(c, state_dir, tmp_path, "etcd-shrink") as (client, job, old, durable):
        holder = c.namespaces.index(old.host)
        t_kill = time.time()
        c.kill_host(holder)
        new = _next_term(client, job, old)
        assert new.host != old.host, (old, new)
        got = job.finish()
        t_end = time.time()
    result = json.loads(job.result.read_text())
    assert result["world_size"] == 2, result
    [step] = result["resumed_from"]
    assert step >= durable, (step, durable)
    assert {(s, src.split(" (from ")[0]) for _, s, src in job.resumes()} == \
        {(step, "memory, resharded from 3 ranks")}, job.resumes()
    moves = [e for e in job.events() if e["type"] == "coordinator_failover"]
    assert {e["node"].split("/")[0] for e in moves} == \
        {c.hostname(h) for h in range(3) if h != holder}, moves
    log.info("holder host %d (term %d) killed: term %d took over in %.1f s, job done %.1f s "
             "after; resumed from %d on 2 ranks", holder, old.term, new.term,
             min(e["ts"] for e in moves) - t_kill, t_end - t_kill, step)

    assert _reference(procs, tmp_path, [(3, step), (2, STEPS)]) == got


def _reference(procs: Procs, tmp_path: Path, segments: list[tuple[int, int]]) -> str:
    """params_xxh3 of plain jobs run one after another on one persist directory: ``(world
    size, last step)`` each, resuming from the step the one before persisted at its end (as
    tests/test_node_loss.py's MIN:MAX reference)."""
    ckpt = tmp_path / "reference-ckpt"
    train = ["--batch", "12", "--snapshot-every", "1"]
    env = {"FTRUN_STATE_DIR": str(tmp_path / "ref-state")}
    out = ""
    for i, (world, last) in enumerate(segments):
        p = procs.ftrun("--standalone", "--nproc-per-node", str(world), "--persist-dir",
                        str(ckpt), TRAIN, "--steps", str(last), *train, env=env,
                        name=f"ref{i}-{world}")
        assert procs.wait(p, 180) == 0, procs.output(p)[-3000:]
        out = procs.output(p)
        if i:
            assert f"resumed from step {segments[i - 1][1]}" in out, out[-3000:]
    return result_line(out).split("params_xxh3=")[1].strip()


# Alone, after the parallel part (scripts/test.sh): beside another file's jobs it failed in
# two clean-clone CI runs on one symptom (the survivors' restore found the durable step held
# by no live store: "step 15 of 3 ranks lacks rank(s) 0, 1; step 14 lacks rank 0"). The
# cause: the new coordinator first hears of one store alone, sends it a plan without peers
# and replies without a durable step; that store forgot the durable step, and its rank's
# retrying claim overwrote its shard of it, whose only other copy was on the frozen host
# (ftrun.store.commits; tests/test_durable_keep.py).
@pytest.mark.serial
@FULL_MATRIX  # ~115 s alone; a frozen holder stepping down is also test_failover's
def test_coordinator_host_frozen_steps_down_and_the_job_goes_on(
        cluster_factory, state_dir: Path, exact_steps: None, procs: Procs,
        tmp_path: Path) -> None:
    """``--nnodes 2:3`` on etcd: the host whose launcher holds the coordinator role is frozen
    (SIGSTOP of its launcher, store and rank: a hung host, its sockets open). Another
    launcher takes the role (a larger term) and the 2 others go on from memory; the frozen
    host, resumed, steps down without deciding anything under its old term and joins the
    job again (there is room: MAX is 3). The job never starts over from step 0, and ends
    bit-identical to plain jobs run through the same worlds."""
    c = cluster_factory(3)
    with _min_max_on_etcd(c, state_dir, tmp_path, "etcd-frozen") as (client, job, old, durable):
        holder = c.namespaces.index(old.host)
        t_freeze = time.time()
        c.freeze_host(holder)
        step_at_freeze = max((r["step"] for r in job.steps()), default=0)
        try:
            # (On a host loaded far beyond CI's, the status queries that find the durable
            # step outlasted the rest of the job: nothing was left to go on with.)
            assert step_at_freeze < STEPS, f"the training ended before the freeze: {job.steps()}"
            new = _next_term(client, job, old)
            t_new = time.time()
            # The others train on without the frozen host: steps after a restart.
            try:
                wait_for(lambda: any(r["time"] > t_new and r["restart"] > 0
                                     for r in job.steps()),
                         120, "the others to train on without the frozen host", interval_s=0.2)
            except AssertionError as e:
                raise AssertionError(f"{e}\n{job.output()[-8000:]}") from None
        finally:
            t_thaw = time.time()
            c.thaw_host(holder)
        got = _finish_with_a_late_joiner(c, job, holder)
    events = job.events()
    result = json.loads(job.result.read_text())
    resumes = job.resumes()
    log.info("holder host %d (term %d) frozen: term %d took over in %.1f s; thawed %.1f s "
             "after the freeze; resumes %s", holder, old.term, new.term, t_new - t_freeze,
             t_thaw - t_freeze, resumes)
    assert new.host != old.host, (old, new)
    # The frozen coordinator, resumed, decided nothing under its old term: its one event
    # after the freeze is its stepping down.
    late = [e for e in events if e.get("term") == old.term and e["ts"] > t_freeze]
    assert [e["type"] for e in late] == ["coordinator_stepped_down"], late
    assert late[0]["ts"] > t_thaw, late
    # Never from step 0 or from disk (there is none): every resume from memory, at the
    # durable step or later.
    assert resumes and all(s >= durable and src.startswith("memory") for _, s, src in resumes), \
        resumes
    # Bit-identical to plain jobs run through the same worlds: 3 ranks to the first resumed
    # step, then each world (the ranks that resumed at a step) to the next.
    steps = sorted({s for _, s, _ in resumes})
    assert steps == sorted(set(result["resumed_from"])), (steps, result)
    worlds = [len({r for r, s, _ in resumes if s == step}) for step in steps]
    # (A world that resumed at the last step trained nothing: the frozen host joined as the
    # others finished.)
    segments = [(3, steps[0])] + [(w, nxt) for w, nxt, at in
                                  zip(worlds, steps[1:] + [STEPS], steps, strict=True) if nxt > at]
    assert worlds[-1] == result["world_size"], (worlds, result)
    assert _reference(procs, tmp_path, segments) == got, segments
