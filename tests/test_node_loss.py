"""Node loss on network namespaces: every host has its own address, loopback and memory."""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import FULL_MATRIX, read_events, result_line, wait_for
from netns import (  # noqa: F401  (the fixture)
    KILL_AT,
    PORT,
    STEPS,
    Cluster,
    Job,
    cluster_fixture,
    reference_3_fixture,
    require_netns,
)

from ftrun import jobs
from ftrun.rank.progress import read_progress
from ftrun.snapshot import persist

log = logging.getLogger(__name__)

pytestmark = [pytest.mark.integration]

# A tiny TCP server and client, each run on one host.
SERVE = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept(); c.sendall(sys.argv[3].encode()); c.close()
"""
CONNECT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as c:
        print("got", c.recv(100).decode())
except OSError as e:
    print("error", type(e).__name__)
"""


def _connect(c: Cluster, i: int, host: str, port: int, timeout_s: float = 5) -> str:
    out = c.exec(i, [sys.executable, "-c", CONNECT, host, str(port), str(timeout_s)])
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_hosts_reach_each_other_and_keep_their_own_loopback(cluster_factory) -> None:
    c = cluster_factory(3)
    servers = []
    for i in range(3):
        for addr in (c.addr(i), "127.0.0.1"):
            p = c.run(i, [sys.executable, "-c", SERVE, addr, "7001", f"{addr}@{i}"],
                      name=f"serve{i}")
            servers.append(p)
    for p in servers:
        wait_for(lambda p=p: "listening" in c.output(p), 30, f"server {p.pid} to listen")
    for i in range(3):
        for j in range(3):
            assert _connect(c, i, c.addr(j), 7001) == f"got {c.addr(j)}@{j}"
        # each host's loopback is its own
        assert _connect(c, i, "127.0.0.1", 7001) == f"got 127.0.0.1@{i}"
    # every host has its own name, which resolves to its address on every host
    for i in range(3):
        names = [c.hostname(j) for j in range(3)]
        out = c.exec(i, [sys.executable, "-c", "import socket, sys; print(socket.gethostname(), "
                         "*[socket.gethostbyname(n) for n in sys.argv[1:]])", *names])
        assert out.stdout.split() == [c.hostname(i), *[c.addr(j) for j in range(3)]], out
    # the launcher knows host 0's address as its own there only (it hosts the rendezvous
    # store by its address, whatever the host name resolves to)
    check = "from ftrun.launcher.launch import is_local_address as f; import sys; " \
            "print(f(sys.argv[1]), f(sys.argv[2]))"
    assert c.exec(0, [sys.executable, "-c", check, c.addr(0), c.addr(1)]).stdout.split() == \
        ["True", "False"]
    # a cut link isolates the host both ways; restoring it brings it back
    c.cut_link(1)
    assert _connect(c, 0, c.addr(1), 7001, 2) == "error TimeoutError"
    assert _connect(c, 1, c.addr(2), 7001, 2).startswith("error")
    assert _connect(c, 0, c.addr(2), 7001) == f"got {c.addr(2)}@2"
    c.restore_link(1)
    assert _connect(c, 0, c.addr(1), 7001, 10) == f"got {c.addr(1)}@1"
    # a slowed link still carries traffic
    c.slow_link(1, "10mbit")
    assert _connect(c, 0, c.addr(1), 7001, 10) == f"got {c.addr(1)}@1"
    c.unslow_link(1)
    # killing a host kills exactly its processes
    (c.shm_dir(2) / "segment").write_bytes(b"x")
    before = c.pids(2)
    assert len(before) == 2
    killed = c.kill_host(2)
    assert sorted(killed) == sorted(before) and not c.pids(2)
    assert not any(c.shm_dir(2).iterdir())  # its memory is gone with it
    assert len(c.pids(0)) == 2 and len(c.pids(1)) == 2
    assert _connect(c, 0, c.addr(2), 7001, 2).startswith("error")


# ---- ftrun jobs on namespaces ---------------------------------------------------------------
#
# Every job: one rank per host, gloo on CPU, a snapshot of every step, 2 copies of every
# shard (--replicas 2), the rendezvous store and the coordinator on host 0 (the launcher
# there hosts them), and a spare, where there is one, started with the very same command.
# Host 0 is never the victim except in the test of the coordinator's host.

# Seconds each step of a _running job sleeps (a later --step-sleep in train_args wins).
STEP_SLEEP_S = 0.4


def _running(cluster_factory: Any, state_dir: Path, name: str, hosts: int, nnodes: str,
             *extra: str, **kw: Any) -> tuple[Cluster, Job, dict]:
    """A job on all ``hosts`` hosts, once it trained KILL_AT steps and a step is durable;
    with its status then. Its steps are paced (STEP_SLEEP_S) so that the fault still lands
    mid-job after the status calls (a subprocess each: 3-7 s on a loaded CI machine, where
    steps of 0.15 s let the job finish before the fault twice)."""
    c = cluster_factory(hosts)
    job = Job(c, state_dir, name)
    kw["train_args"] = ("--step-sleep", str(STEP_SLEEP_S), *kw.get("train_args", ()))
    job.start(range(hosts), nnodes, *extra, **kw)
    job.wait_step(KILL_AT)
    return c, job, job.wait_durable(KILL_AT - 2)


def _victim(job: Job, doc: dict, avoid: Sequence[int] = (0,)) -> int:
    hosts = sorted(h for h in job.hosts_with_ranks(doc) if h not in avoid)
    assert hosts, f"no host to pick among {job.hosts_with_ranks(doc)} (avoiding {avoid})"
    return hosts[0]


def _kill(job: Job, *hosts: int) -> float:
    """SIGKILL every process of ``hosts`` at once; returns the time of the kill."""
    t = time.time()
    for h in hosts:
        killed = job.c.kill_host(h)
        log.info("host %d (%s) killed: pids %s", h, job.c.hostname(h), killed)
    return t


def test_host_killed_with_spare_matches_fault_free(cluster_factory, state_dir: Path,
                                                   exact_steps: None, reference_3: str) -> None:
    """3 hosts train, a 4th waits as the spare; one training host is killed (processes and
    memory). The spare joins, the lost rank's shard comes from its replica, every rank resumes
    from memory at a step at least as new as the last durable one before the kill, and the
    final weights equal the fault-free run's."""
    c, job, doc = _running(cluster_factory, state_dir, "spare", 4, "3")
    training = job.hosts_with_ranks(doc)
    [spare] = set(range(4)) - set(training)
    victim = _victim(job, doc)
    durable = doc["snapshots"]["durable_step"]
    t_kill = _kill(job, victim)
    assert job.finish() == reference_3
    resumed = json.loads(job.result.read_text())["resumed_from"]
    assert len(resumed) == 1 and resumed[0] >= durable, (resumed, durable)
    assert {(s, src.split(" ")[0]) for _, s, src in job.resumes()} == {(resumed[0], "memory")}, \
        job.resumes()
    spare_node = [e for e in job.events() if e["type"] == "workers_started"
                  and e["node"].startswith(c.hostname(spare) + "/")]
    assert spare_node and spare_node[0]["ts"] > t_kill, "the spare never started workers"
    log.info("spare: host %d killed at step >= %d, durable %d, resumed from %d in %.1f s",
             victim, KILL_AT, durable, resumed[0], job.resumed_after(t_kill))


# A further cell: a host lost under MIN:MAX is also test_link_cut_under_min_max_survivors_go_on_
# without_it's (a link cut), test_failover_integ's (the coordinator's host) and
# test_memload_integ's (4 ranks to 3 and back).
@FULL_MATRIX
def test_host_killed_under_min_max_continues_on_fewer_hosts(cluster_factory,
                                                            state_dir: Path, exact_steps: None,
                                                            tmp_path: Path) -> None:
    """``--nnodes 2:3``, no spare: one of 3 training hosts is killed and the job completes on
    the 2 survivors, resharding step S (the newest durable one) from memory onto 2 ranks.

    Compared with a reference that takes the same path without a fault: the same command on
    3 hosts trains to step S and writes it to disk (``--persist-dir``, the final persist at
    the end of the job), then the same command on 2 hosts restores S from disk, resharded
    onto 2 ranks, and trains to the end. Up to S both runs are the fault-free 3-rank run;
    after S both train on 2 ranks from the same state, so the final weights are equal.
    """
    # 60 steps, not 24: on a loaded machine the wait for a durable step took long enough for
    # the 24-step job to end as its host was killed (CI: node_lost 1 s before job_end).
    steps = 60
    c, job, doc = _running(cluster_factory, state_dir, "shrink", 3, "2:3", steps=steps)
    durable = doc["snapshots"]["durable_step"]
    victim = _victim(job, doc)
    t_kill = _kill(job, victim)
    got = job.finish()
    result = json.loads(job.result.read_text())
    assert result["world_size"] == 2, f"the training ended before the kill took effect: {result}"
    [step] = result["resumed_from"]
    assert step >= durable, (step, durable)
    # A rank whose old shards sat on other hosts says which ("... (from node(s) ...)"):
    # which rank lands where after the shrink is the rendezvous' choice.
    assert {(s, src.split(" (from ")[0]) for _, s, src in job.resumes()} == \
        {(step, "memory, resharded from 3 ranks")}, job.resumes()
    # The survivors restarted in place (examples/train.py runs under @ftrun.resilient): the
    # world of 2 ranks re-formed in their running processes, no new process on either host.
    recoveries = [e for e in job.events() if e["type"] == "recovery"]
    for h in (h for h in range(3) if h != victim):
        mine = [r for r in recoveries if r["node"].startswith(c.hostname(h) + "/")]
        assert mine and all((r["how"], r["new_processes"]) == ("in_process", [])
                            for r in mine), (h, recoveries)
    log.info("shrink: host %d killed at step >= %d, durable %d, resumed from %d on 2 ranks "
             "in %.1f s", victim, KILL_AT, durable, step, job.resumed_after(t_kill))

    # The reference: 3 hosts to step S, on disk; then 2 hosts from there.
    ckpt = tmp_path / "reference-ckpt"
    first = Job(c, state_dir, "shrink-ref")
    first.start(range(3), "3", "--persist-dir", str(ckpt), steps=step)
    first.finish()
    second = Job(c, state_dir, "shrink-ref2")
    second.start(range(2), "2", "--persist-dir", str(ckpt), steps=steps)
    assert second.finish() == got
    assert {(s, src.split(" ")[0]) for _, s, src in second.resumes()} == {(step, "disk")}


def test_link_cut_with_spare_no_split_brain(cluster_factory, state_dir: Path,
                                            exact_steps: None, reference_3: str) -> None:
    """A training host's link goes down (its processes live on, unreachable). The survivors
    drop it and take the spare within seconds; the cut host trains no further step and forms
    no job of its own; the job ends bit-identical with the fault-free run."""
    c, job, doc = _running(cluster_factory, state_dir, "cut", 4, "3")
    victim = _victim(job, doc)
    cut_node = next(n for n in doc["nodes"] if n["host"] == c.hostname(victim))
    progress = _progress_path(job, cut_node["node_id"])
    t_cut = time.time()
    c.cut_link(victim)
    step_at_cut = read_progress(str(progress)).step
    survivors = [p for p in job.nodes if p.host != victim]  # type: ignore[attr-defined]
    for p in survivors:
        code = c.wait(p, 180)
        assert code == 0, f"host {p.host} exited {code}:\n{c.output(p)[-4000:]}"  # type: ignore[attr-defined]
    assert result_line("".join(c.output(p) for p in survivors)).split("params_xxh3=")[1].strip() \
        == reference_3
    [cut] = [p for p in job.nodes if p.host == victim]  # type: ignore[attr-defined]
    # The cut host trained no step after the cut (one in flight may end) and printed no
    # result of a job of its own.
    after = read_progress(str(progress))
    assert after is None or after.step <= step_at_cut + 1, (step_at_cut, after)
    assert "ftrun-example: step=" not in c.output(cut)
    lost = [e for e in job.events() if e["type"] == "node_lost"
            and e["node"] == cut_node["node_id"]]
    assert lost, "the coordinator never marked the cut host lost"
    log.info("cut: host %d cut at step %d, training resumed in %.1f s; cut launcher %s",
             victim, step_at_cut, job.resumed_after(t_cut),
             "still waiting" if cut.poll() is None else f"exited {cut.returncode}")


@FULL_MATRIX  # ~80 s; a link cut is the spare test's above, the shrink the two-hosts test's
def test_link_cut_under_min_max_survivors_go_on_without_it(
        cluster_factory, state_dir: Path, exact_steps: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--nnodes 2:3``, no spare: a training host's link is cut. Nothing fails on the
    survivors: their ranks wait in a collective for the cut host (for the process-group
    timeout, 300 s here). Their launchers see the rendezvous drop it for missed keep-alives
    and restart the workers without it within seconds; the job completes on 2 hosts.

    Reports go as in a large job (groups of 2 launchers, collective reports summarised:
    ftrun.coordinator.aggregation, ftrun.coordinator.collsum), and the cut host is its
    group's aggregator: the other member reports directly once its aggregator stops
    answering, and no host but the cut one is ever called lost."""
    monkeypatch.setenv("FTRUN_AGGREGATE_GROUP", "2")
    monkeypatch.setenv("FTRUN_COLL_SUMMARY_RANKS", "0")
    # 120 steps (not 24): the plan below can take many seconds to settle on a loaded
    # machine, and a cut after the training ended only leaves the survivors in torch's exit
    # barrier, waiting for the cut host (seen in CI).
    steps = 120
    c, job, doc = _running(cluster_factory, state_dir, "cutmin", 3, "2:3", steps=steps,
                           train_args=("--pg-timeout", "300"))
    agg = wait_for(lambda: (a := job.status()["coordinator"]["aggregation"])["groups"] == 1
                   and a["members_via_aggregator"] == 1 and a, 60, "the group's plan",
                   interval_s=0.3)
    [aggregator] = agg["aggregators"]
    victim = c.namespaces.index(aggregator.split("/")[0])
    assert victim != 0, aggregator  # host 0 runs the coordinator: it aggregates only alone
    t_cut = time.time()
    c.cut_link(victim)
    done = max(r["step"] for r in job.steps())
    assert done < steps, f"the training ended (step {done}) before the cut: nothing to test"
    survivors = [p for p in job.nodes if p.host != victim]  # type: ignore[attr-defined]
    for p in survivors:
        code = c.wait(p, 200)
        assert code == 0, f"host {p.host} exited {code}:\n{c.output(p)[-4000:]}"  # type: ignore[attr-defined]
    assert json.loads(job.result.read_text())["world_size"] == 2
    dropped = [e for e in job.events() if e["type"] == "node_dropped"]
    assert dropped and all(any(n.startswith(c.hostname(victim) + "_") for n in e["nodes"])
                           for e in dropped), dropped
    # A survivor acts on it (the other may see its workers fail first, from that restart).
    assert {e["node"].split("/")[0] for e in dropped} <= \
        {c.hostname(p.host) for p in survivors}  # type: ignore[attr-defined]
    lost = {e["node"] for e in job.events() if e["type"] == "node_lost"}
    assert lost <= {aggregator}, f"lost: {lost} (only the aggregator {aggregator} was cut)"
    log.info("cut under MIN:MAX: host %d cut, dropped after %.1f s, training resumed in %.1f s",
             victim, min(e["ts"] for e in dropped) - t_cut, job.resumed_after(t_cut))


def _progress_path(job: Job, node_id: str) -> Path:
    """The progress file of local rank 0 of ``node_id`` (next to its store's socket)."""
    [url] = [s["url"] for s in jobs.store_urls(job.run_id) if s["node_id"] == node_id]
    assert url.startswith("ipc:///"), url
    return Path(url.removeprefix("ipc://")).parent / "progress-0"


def _groups(job: Job, doc: dict) -> dict[int, int]:
    """host -> the host holding its replica (2 copies: each host's one peer)."""
    by_node = {n["node_id"]: job.c.namespaces.index(n["host"]) for n in doc["nodes"]}
    out = {}
    for node, cov in doc["snapshots"]["replica_coverage"].items():
        [peer] = cov["peers"]
        out[by_node[node]] = by_node[peer]
    return out


def test_two_hosts_of_different_groups_killed_recover_from_memory(
        cluster_factory, state_dir: Path, exact_steps: None) -> None:
    """4 hosts in 2 replica groups of 2, ``--nnodes 2:4``: one host of each group is killed at
    once. Every shard still has a copy on a survivor, so the 2 survivors resume from memory
    (resharded from 4 ranks onto 2), at a step no older than the last durable one."""
    c, job, doc = _running(cluster_factory, state_dir, "two", 4, "2:4")
    durable = doc["snapshots"]["durable_step"]
    peer = _groups(job, doc)
    assert len(peer) == 4 and all(peer[peer[h]] == h for h in peer), peer  # disjoint pairs
    x = _victim(job, doc)
    y = next(h for h in range(4) if h not in (0, x, peer[x]))
    t_kill = _kill(job, x, y)
    job.finish()
    result = json.loads(job.result.read_text())
    assert result["world_size"] == 2
    [step] = result["resumed_from"]
    assert step >= durable, (step, durable)
    assert {(s, src.split(",")[0]) for _, s, src in job.resumes()} == {(step, "memory")}, \
        job.resumes()
    log.info("two groups: hosts %d and %d killed, durable %d, resumed from %d in %.1f s",
             x, y, durable, step, job.resumed_after(t_kill))


def test_whole_group_killed_falls_back_to_disk(cluster_factory, state_dir: Path,
                                              exact_steps: None, tmp_path: Path) -> None:
    """Both hosts of one replica group are killed: their shards are in no live memory, so
    the survivors resume from the newest step complete on disk (``--persist-dir``), and the
    log and ``ftrun status`` say that the restore came from disk."""
    ckpt = tmp_path / "ckpt"
    c, job, doc = _running(cluster_factory, state_dir, "group", 4, "2:4", "--persist-dir",
                           str(ckpt), "--persist-every", "3", steps=40)
    peer = _groups(job, doc)
    x = next(h for h in range(1, 4) if peer[h] != 0)
    t_kill = _kill(job, x, peer[x])
    on_disk = [s.step for s in persist.list_steps(ckpt) if s.complete]
    assert on_disk, f"nothing complete in {ckpt} at the kill"

    def restored() -> dict | None:  # while the survivors train on
        for p in job.live():
            assert p.poll() is None, f"host {p.host} exited:\n{c.output(p)[-3000:]}"  # type: ignore[attr-defined]
        snaps = job.status(0).get("snapshots") or {}
        return snaps if snaps.get("world_size") == 2 and snaps.get("restored_from") else None

    snaps = wait_for(restored, 150, "ftrun status to show the restore", interval_s=0.5)
    # A step whose last shard landed just after the kill may complete then (a survivor
    # merges it): the restore takes the newest complete step, at least the one seen at
    # the kill.
    complete = [s.step for s in persist.list_steps(ckpt) if s.complete]
    assert snaps["base_step"] in complete and snaps["base_step"] >= max(on_disk), \
        (snaps, on_disk, complete)
    assert snaps["restored_from"].startswith("disk"), snaps
    text = job.status_text(0)
    assert f"restored step {snaps['base_step']} from disk" in text, text
    job.finish()
    [step] = json.loads(job.result.read_text())["resumed_from"]
    assert step == snaps["base_step"], (step, snaps)
    assert {(s, src.split(" ")[0]) for _, s, src in job.resumes()} == {(step, "disk")}, \
        job.resumes()
    restores = [e for e in job.events() if e["type"] == "restore" and e.get("step") == step]
    assert restores and all(str(e.get("source", "")).startswith("disk") for e in restores), \
        restores
    log.info("whole group: hosts %d and %d killed, resumed from disk step %d in %.1f s",
             x, peer[x], step, job.resumed_after(t_kill))


def test_corrupted_replica_is_refused_and_the_other_copy_used(
        cluster_factory, state_dir: Path, exact_steps: None, reference_3: str) -> None:
    """3 training hosts and a spare, 3 copies of every shard (``--replicas 3``). The host of
    rank 1 is killed; one byte of the newest replica of its shard (step S) is flipped on the
    holder that the new rank 1 reads first. That rank finds the chunk does not match its
    hash, reads it from the other holder's copy, and the job resumes from S itself, from
    memory, ending bit-identical with the fault-free run.

    Who reads first is fixed: torch numbers a round's nodes in the order of their names
    (host order here), and a rank reads a shard from its own node's copy, else from the
    holders in the order of their node ids. Steps take 0.5 s, so that every step reaches
    both peers before the next one commits."""
    c, job, doc = _running(cluster_factory, state_dir, "corrupt", 4, "3", replicas=3,
                           train_args=("--step-sleep", "0.5"))
    training = sorted(job.hosts_with_ranks(doc))
    x = training[1]  # rank 1
    [spare] = set(range(4)) - set(training)
    reader = sorted(set(training) - {x} | {spare})[1]  # rank 1 of the next round
    by_node = {n["node_id"]: c.namespaces.index(n["host"]) for n in doc["nodes"]}
    origin = next(node for node, h in by_node.items() if h == x)
    holders = sorted(by_node[p] for p in doc["snapshots"]["replica_coverage"][origin]["peers"])
    assert len(holders) == 2, holders
    first = reader if reader in holders else holders[0]
    other = next(h for h in holders if h != first)
    t_kill = _kill(job, x)
    # The newest step the other holder has a verified copy of (with no origin left, nothing
    # newer comes): on a loaded machine its replica of the newest step may not have landed.
    held = c.exec(other, [sys.executable, "-c", "import sys; from ftrun.store.catalog import "
                          "newest_replica; n = newest_replica(sys.argv[1], sys.argv[2]); "
                          "print(n[0] if n else -1); n and n[1].close()", job.run_id, origin])
    assert held.returncode == 0, held.stderr
    other_step = int(held.stdout.split()[-1])
    fault = c.exec(first, [sys.executable, "-c", "import dataclasses, json, sys; "
                           "from ftrun import faults; print(json.dumps(dataclasses.asdict("
                           "faults.corrupt_replica(sys.argv[1], sys.argv[2]))))",
                           job.run_id, origin])
    assert fault.returncode == 0, fault.stderr
    corrupted = json.loads(fault.stdout)
    log.info("host %d killed; replica corrupted on host %d (of holders %s, read by host %d): %s",
             x, first, holders, reader, corrupted)
    assert job.finish() == reference_3
    # The corrupted step itself, from the other copy; or, when the other holder had no copy of
    # it yet, the newest step it has (the corrupted one refused, never restored).
    assert other_step <= corrupted["step"], \
        f"the fault did not fire: host {other} holds a newer step ({other_step}) than {corrupted}"
    expected = other_step
    assert json.loads(job.result.read_text())["resumed_from"] == [expected], \
        (corrupted, other_step)
    assert {src.split(" ")[0] for _, _, src in job.resumes()} == {"memory"}, job.resumes()
    [read_by] = [p for p in job.nodes if p.host == reader]  # type: ignore[attr-defined]
    refused = [ln for ln in c.output(read_by).splitlines() if "does not match its hash" in ln
               and f"shard of step {corrupted['step']}" in ln]
    assert refused, c.output(read_by)[-4000:]
    log.info("corrupt replica: step %d's copy on host %d refused; resumed from step %d (the "
             "other holder's newest: %d) in %.1f s", corrupted["step"], first, expected,
             other_step, job.resumed_after(t_kill))


def test_losing_the_launcher_that_hosts_the_store_ends_the_job(cluster_factory,
                                                              state_dir: Path) -> None:
    """Without a standalone coordinator, host 0's launcher hosts the rendezvous store and the
    coordinator. Killing host 0 ends the job: every other launcher, the spare's too, exits
    with code 1 saying the rendezvous failed, and its store removes the job's segments."""
    c, job, _ = _running(cluster_factory, state_dir, "host0", 4, "3")
    t_kill = _kill(job, 0)
    for p in job.live():
        assert c.wait(p, 120) == 1, c.output(p)[-3000:]
        assert "rendezvous failed: RendezvousConnectionError" in c.output(p), c.output(p)[-3000:]
    assert not any(any(c.shm_dir(i).iterdir()) for i in range(1, 4))
    log.info("host 0 (the store's) killed: every other launcher exited %.1f s later",
             time.time() - t_kill)


@FULL_MATRIX  # ~60 s; test_launcher_integ's standalone coordinator outlives any launcher
def test_standalone_coordinator_outlives_the_host_that_would_host_it(
        cluster_factory, state_dir: Path, exact_steps: None, reference_3: str) -> None:
    """``ftrun coordinator`` runs on a host of its own (host 4). The launchers, with the same
    endpoint as ever, leave it to host the rendezvous store and the coordinator; host 0,
    whose launcher would otherwise have hosted both, is killed, and the job completes with
    the spare, bit-identical."""
    c = cluster_factory(5)
    job = Job(c, state_dir, "coord")
    endpoint = f"{c.hostname(4)}:{PORT}"
    coord = c.ftrun(4, "coordinator", "--rdzv-endpoint", endpoint, "--rdzv-id", job.run_id,
                    name="coordinator")
    wait_for(lambda: (state_dir / "jobs" / job.run_id / "job.json").exists(), 60,
             "the standalone coordinator's job file")
    job.start(range(3), "3", "--rdzv-conf", "is_host=0", endpoint=endpoint)
    job.wait_step(1)  # host 3 joins once the others train: it is the spare
    job.start([3], "3", "--rdzv-conf", "is_host=0", endpoint=endpoint)
    job.wait_step(KILL_AT)
    doc = job.wait_durable(KILL_AT - 2, host=4)
    if 0 not in job.hosts_with_ranks(doc):
        pytest.fail(f"host 0 is the spare here; the test kills a training host 0: {doc['nodes']}")
    t_kill = _kill(job, 0)
    assert job.finish() == reference_3
    assert json.loads(job.result.read_text())["world_size"] == 3
    log.info("standalone coordinator: host 0 killed, training resumed in %.1f s",
             job.resumed_after(t_kill))
    coord.send_signal(signal.SIGTERM)
    assert c.wait(coord, 30) == 0


# ---- in-process restart across a node loss (examples/user_ddp.py, @ftrun.resilient) ----------

USER_DDP = str(Path(__file__).resolve().parent.parent / "examples" / "user_ddp.py")


def _user_ddp_job(c: Cluster, run_id: str, hosts: Sequence[int], out: Path,
                  *extra: str) -> list[Any]:
    """examples/user_ddp.py, one rank per host, 3 nodes (a 4th launcher is a spare)."""
    out.mkdir(exist_ok=True)
    cmd = [*extra, "--nnodes", "3", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"{c.hostname(0)}:{PORT}", "--rdzv-id", run_id,
           "--max-restarts", "3", USER_DDP, "--epochs", "2", "--samples", "384",
           "--batch-size", "8", "--hidden", "64", "--step-sleep", "0.1", "--pid-log", str(out),
           "--fault-dir", str(out)]
    return [c.ftrun(i, *cmd, name=f"{run_id}.host{i}") for i in hosts]


def _digest(c: Cluster, nodes: list[Any]) -> str:
    outs = []
    for p in nodes:
        code = c.wait(p, 240)
        outs.append(c.output(p))
        assert code == 0, f"host {p.host} exited {code}:\n{outs[-1][-4000:]}"
    digests = [line.rpartition("params_xxh3=")[2] for line in "".join(outs).splitlines()
               if line.startswith("user-ddp: step=")]
    assert len(digests) == 1, "".join(outs)[-4000:]
    return digests[0]


def test_host_killed_with_spare_survivors_restart_in_place(cluster_factory, state_dir: Path,
                                                           exact_steps: None) -> None:
    """3 hosts train examples/user_ddp.py (@ftrun.resilient), a 4th waits as the spare; one
    training host is killed (processes and memory). The survivors' collectives fail on the
    lost peer, their launchers restart them in place at once (no waiting for the rendezvous
    to notice), the spare joins with a new process, the lost rank's shard comes from its
    replica; the survivors keep their processes and the weights equal the fault-free run's.

    The survivors' rendezvous does not wait for the lost node's c10d keep-alives to expire
    (made 30 s here, far beyond the job's whole recovery): the coordinator declares the host
    lost once its launcher missed a few heartbeats while the survivors' workers failed, and
    a survivor drops it from the rendezvous round at once (events ``node_lost`` early and
    ``rendezvous_node_dropped``)."""
    c = cluster_factory(4)
    reference = _digest(c, _user_ddp_job(c, f"ref-{c.tmp_path.name[-6:]}", range(3),
                                         c.tmp_path / "ref"))
    out = c.tmp_path / "faulted"
    run_id = f"inplace-loss-{c.tmp_path.name[-6:]}"
    nodes = _user_ddp_job(c, run_id, range(4), out, "--rdzv-conf",
                          "keep_alive_interval=2,keep_alive_max_attempt=15")

    def step_of(rank: int) -> int:  # the newest step rank ``rank`` logged
        path = out / f"pids-rank{rank}.log"
        lines = path.read_text().splitlines() if path.exists() else []
        return int(lines[-1].split()[0]) if lines else 0

    wait_for(lambda: min(step_of(r) for r in range(3)) >= 12, 150, "step 12 on every rank",
             interval_s=0.1)
    started = {c.namespaces.index(e["node"].split("/")[0]): e
               for e in read_events(state_dir, run_id) if e["type"] == "workers_started"}
    training = sorted(started)  # the spare (any host) has started no workers yet
    victim = next(h for h in training if h != 0)  # host 0 hosts the rendezvous store
    survivor_pids = {pid for h in training if h != victim
                     for pid in started[h]["pids"].values()}
    t_kill = time.time()
    assert c.kill_host(victim), "the victim host had no process to kill"
    assert _digest(c, [p for p in nodes if p.host != victim]) == reference
    events = read_events(state_dir, run_id)
    lost_node = started[victim]["node"]
    lost = [e for e in events if e["type"] == "node_lost" and e["node"] == lost_node]
    assert len(lost) == 1 and lost[0]["early"] and "while other nodes' workers failed" in \
        lost[0]["reason"], lost
    dropped = [e for e in events if e["type"] == "rendezvous_node_dropped"]
    # Each survivor told to drop it may find it still there (CI: both did, under load): the
    # drop is the same either way.
    assert dropped and {(e["lost_node"], e["early"]) for e in dropped} == {(lost_node, True)}, \
        dropped
    assert all(e["node"] != lost_node for e in dropped), dropped  # survivors dropped it
    assert dropped[0]["rdzv_node"].startswith(c.hostname(victim) + "_"), dropped
    assert not [e for e in events if e["type"] == "rendezvous_drop_refused"], events
    recoveries = [e for e in events if e["type"] == "recovery"]
    for h in training:
        if h != victim:
            mine = [r for r in recoveries if r["node"].startswith(c.hostname(h) + "/")]
            assert [(r["how"], r["new_processes"]) for r in mine] == [("in_process", [])], \
                (h, recoveries)
    # The survivors' processes trained on after the kill, to the end (under whatever rank
    # the new world gave them); the spare's process took the lost rank's place. (The
    # victim's own process may log a step between t_kill and the kill landing.)
    victim_pids = set(started[victim]["pids"].values())
    after = {int(pid) for r in range(3)
             for step, pid, t in (ln.split() for ln in
                                  (out / f"pids-rank{r}.log").read_text().splitlines())
             if float(t) > t_kill} - victim_pids
    assert survivor_pids <= after, (survivor_pids, after)
    assert len(after) == 3, after
