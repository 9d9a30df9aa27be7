"""Replicas between real stores: three launchers on localhost with --replicas 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import ROOT, TRAIN, Procs, free_port, read_events, wait_for

from ftrun import jobs
from ftrun.protocol.transport import Client
from ftrun.snapshot import segment as shm
from ftrun.store.catalog import replica_prefix

pytestmark = [pytest.mark.integration]


def _status(run_id: str) -> dict | None:
    out = subprocess.run([sys.executable, "-m", "ftrun", "status", run_id, "--json"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    if out.returncode not in (0, 3):
        return None
    return json.loads(out.stdout)


def _catalogs(run_id: str, secret: bytes) -> dict[str, list[dict]]:
    """node -> the replicas its store holds (records whose origin is another node)."""
    out = {}
    for store in jobs.store_urls(run_id):
        client = Client(store["url"], secret, run_id, "test", peer="store")
        try:
            reply = client.request("catalog_request", {"replicas": True}, "catalog_reply", 10.0)
        finally:
            client.close()
        out[store["node_id"]] = [r for r in reply.body["records"]
                                 if r["origin"] != store["node_id"]]
    return out


def test_replicas_land_verified_on_peers_and_steps_become_durable(
        procs: Procs, state_dir: Path) -> None:
    run_id = f"repl-{uuid.uuid4().hex[:8]}"
    port = free_port()
    nodes = [procs.ftrun(
        "--nnodes", "3", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, "--replicas", "2",
        "--replica-addr", "127.0.0.1", TRAIN, "--steps", "400", "--step-sleep", "0.2", "--batch", "6", "--snapshot-every", "1",
        name=f"node{i}") for i in range(3)]

    def durable() -> dict | None:
        for node in nodes:
            assert node.poll() is None, f"a launcher exited:\n{procs.output(node)[-3000:]}"
        doc = _status(run_id)
        snaps = (doc or {}).get("snapshots") or {}
        return doc if snaps.get("durable_step") and len(snaps.get("replica_coverage", {})) == 3 \
            else None

    first = wait_for(durable, 120, "a durable step with 3 nodes' stores", interval_s=1)
    snaps = first["snapshots"]
    assert snaps["replicas"] == 2 and snaps["durable_step"] <= snaps["committed_step"]
    coverage = snaps["replica_coverage"]
    # 3 nodes, 2 copies: one ring of 3, every node sends to one peer and holds one replica
    assert all(len(c["peers"]) == 1 for c in coverage.values())
    assert sorted(c["peers"][0] for c in coverage.values()) == sorted(coverage)
    assert all(node not in c["peers"] for node, c in coverage.items())

    # durable_step advances while training goes on, and every sender reports its work
    def advanced() -> dict | None:
        d = _status(run_id)
        s = (d or {}).get("snapshots") or {}
        return d if ((s.get("durable_step") or 0) > snaps["durable_step"] and all(
            c["sent"] > 0 for c in s["replica_coverage"].values())) else None

    later = wait_for(advanced, 60, "durable_step to advance", interval_s=1)
    assert later["snapshots"]["durable_step"] <= later["snapshots"]["committed_step"]
    assert all(c["replicated_step"] for c in later["snapshots"]["replica_coverage"].values())

    # Every peer's catalog holds verified replicas of the other nodes' ranks, of committed
    # steps, with the node that sent them as origin.
    secret = jobs.load_secret(run_id, create=False)
    catalogs = _catalogs(run_id, secret)
    assert len(catalogs) == 3
    # The committed step as of after the catalogs were read: training goes on meanwhile (on a
    # loaded machine the catalogs took long enough to hold steps committed after `later`).
    after = wait_for(lambda: _status(run_id), 30, "the job's status")
    committed = after["snapshots"]["committed_step"]
    ranks_of = {n["node_id"]: n["ranks"] for n in later["nodes"]}
    for holder, recs in catalogs.items():
        good = [r for r in recs if r["state"] == "verified"]
        assert good, f"{holder} holds no verified replica: {recs}"
        for r in good:
            assert r["origin"] != holder and r["origin"] in catalogs
            assert r["rank"] in ranks_of[r["origin"]] and 0 < r["step"] <= committed + 2
            assert r["hashes"] and r["segment"].startswith(replica_prefix(run_id))
        # at most the two newest steps per (origin, rank)
        assert len(recs) <= 2 * len({(r["origin"], r["rank"]) for r in recs})
    held_origins = {r["origin"] for recs in catalogs.values() for r in recs
                    if r["state"] == "verified"}
    assert held_origins == set(catalogs)  # every node's shards are replicated somewhere

    table = subprocess.run([sys.executable, "-m", "ftrun", "status", run_id],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "durable step" in table.stdout, table.stdout

    # A graceful stop removes the replicas with the job's other segments.
    for node in nodes:
        node.send_signal(signal.SIGTERM)
    for node in nodes:
        procs.wait(node, 60)
    assert not shm.list_segments(replica_prefix(run_id))
    logs = "".join(procs.output(n) for n in nodes)
    assert "Traceback" not in logs, logs[-4000:]


def test_one_node_job_says_replicas_are_off_and_durable_is_not_applicable(
        procs: Procs, state_dir: Path) -> None:
    run_id = f"repl1-{uuid.uuid4().hex[:8]}"
    port = free_port()
    # The default --replicas (2), one node: there is no peer to hold a replica.
    node = procs.ftrun("--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, TRAIN,
                       "--steps", "400", "--step-sleep", "0.1", "--snapshot-every", "1",
                       name="node0")

    def committed() -> dict | None:
        assert node.poll() is None, f"the launcher exited:\n{procs.output(node)[-3000:]}"
        doc = _status(run_id)
        snaps = (doc or {}).get("snapshots") or {}
        return doc if snaps.get("committed_step") and snaps.get("replica_nodes") else None

    doc = wait_for(committed, 120, "a committed step", interval_s=1)
    snaps = doc["snapshots"]
    assert snaps["replicas"] == 2 and snaps["replica_nodes"] == 1
    assert snaps["durable_off"] == "one node: no peer node to hold replicas"
    assert snaps["durable_step"] is None and snaps["durable_lag_steps"] is None
    table = subprocess.run([sys.executable, "-m", "ftrun", "status", run_id],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "durable n/a: one node" in table.stdout, table.stdout
    node.send_signal(signal.SIGTERM)
    procs.wait(node, 60)
    logs = procs.output(node)
    assert logs.count("replicas are off: one node: no peer node") == 1, logs[-4000:]
    assert "Traceback" not in logs, logs[-4000:]


def test_a_restarted_store_adopts_the_replicas_it_held(procs: Procs, state_dir: Path) -> None:
    run_id = f"repl-{uuid.uuid4().hex[:8]}"
    port = free_port()
    nodes = [procs.ftrun(
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
        "--replica-addr", "127.0.0.1", TRAIN, "--steps", "400", "--step-sleep", "0.2",
        "--snapshot-every", "1", name=f"node{i}") for i in range(2)]

    def durable() -> dict | None:
        for node in nodes:
            assert node.poll() is None, f"a launcher exited:\n{procs.output(node)[-3000:]}"
        doc = _status(run_id)
        return doc if ((doc or {}).get("snapshots") or {}).get("durable_step") else None

    wait_for(durable, 120, "a durable step", interval_s=1)
    started = [e for e in read_events(state_dir, run_id) if e["type"] == "store_started"]
    victim = started[0]
    secret = jobs.load_secret(run_id, create=False)
    held = [r for r in _catalogs(run_id, secret)[victim["node"]] if r["state"] == "verified"]
    assert held, "the store held no verified replica before it was killed"
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for(lambda: [e for e in read_events(state_dir, run_id)
                      if e["type"] == "store_restarted" and e["node"] == victim["node"]],
             60, "the launcher to restart the store", interval_s=0.5)
    wait_for(lambda: any("adopted" in procs.output(n) and "replica(s) a previous store"
                         in procs.output(n) for n in nodes), 60, "the new store to adopt",
             interval_s=0.5)
    logs = "".join(procs.output(n) for n in nodes)
    adopted = [ln for ln in logs.splitlines() if "replica(s) a previous store" in ln]
    assert adopted and "adopted 0 " not in adopted[0], adopted
    # The new store serves them (catalog) and durable goes on advancing.
    after = _catalogs(run_id, secret)[victim["node"]]
    assert any(r["state"] == "verified" for r in after), after
    before = durable()["snapshots"]["durable_step"]  # type: ignore[index]
    wait_for(lambda: (((_status(run_id) or {}).get("snapshots") or {}).get("durable_step")
                      or 0) > before, 60, "durable_step to advance after the restart",
             interval_s=1)
    for node in nodes:
        node.send_signal(signal.SIGTERM)
    for node in nodes:
        procs.wait(node, 60)
    assert not shm.list_segments(replica_prefix(run_id))
