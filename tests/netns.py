"""pytest's side of the namespace cluster (:mod:`ftrun.testing.netns`): skip or fail, fixtures, jobs.

:func:`require_netns` skips a test where namespaces are unavailable, or fails it when
``FTRUN_REQUIRE_NETNS=1`` (CI sets it, so the tests cannot pass by being skipped).
``cluster_factory(n)`` gives an entered :class:`Cluster`, closed at teardown; :class:`Job`
is one ftrun job of ``examples/train.py`` on a cluster.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ftrun.testing import TRAIN, read_events, result_line, wait_for
from ftrun.testing.netns import Cluster, unavailable_reason

__all__ = ["KILL_AT", "PORT", "STEPS", "Cluster", "Job", "cluster_fixture",
           "reference_3_fixture", "require_netns"]

REQUIRE_ENV = "FTRUN_REQUIRE_NETNS"


def require_netns() -> None:
    """Skip the calling test when namespaces are unavailable; fail it under FTRUN_REQUIRE_NETNS=1."""
    reason = unavailable_reason()
    if not reason:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason}, and {REQUIRE_ENV}=1 says these tests must run")
    pytest.skip(reason)


@pytest.fixture(name="cluster_factory")
def cluster_fixture(tmp_path: Path) -> Iterator[type[Cluster]]:
    """``cluster_factory(n)`` -> an entered :class:`Cluster`, closed at teardown.

    Skips (or fails under FTRUN_REQUIRE_NETNS=1) where namespaces are unavailable. Uses the
    FTRUN_STATE_DIR the test set (the ``state_dir`` fixture), else ``tmp_path/state``.
    """
    require_netns()
    made: list[Cluster] = []

    def make(n: int) -> Cluster:
        state = os.environ.get("FTRUN_STATE_DIR")
        c = Cluster(n, tmp_path / f"c{len(made)}", Path(state) if state else None)
        c.tmp_path.mkdir(parents=True, exist_ok=True)
        made.append(c)
        return c.__enter__()

    try:
        yield make  # type: ignore[misc]
    finally:
        errors = []
        for c in made:
            try:
                c.close(raise_errors=True)
            except RuntimeError as e:
                errors.append(str(e))
        if errors:
            raise RuntimeError("; ".join(errors))


# -- one ftrun job on a cluster --------------------------------------------------------------

PORT = "29400"  # every cluster has network stacks of its own: no other job can hold it
STEPS = 24
KILL_AT = 8  # steps done before the fault
RESUMED = re.compile(r"rank (\d+) resumed from step (\d+) \(.*?\), from (.+)$", re.M)


class Job:
    """One ftrun job on a cluster: its command, its nodes, its status and events."""

    def __init__(self, c: Cluster, state_dir: Path, name: str) -> None:
        self.c = c
        self.state_dir = state_dir
        self.run_id = f"{name}-{uuid.uuid4().hex[:8]}"
        self.result = c.tmp_path / f"{self.run_id}.result.json"
        self.steps_file = c.tmp_path / f"{self.run_id}.steps.jsonl"
        self.nodes: list[subprocess.Popen[str]] = []

    def command(self, nnodes: str, *extra: str, endpoint: str | None = None,
                steps: int = STEPS, train_args: Sequence[str] = (),
                replicas: int = 2, redundancy: str | None = None) -> list[str]:
        """``redundancy`` (``ec:K+M``, ``replicas:M``) replaces ``--replicas``."""
        copies = ["--redundancy", redundancy] if redundancy else ["--replicas", str(replicas)]
        return ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", endpoint or f"{self.c.hostname(0)}:{PORT}",
                "--rdzv-id", self.run_id, *copies, "--max-restarts", "3",
                *extra,
                TRAIN, "--steps", str(steps), "--batch", "12", "--snapshot-every", "1",
                "--step-sleep", "0.15", "--step-log", str(self.steps_file),
                "--result", str(self.result), *train_args]

    def start(self, hosts: Sequence[int], nnodes: str, *extra: str,
              **kw: Any) -> list[subprocess.Popen[str]]:
        cmd = self.command(nnodes, *extra, **kw)
        self.nodes += [self.c.ftrun(i, *cmd, name=f"{self.run_id}.host{i}") for i in hosts]
        return self.nodes

    def live(self) -> list[subprocess.Popen[str]]:
        return [p for p in self.nodes if p.host not in self.c.lost]  # type: ignore[attr-defined]

    def output(self) -> str:
        return "".join(self.c.output(p) for p in self.nodes)

    def steps(self) -> list[dict]:
        if not self.steps_file.exists():
            return []
        return [json.loads(ln) for ln in self.steps_file.read_text().splitlines() if ln.strip()]

    def events(self) -> list[dict]:
        return read_events(self.state_dir, self.run_id)

    def wait_step(self, step: int, timeout_s: float = 150) -> None:
        def reached() -> bool:
            for p in self.live():
                assert p.poll() is None, \
                    f"host {p.host} exited early:\n{self.c.output(p)[-3000:]}"  # type: ignore[attr-defined]
            return any(r["step"] >= step for r in self.steps())

        wait_for(reached, timeout_s, f"step {step} of {self.run_id}", interval_s=0.1)

    def status(self, host: int = 0) -> dict:
        """``ftrun status --json``, run on ``host`` (the coordinator is on the bridge)."""
        out = self.c.exec(host, [sys.executable, "-m", "ftrun", "status", self.run_id, "--json"])
        assert out.returncode in (0, 3), f"ftrun status failed ({out.returncode}): {out.stderr}"
        return json.loads(out.stdout)

    def status_text(self, host: int = 0) -> str:
        out = self.c.exec(host, [sys.executable, "-m", "ftrun", "status", self.run_id])
        assert out.returncode in (0, 3), f"ftrun status failed ({out.returncode}): {out.stderr}"
        return out.stdout

    def hosts_with_ranks(self, doc: dict) -> dict[int, list[int]]:
        """host index -> its ranks, for the nodes training now."""
        return {self.c.namespaces.index(n["host"]): n["ranks"] for n in doc["nodes"]
                if n["state"] == "healthy" and not (n["lost"] or n["left"])}

    def wait_durable(self, at_least: int, host: int = 0, timeout_s: float = 60) -> dict:
        """The status once a step >= ``at_least`` is durable and every node reports coverage."""
        def durable() -> dict | None:
            doc = self.status(host)
            snaps = doc.get("snapshots") or {}
            return doc if (snaps.get("durable_step") or 0) >= at_least else None

        return wait_for(durable, timeout_s, f"a durable step >= {at_least}", interval_s=0.3)

    def finish(self, timeout_s: float = 180, skip: Sequence[int] = ()) -> str:
        """Wait for every live node but those on the hosts ``skip``; all must succeed.
        Returns the final params_xxh3."""
        for p in self.live():
            if p.host in skip:  # type: ignore[attr-defined]
                continue
            code = self.c.wait(p, timeout_s)
            assert code == 0, f"host {p.host} exited {code}:\n{self.c.output(p)[-4000:]}"  # type: ignore[attr-defined]
        return result_line(self.output()).split("params_xxh3=")[1].strip()

    def resumes(self) -> list[tuple[int, int, str]]:
        """(rank, step, source) of every rank that resumed from a snapshot."""
        return [(int(r), int(s), src) for r, s, src in RESUMED.findall(self.output())]

    def resumed_after(self, t_fault: float) -> float:
        """Seconds from the fault to the first step completed by the restarted workers."""
        starts = [e["ts"] for e in self.events()
                  if e["type"] == "workers_started" and e["ts"] > t_fault]
        assert starts, f"no workers started after the fault: {[e['type'] for e in self.events()]}"
        later = [r["time"] for r in self.steps() if r["time"] > min(starts)]
        assert later, "no step completed after the restart"
        return min(later) - t_fault


@pytest.fixture(scope="session", name="reference_3")
def reference_3_fixture(tmp_path_factory: pytest.TempPathFactory) -> str:
    """params_xxh3 of the fault-free job on 3 hosts: the command of every test with a spare (once per test session)."""
    require_netns()
    tmp = tmp_path_factory.mktemp("reference3")
    with Cluster(3, tmp) as c:
        job = Job(c, c.state_dir, "ref3")
        job.start(range(3), "3")
        return job.finish()


# -- a framework's example script on 2 training hosts and a spare, losing a host ------------

def host_of(c: Cluster, node_id: str) -> int:
    """The host of a node id (``<host name>/...``)."""
    return c.namespaces.index(node_id.split("/")[0])


@dataclass(frozen=True)
class HostLoss:
    """A host lost by :meth:`SpareJob.lose_a_host`: the training host killed (never host 0,
    whose launcher hosts the rendezvous store and the coordinator) and the global ranks it
    ran, the spare, the node that held the victim's replicas (on another host: the other
    training host's, or the spare's store, which takes replicas too), the step durable at
    the kill (every shard had its replica) and the time of the kill."""

    victim: int
    victim_ranks: tuple[int, ...]
    spare: int
    holder: str  # node id
    durable: int
    t_kill: float


class SpareJob(Job):
    """A framework's example script as one ftrun job on every host of a cluster: ``c.n - 1``
    nodes train, the last launcher to join waits as the spare. The script holds its ranks
    at a step (each writes a marker, then waits for a release file: its ``--hold-at-step``)
    until :meth:`lose_a_host` has killed a training host."""

    def start_script(self, per_node: int, script: str, *args: str,
                     launcher: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        cmd = ["--nnodes", str(self.c.n - 1), "--nproc-per-node", str(per_node),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.c.hostname(0)}:{PORT}",
               "--rdzv-id", self.run_id, "--max-restarts", "3", *launcher, script, *args]
        # Held ranks sit between collectives on purpose: the hang analysis may say so, and
        # must not restart them.
        env = {"FTRUN_ON_HANG": "warn", **(env or {})}
        self.nodes += [self.c.ftrun(i, *cmd, env=env, name=f"{self.run_id}.host{i}")
                       for i in range(self.c.n)]

    def ranks_by_host(self, after: float = 0.0) -> dict[int, list[int]]:
        """host -> the global ranks of its newest workers started after ``after``."""
        out = {}
        for e in self.events():  # oldest first: a later start replaces an earlier one
            if e["type"] == "workers_started" and e["ts"] > after:
                out[host_of(self.c, e["node"])] = sorted(e["ranks"])
        return out

    def lose_a_host(self, held: Sequence[Path], release: Path, durable: int,
                    timeout_s: float = 240) -> HostLoss:
        """Once every marker in ``held`` exists (the ranks wait at the hold step) and step
        ``durable`` is durable, SIGKILL every process of a training host other than host 0
        and drop its memory; then write ``release`` (also on failure), so that the ranks
        held on the other training host go on, and fail on their lost peer."""
        try:
            def all_held() -> bool:
                for p in self.live():
                    assert p.poll() is None, \
                        f"host {p.host} exited early:\n{self.c.output(p)[-3000:]}"  # type: ignore[attr-defined]
                return all(m.exists() for m in held)

            wait_for(all_held, timeout_s, f"every rank to hold: {[m.name for m in held]}",
                     interval_s=0.1)
            try:
                doc = self.wait_durable(durable)
            except AssertionError as e:
                raise AssertionError(f"{e}: {self.status().get('snapshots')}") from None
            training = sorted(h for h, ranks in self.hosts_with_ranks(doc).items() if ranks)
            assert len(training) == self.c.n - 1, doc["nodes"]
            victim = next(h for h in training if h != 0)
            [spare] = set(range(self.c.n)) - set(training)
            [node] = [n["node_id"] for n in doc["nodes"] if host_of(self.c, n["node_id"]) == victim
                      and not (n["lost"] or n["left"])]
            # Two copies of every shard: the victim's second copy is on one other host.
            coverage = doc["snapshots"]["replica_coverage"][node]
            [holder] = coverage["peers"]
            assert host_of(self.c, holder) != victim, doc["snapshots"]["replica_coverage"]
            ranks = tuple(self.ranks_by_host()[victim])
            t_kill = time.time()
            self.c.kill_host(victim)
        finally:
            release.touch()
        return HostLoss(victim, ranks, spare, holder, doc["snapshots"]["durable_step"], t_kill)

    def restores(self) -> list[dict]:
        """The coordinator's ``restore`` events of steps > 0 (one per resume), oldest first."""
        return [e for e in self.events() if e["type"] == "restore" and e["step"]]

    def check_replica_restore(self, loss: HostLoss, world_size: int) -> int:
        """After ``loss``: the spare started workers, and the job resumed on ``world_size``
        ranks from memory at a step no older than the one durable at the kill. The lost
        host's memory was gone with it: the shards of its ranks came from their replica on
        ``loss.holder``. Returns the step."""
        assert loss.spare in self.ranks_by_host(after=loss.t_kill), \
            f"the spare never started workers: {[e['type'] for e in self.events()]}"
        after = [e for e in self.restores() if e["ts"] > loss.t_kill]
        assert len(after) == 1, after
        [restore] = after
        assert restore["world_size"] == world_size and restore["step"] >= loss.durable, \
            (restore, loss)
        # The event holds the source that the first node's store reported (each node's
        # ranks may have read from elsewhere); never the lost node.
        assert restore["source"].startswith("memory") and \
            self.c.hostname(loss.victim) not in restore["source"], restore
        return int(restore["step"])

    def replica_sources(self, loss: HostLoss) -> dict[int, str]:
        """rank -> where the rank that took over each of the lost host's ranks must say it
        read that rank's shard from: the replica's holder (its own node's store: "memory")."""
        hosts = self.ranks_by_host(after=loss.t_kill)
        where = {r: h for h, ranks in hosts.items() for r in ranks}
        holder = host_of(self.c, loss.holder)
        return {r: "memory" if where[r] == holder else f"memory (from node(s) {loss.holder})"
                for r in loss.victim_ranks}
