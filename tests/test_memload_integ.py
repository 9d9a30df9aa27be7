"""Restores from the job's memory onto another number of ranks, across launchers as nodes.

Four hosts, each a network namespace with an address, a host name and shared memory of its
own (tests/netns.py), run one launcher each of one c10d job, one rank per node, with the
default ``--replicas 2`` (replicas and shard reads go over the rendezvous interface). A
killed host's processes and memory are gone with it.

- 4 → 3: a node is killed under ``--nnodes 3:4``; the three survivors re-rendezvous and
  every rank loads the newest step held in full across the live stores, which is complete
  only thanks to the replica of the lost node's shard, resharded from 4 ranks onto 3 through
  torch.distributed.checkpoint.
- 3 → 4: then a new node joins the running ``--nnodes 3:4`` job; the four ranks reshard
  the three ranks' step.

What is compared: the worker prints, on rank 0, the hashes of the full weights and the full
AdamW state after every step and after its restore. The state the job resumes from on the
new world size must equal, bit for bit, the state the old world size had at that step.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest
from conftest import FULL_MATRIX, free_port, wait_for
from netns import Cluster, cluster_fixture  # noqa: F401  (the fixture)

pytestmark = pytest.mark.integration

WORKER = str(Path(__file__).with_name("fsdp_worker.py"))
STATE = re.compile(r"^(state|restored): step=(\d+) hash=(\w+) optim=(\w+) world=(\d+)$", re.M)


class Nodes:
    """Launchers of one job, one per host of a namespace cluster."""

    def __init__(self, cluster: Cluster, worker_args: list[str]) -> None:
        self.c = cluster
        self.run_id = f"mem-{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.worker_args = worker_args
        self.nodes: list = []

    def start(self, nnodes: str) -> None:
        """Start a node on the next host; the first one hosts the rendezvous store and the
        coordinator (the others start once it does)."""
        i = len(self.nodes)
        self.nodes.append(self.c.ftrun(
            i, "--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{self.c.addr(0)}:{self.port}", "--rdzv-id", self.run_id,
            "--max-restarts", "3", WORKER, *self.worker_args, name=f"node{i}"))
        if i == 0:
            wait_for(lambda: "coordinator of job" in self.c.output(self.nodes[0]), 60,
                     "the first node to host the rendezvous store")

    def output(self) -> str:
        return "\n".join(self.c.output(n) for n in self.nodes)

    def states(self, what: str = "state") -> list[tuple[int, str, str, int]]:
        return [(int(s), h, o, int(w)) for kind, s, h, o, w in STATE.findall(self.output())
                if kind == what]


@pytest.fixture
def job(cluster_factory, request: pytest.FixtureRequest) -> Nodes:
    return Nodes(cluster_factory(5), request.param)


def _check_resumed(nodes: Nodes, old: int, new: int) -> int:
    """The newest restore onto ``new`` ranks resumed with exactly the state ``old`` ranks had
    at that step; returns the step."""
    out = nodes.output()
    restored = [s for s in nodes.states("restored") if s[3] == new]
    assert restored, f"no restore onto {new} ranks\n{out[-6000:]}"
    step, weights, optim, _ = max(restored)
    before = {(h, o) for s, h, o, w in nodes.states() if s == step and w == old}
    assert before, f"step {step} was never reached on {old} ranks\n{out[-6000:]}"
    assert before == {(weights, optim)}, (step, before, weights, optim, out[-6000:])
    return step


@pytest.mark.parametrize("job", [
    pytest.param(["40", "--sleep", "0.3", "--trace", "--ddp"], marks=FULL_MATRIX),
    # ~140 s: a shrink resharded from memory is test_node_loss's two hosts, FSDP2 onto fewer
    # ranks test_reshard_integ's
    pytest.param(["40", "--sleep", "0.3", "--trace"], marks=FULL_MATRIX)],
    ids=["ddp", "fsdp2"], indirect=True)
def test_four_ranks_to_three_after_a_lost_node_and_back_to_four(job: Nodes) -> None:
    for _ in range(4):
        job.start("3:4")
    wait_for(lambda: len([s for s in job.states() if s[3] == 4]) >= 6, 240,
             "six steps on 4 ranks")
    job.c.kill_host(3)  # not the first: it hosts the rendezvous store
    wait_for(lambda: len([s for s in job.states() if s[3] == 3]) >= 4, 240,
             "four steps on 3 ranks after the node was lost")
    _check_resumed(job, 4, 3)
    out = job.output()
    # Complete in memory only thanks to the replica of the lost node's shard: its own
    # memory went with it.
    assert re.search(r"^source: memory, resharded from 4 ranks", out, re.M), out[-6000:]

    job.start("3:4")  # a node joins: the job grows back to 4 ranks
    for node in job.nodes[:3] + job.nodes[4:]:
        assert job.c.wait(node, 240) == 0, job.output()[-6000:]
    _check_resumed(job, 3, 4)
    out = job.output()
    assert re.search(r"^source: memory, resharded from 3 ranks", out, re.M), out[-6000:]
    assert re.search(r"^fsdp: start=\d+ .* world=4$", out, re.M), out[-6000:]
