"""Erasure coding between stores (ftrun.store.ec_store) on loopback: real shard services
serving real shared-memory shards, parity built store to store, a lost node's shards
rebuilt and verified, corrupt pieces refused; and the --redundancy flag."""

from __future__ import annotations

import json
import os
import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from ftrun.coordinator.placement import Redundancy, erasure_placement, parse_redundancy
from ftrun.errors import ConfigError
from ftrun.snapshot import segment as shm
from ftrun.snapshot.manifest import MANIFEST_VERSION
from ftrun.store.catalog import Record
from ftrun.store.ec_store import (
    PARITY_RANK,
    EcSegments,
    ErasureCoding,
    FragmentKey,
    ec_prefix,
    nodes_digest,
    parity_length,
    parity_name,
)
from ftrun.store.erasure import Codec, Encoder, chunk_hashes, slice_hashes, slice_lengths
from ftrun.store.shards import ShardService
from ftrun.store.survey import ask_holdings

CHUNK = 64 << 10  # small chunks: several per shard, quickly
EPOCH = "e1"
STEP = 7


# -- the flag ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "want"), [
    ("replicas:2", Redundancy("replicas", copies=2)),
    ("replicas:1", Redundancy("replicas", copies=1)),
    ("ec:2+1", Redundancy("ec", k=2, m=1)),
    (" EC:3 + 2 ", Redundancy("ec", k=3, m=2)),
])
def test_redundancy_parses(text: str, want: Redundancy) -> None:
    got = parse_redundancy(text)
    assert got == want
    assert parse_redundancy(str(got)) == got


@pytest.mark.parametrize(("text", "says"), [
    ("ec:1+1", "use replicas:2"),
    ("ec:2+0", "M >= 1"),
    ("ec:30+3", "at most 32"),
    ("replicas:0", "M >= 1"),
    ("ec:2", "ec:K+M"),
    ("raid5", "ec:K+M"),
    ("", "ec:K+M"),
])
def test_redundancy_refused_with_the_fix(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says.replace("+", r"\+")):
        parse_redundancy(text)


def test_erasure_coding_needs_k_plus_m_nodes() -> None:
    parse_redundancy("ec:2+1").check_nodes(3)
    with pytest.raises(ConfigError, match=r"needs at least 5 nodes.*ec:2\+2 fits 4 nodes"):
        parse_redundancy("ec:3+2").check_nodes(4)
    with pytest.raises(ConfigError, match=r"at least 3 nodes \(ec:2\+1\)"):
        parse_redundancy("ec:2+1").check_nodes(2)
    Redundancy("replicas", copies=3).check_nodes(1)  # replicas: a one-node job says so later


def _options(*argv: str) -> Any:
    from ftrun.launcher.args import build_parser, check_redundancy, ftrun_options

    ns = build_parser().parse_args([*argv, "train.py"])
    opts = ftrun_options(ns)
    check_redundancy(opts, ns)
    return opts


def test_flag_variable_and_short_form(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FTRUN_REPLICAS", raising=False)
    monkeypatch.delenv("FTRUN_REDUNDANCY", raising=False)
    assert _options().plan() == Redundancy("replicas", copies=2)  # the default
    assert _options("--replicas", "3").plan() == Redundancy("replicas", copies=3)
    assert _options("--nnodes", "4", "--redundancy", "ec:3+1").plan() == \
        Redundancy("ec", k=3, m=1)
    # the same thing said twice is fine; two different things are not
    assert _options("--replicas", "2", "--redundancy", "replicas:2").plan().copies == 2
    with pytest.raises(ConfigError, match="disagree"):
        _options("--replicas", "3", "--redundancy", "ec:2+1", "--nnodes", "3")
    with pytest.raises(ConfigError, match="needs at least 4 nodes"):
        _options("--nnodes", "2:3", "--redundancy", "ec:3+1")
    monkeypatch.setenv("FTRUN_REDUNDANCY", "ec:2+1")
    assert _options("--nnodes", "3").plan() == Redundancy("ec", k=2, m=1)
    monkeypatch.setenv("FTRUN_REDUNDANCY", "mirror")
    with pytest.raises(ConfigError, match="--redundancy must be"):
        _options("--nnodes", "3")


# -- naming and geometry -----------------------------------------------------------------------


def test_fragment_names_round_trip() -> None:
    digest = nodes_digest(["b", "a", "c"])
    assert digest == nodes_digest(["a", "b", "c"]) != nodes_digest(["a", "b"])
    name = parity_name("run", "host/123", digest, 4, 1, 2, 1)
    assert name.startswith(ec_prefix("run"))
    assert FragmentKey.of(name) == FragmentKey(digest, 4, 1, 2, 1)
    assert FragmentKey.of(shm.segment_name("run", 0, 1)) is None


@pytest.mark.parametrize("lengths", [(0, 0), (1, 0), (CHUNK, CHUNK), (3 * CHUNK + 5, 2 * CHUNK),
                                     (7, 3 * CHUNK - 1, 0)])
def test_parity_length_matches_the_encoder(lengths: tuple[int, ...]) -> None:
    codec = Codec(len(lengths), 1)
    hashes = [chunk_hashes(bytes(n), CHUNK) for n in lengths]
    assert parity_length(lengths, CHUNK) == Encoder(codec, lengths, hashes, CHUNK).parity_length


# -- stores on loopback ------------------------------------------------------------------------


@dataclass
class Node:
    """One node: its ranks' shards (segments of its own) served by a real shard service."""

    node_id: str
    shards: EcSegments
    service: ShardService
    ec: ErasureCoding
    data: dict[int, bytes]  # rank -> its shard's bytes

    @property
    def addr(self) -> str:
        return self.service.address

    def stop(self) -> None:
        self.service.stop()
        self.ec.stop(unlink=True)
        self.shards.close(unlink=True)


def _manifest(rank: int, world: int) -> bytes:
    doc = {"v": MANIFEST_VERSION, "step": STEP, "rank": rank, "world_size": world,
           "tensors": [], "note": f"rank {rank}"}
    return json.dumps(doc).encode()


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """4 nodes of one job, one rank each (rank 3's shard shorter than the rest), ec:2+1 over
    all 4 (one group, 4 rotating stripes), or ec:K+M as the test parametrizes it."""
    k, m = getattr(request, "param", (2, 1))
    run_id = f"ecunit-{uuid.uuid4().hex[:8]}"
    secret = os.urandom(32)
    rng = random.Random(5)
    sizes = [3 * CHUNK + 1000, 2 * CHUNK + 17, 3 * CHUNK, CHUNK // 2]
    nodes: dict[str, Node] = {}
    durable: list[tuple[str, int]] = []
    try:
        for rank, size in enumerate(sizes):
            node_id = f"host{rank}/{1000 + rank}"
            shards = EcSegments(run_id, node_id, os.getpid())
            data = rng.randbytes(size)
            shards.write(f"{ec_prefix(run_id)}test-{rank}-shard", origin=node_id, rank=rank,
                         step=STEP, epoch=EPOCH, manifest=_manifest(rank, len(sizes)),
                         hashes=chunk_hashes(data, CHUNK), data=[data], n_tensors=0,
                         chunk_size=CHUNK)
            ec = ErasureCoding(k, m, run_id, node_id, os.getpid(), secret,
                               lambda: (EPOCH, STEP), "127.0.0.1:9",
                               durable=lambda s, n=node_id: durable.append((n, s)))
            service = ShardService(run_id, node_id, os.getpid(), secret,
                                   lambda s=shards, e=ec: [*s.records(), *e.records()],
                                   ec.refused_rebuilds)
            nodes[node_id] = Node(node_id, shards, service, ec, {rank: data})
            service.start("127.0.0.1")
        yield {"run_id": run_id, "secret": secret, "nodes": nodes, "durable": durable,
               "k": k, "m": m}
    finally:
        for n in nodes.values():
            n.stop()
        for path in shm.list_segments(ec_prefix(run_id)):
            path.unlink(missing_ok=True)


def _holdings(c: dict[str, Any], nodes: list[str]) -> list[dict[str, Any]]:
    held, lost = ask_holdings({n: c["nodes"][n].addr for n in nodes}, c["secret"], c["run_id"],
                              "test")
    assert not lost
    return held


def _build_all(c: dict[str, Any]) -> None:
    nodes: dict[str, Node] = c["nodes"]
    stores = {n: x.addr for n, x in nodes.items()}
    placement = erasure_placement(sorted(nodes), c["k"], c["m"])
    records = _holdings(c, sorted(nodes))
    for x in nodes.values():
        x.ec.build(placement, stores, records, EPOCH, STEP)
        assert x.ec.built == (EPOCH, STEP)


def _durable_all(c: dict[str, Any]) -> Any:
    """Every store builds its parity of STEP and finds the step durable; returns the
    placement."""
    nodes: dict[str, Node] = c["nodes"]
    _build_all(c)
    placement = erasure_placement(sorted(nodes), c["k"], c["m"])
    records = _holdings(c, sorted(nodes))
    for x in nodes.values():
        x.ec._check_durable(placement, records, EPOCH, STEP)
    return placement


def test_parity_is_built_store_to_store_and_the_step_becomes_durable(cluster) -> None:
    c = cluster
    nodes: dict[str, Node] = c["nodes"]
    _build_all(c)
    placement = erasure_placement(sorted(nodes), 2, 1)
    records = _holdings(c, sorted(nodes))
    frags = [r for r in records if r["rank"] == PARITY_RANK]
    # every stripe's one parity fragment, at the holder the placement names, verified
    assert sorted((r["node"], FragmentKey.of(r["segment"]).stripe) for r in frags) == sorted(
        (s.parity[0], i) for i, s in enumerate(placement.stripes))
    # each holds about M/K of a node's shard: a slice's worth, not a copy
    for r in frags:
        stripe = placement.stripes[FragmentKey.of(r["segment"]).stripe]
        lengths = [slice_lengths(len(next(iter(nodes[n].data.values()))), 2, CHUNK)[j]
                   for j, n in enumerate(stripe.data)]
        assert r["data_len"] == parity_length(lengths, CHUNK)
    # the parity is what the library codes from the data slices
    codec = Codec(2, 1)
    for r in frags:
        stripe = placement.stripes[FragmentKey.of(r["segment"]).stripe]
        cols, tables = [], []
        for j, n in enumerate(stripe.data):
            data = next(iter(nodes[n].data.values()))
            chunks = [data[i * CHUNK:(i + 1) * CHUNK] for i in range(j, -(-len(data) // CHUNK),
                                                                       2)]
            cols.append(b"".join(chunks))
            tables.append(slice_hashes(chunk_hashes(data, CHUNK), 2)[j])
        enc = Encoder(codec, [len(x) for x in cols], tables, CHUNK)
        for j, col in enumerate(cols):
            for s in range(-(-len(col) // CHUNK)):
                enc.add(j, s, col[s * CHUNK:(s + 1) * CHUNK])
        seg = shm.Segment.open(r["segment"])
        try:
            assert bytes(seg.data()) == bytes(enc.fragments()[0].data)
        finally:
            seg.close()
    # the whole placement holds the step's parity: durable, told once per store
    for x in nodes.values():
        x.ec._check_durable(placement, records, EPOCH, STEP)
        assert x.ec.durable_step == STEP
    assert sorted(c["durable"]) == sorted((n, STEP) for n in nodes)


def test_durable_only_once_every_fragment_is_held(cluster) -> None:
    c = cluster
    nodes: dict[str, Node] = c["nodes"]
    placement = erasure_placement(sorted(nodes), 2, 1)
    stores = {n: x.addr for n, x in nodes.items()}
    records = _holdings(c, sorted(nodes))
    first = nodes[sorted(nodes)[0]]
    first.ec.build(placement, stores, records, EPOCH, STEP)  # one store of four built
    first.ec._check_durable(placement, _holdings(c, sorted(nodes)), EPOCH, STEP)
    assert first.ec.durable_step == -1 and not c["durable"]


def _lose(c: dict[str, Any], node_id: str) -> dict[str, str]:
    nodes: dict[str, Node] = c["nodes"]
    nodes.pop(node_id).stop()
    return {n: x.addr for n, x in nodes.items()}


def test_lost_node_rebuilt_verified_and_served_as_its_shard(cluster) -> None:
    c = cluster
    _build_all(c)
    nodes: dict[str, Node] = c["nodes"]
    victim = sorted(nodes)[1]
    [(rank, original)] = nodes[victim].data.items()
    live = _lose(c, victim)
    rebuilder = nodes[sorted(nodes)[0]]
    rebuilder.ec.rebuild_lost(live, _holdings(c, sorted(live)))
    # listed by the rebuilder's shard service as the lost node's rank's shard of the step
    records = _holdings(c, sorted(live))
    [got] = [r for r in records if r["origin"] == victim]
    assert (got["node"], got["rank"], got["step"], got["epoch"], got["world_size"]) == (
        rebuilder.node_id, rank, STEP, EPOCH, 4)
    seg = shm.Segment.open(got["segment"])
    try:
        h = seg.header()
        assert h.state == shm.VERIFIED and bytes(seg.data(h)) == original
        assert seg.hashes(h) == chunk_hashes(original, CHUNK)
        assert b'"note": "rank 1"' in seg.manifest_bytes(h)
    finally:
        seg.close()
    # a second survey finds it held and rebuilds nothing more
    before = rebuilder.ec.segments.names()
    rebuilder.ec.rebuild_lost(live, records)
    assert rebuilder.ec.segments.names() == before


def _corrupt(name: str, at: int = 10) -> None:
    seg = shm.Segment.open(name)
    try:
        h = seg.header()
        seg.mm[h.data_off + at] ^= 0xFF
    finally:
        seg.close()


def test_corrupt_parity_with_no_other_piece_refuses_the_rebuild(cluster, caplog) -> None:
    """ec:2+1, one node lost: each of its stripes has exactly K = 2 pieces left. A corrupt
    parity fragment leaves one verified piece: the rebuild is refused and nothing is listed
    for the lost node (the restore then falls back), never a wrong shard."""
    c = cluster
    _build_all(c)
    nodes: dict[str, Node] = c["nodes"]
    victim = sorted(nodes)[1]
    placement = erasure_placement(sorted(nodes), 2, 1)
    stripe = placement.stripe_of(victim, 0)
    si = placement.stripes.index(stripe)
    holder = stripe.parity[0]
    [frag] = [r for r in nodes[holder].ec.records() if FragmentKey.of(r.segment).stripe == si]
    _corrupt(frag.segment)
    live = _lose(c, victim)
    rebuilder = nodes[sorted(nodes)[0]]
    rebuilder.ec.rebuild_lost(live, _holdings(c, sorted(live)))
    assert not [r for r in _holdings(c, sorted(live)) if r["origin"] == victim]
    assert "cannot be rebuilt" in caplog.text and "refused: position" in caplog.text


def test_a_refused_rebuild_is_listed_and_the_waiting_stores_stop_at_once(
        cluster, caplog, monkeypatch) -> None:
    """The rebuilder refuses (a corrupt parity fragment) and lists the refusal in its
    holdings; another store waiting for that rebuild stops at once with the rebuilder's
    reason (before: it waited REBUILD_WAIT_S, 30 s per step, while its ranks' peers, already
    told, timed out in their first collective)."""
    from ftrun.store import ec_store

    c = cluster
    _build_all(c)
    nodes: dict[str, Node] = c["nodes"]
    victim = sorted(nodes)[1]
    placement = erasure_placement(sorted(nodes), 2, 1)
    si = placement.stripes.index(placement.stripe_of(victim, 0))
    holder = placement.stripes[si].parity[0]
    [frag] = [r for r in nodes[holder].ec.records() if FragmentKey.of(r.segment).stripe == si]
    _corrupt(frag.segment)
    live = _lose(c, victim)
    rebuilder, other = nodes[sorted(live)[0]], nodes[sorted(live)[2]]
    records = _holdings(c, sorted(live))
    assert rebuilder.ec.rebuild_lost(live, records) == []
    [refusal] = rebuilder.ec.refused_rebuilds()
    assert (refusal["origin"], refusal["step"], refusal["epoch"]) == (victim, STEP, EPOCH)
    assert "refused: position" in refusal["why"], refusal
    monkeypatch.setattr(ec_store, "REBUILD_WAIT_S", 600.0)  # only the refusal ends the wait
    caplog.clear()
    assert other.ec.rebuild_lost(live, records) == []
    assert f"node {rebuilder.node_id}, which rebuilds them, could not:" in caplog.text
    assert "did not list them" not in caplog.text


def test_corrupt_survivor_slice_refuses_the_rebuild(cluster, caplog) -> None:
    c = cluster
    _build_all(c)
    nodes: dict[str, Node] = c["nodes"]
    victim = sorted(nodes)[2]
    placement = erasure_placement(sorted(nodes), 2, 1)
    stripe = placement.stripe_of(victim, 1)
    [partner] = [n for n in stripe.data if n != victim]
    [shard] = [r for r in nodes[partner].shards.records()]
    # chunk 0 of the partner's shard is in its slice 0 (and its stripe position is 0)
    _corrupt(shard.segment, at=5)
    live = _lose(c, victim)
    rebuilder = nodes[sorted(live)[0]]
    rebuilder.ec.rebuild_lost(live, _holdings(c, sorted(live)))
    assert not [r for r in _holdings(c, sorted(live)) if r["origin"] == victim]
    assert "cannot be rebuilt" in caplog.text


def test_two_lost_nodes_of_one_stripe_cannot_be_rebuilt_with_one_parity(cluster, caplog) -> None:
    c = cluster
    _build_all(c)
    nodes: dict[str, Node] = c["nodes"]
    a, b = sorted(nodes)[1:3]
    _lose(c, a)
    live = _lose(c, b)
    rebuilder = nodes[sorted(live)[0]]
    rebuilder.ec.rebuild_lost(live, _holdings(c, sorted(live)))
    assert not [r for r in _holdings(c, sorted(live)) if r["origin"] in (a, b)]
    assert "cannot be rebuilt" in caplog.text


def test_segments_are_removed_at_the_end(cluster) -> None:
    c = cluster
    _build_all(c)
    assert shm.list_segments(ec_prefix(c["run_id"]))
    for n in list(c["nodes"]):
        _lose(c, n)
    assert not shm.list_segments(ec_prefix(c["run_id"]))


def test_records_of_fragments_are_not_shards() -> None:
    rec = Record("x", PARITY_RANK, -1, "n", 1, "e", "verified", 0, CHUNK, [])
    from ftrun.rank import shards

    h = shards.Holding("n", "a", "x", "n", rec.rank, 1, "e", 2, 0, CHUNK)
    assert shards.complete([h]) == []


def test_one_store_rebuilds_the_others_wait_and_list_its_copy(cluster, monkeypatch) -> None:
    """The first live node of the lost node's group rebuilds; another store's survey waits
    for it and lists the rebuilt shard where it is (no second copy). Without the rebuilder
    having done it, the waiting store gives up after REBUILD_WAIT_S and lists nothing."""
    from ftrun.store import ec_store

    c = cluster
    _build_all(c)
    nodes: dict[str, Node] = c["nodes"]
    victim = sorted(nodes)[3]
    live = _lose(c, victim)
    first, other = nodes[sorted(live)[0]], nodes[sorted(live)[2]]
    records = _holdings(c, sorted(live))
    monkeypatch.setattr(ec_store, "REBUILD_WAIT_S", 0.5)
    assert other.ec.rebuild_lost(live, records) == []  # nobody rebuilt it: gave up
    assert first.ec.rebuild_lost(live, records) == []  # rebuilt here: its own holdings list it
    assert [r.origin for r in first.ec.records() if r.rank >= 0] == [victim]
    got = other.ec.rebuild_lost(live, records)
    assert [(r["node"], r["origin"], r["rank"], r["step"]) for r in got] == [
        (first.node_id, victim, 3, STEP)]
    assert not [r for r in other.ec.records() if r.rank >= 0]  # no second copy
    # a later survey that lists it already neither waits nor lists it twice
    assert other.ec.rebuild_lost(live, _holdings(c, sorted(live))) == []


def test_step_whose_parity_was_being_built_is_passed_over_for_the_durable_one(
        cluster, monkeypatch) -> None:
    """A node lost while the parity of a newer step was being built (one store of four had
    built its fragment): the newer step cannot be rebuilt and is passed over at once, by
    every store (none waits for it); the durable step's shards are rebuilt."""
    from ftrun.store import ec_store

    c = cluster
    nodes: dict[str, Node] = c["nodes"]
    placement = _durable_all(c)
    newer = STEP + 1
    rng = random.Random(9)
    for rank, x in enumerate(sorted(nodes.values(), key=lambda n: n.node_id)):
        data = rng.randbytes(2 * CHUNK + 3)
        doc = json.loads(_manifest(rank, 4))
        x.shards.write(f"{ec_prefix(c['run_id'])}test-{rank}-newer", origin=x.node_id,
                       rank=rank, step=newer, epoch=EPOCH,
                       manifest=json.dumps({**doc, "step": newer}).encode(),
                       hashes=chunk_hashes(data, CHUNK), data=[data], n_tensors=0,
                       chunk_size=CHUNK)
    stores = {n: x.addr for n, x in nodes.items()}
    victim = sorted(nodes)[1]
    # the store that had built its fragment holds the parity of one of the victim's stripes
    builder = nodes[placement.stripe_of(victim, 0).parity[0]]
    assert builder.node_id != victim
    builder.ec.build(placement, stores, _holdings(c, sorted(nodes)), EPOCH, newer)
    original = next(iter(nodes[victim].data.values()))
    live = _lose(c, victim)
    waited: list[int] = []
    wait = ec_store.ErasureCoding._await_rebuild

    def spy(self, node, rebuilder, addr, ranks, step, epoch):  # type: ignore[no-untyped-def]
        waited.append(step)
        return wait(self, node, rebuilder, addr, ranks, step, epoch)

    monkeypatch.setattr(ec_store.ErasureCoding, "_await_rebuild", spy)
    records = _holdings(c, sorted(live))
    first, other = nodes[sorted(live)[0]], nodes[sorted(live)[2]]
    assert first.ec.rebuild_lost(live, records) == []
    got = other.ec.rebuild_lost(live, records)
    assert [(r["origin"], r["step"]) for r in got] == [(victim, STEP)]
    assert waited == [STEP]  # never for the step whose parity was incomplete
    [rec] = [r for r in first.ec.records() if r.rank >= 0]
    seg = shm.Segment.open(rec.segment)
    try:
        assert seg.header().step == STEP and bytes(seg.data()) == original
    finally:
        seg.close()


@pytest.mark.parametrize("cluster", [(2, 2)], indirect=True)
def test_two_lost_nodes_rebuilt_under_ec_2_plus_2(cluster) -> None:
    """ec:2+2 on 4 nodes: any two lost, both rebuilt bit for bit from the other two (each
    stripe has exactly K = 2 pieces left), each by the first live node."""
    c = cluster
    _build_all(c)
    nodes: dict[str, Node] = c["nodes"]
    a, b = sorted(nodes)[0], sorted(nodes)[2]
    originals = {n: next(iter(nodes[n].data.items())) for n in (a, b)}
    _lose(c, a)
    live = _lose(c, b)
    first, other = nodes[sorted(live)[0]], nodes[sorted(live)[1]]
    records = _holdings(c, sorted(live))
    assert first.ec.rebuild_lost(live, records) == []
    got = other.ec.rebuild_lost(live, records)
    assert sorted((r["origin"], r["rank"]) for r in got) == sorted(
        (n, rank) for n, (rank, _) in originals.items())
    for r in got:
        seg = shm.Segment.open(r["segment"])
        try:
            assert bytes(seg.data()) == originals[r["origin"]][1]
        finally:
            seg.close()


def test_launcher_refuses_a_code_the_job_cannot_hold(tmp_path) -> None:
    """The user sees the reason and the fix, and the usage exit code, not a traceback; no
    store or worker is started."""
    import subprocess
    import sys

    from ftrun import exit_codes
    from ftrun.testing import TRAIN

    out = subprocess.run([sys.executable, "-m", "ftrun", "--nnodes", "1:3", "--redundancy",
                          "ec:3+1", "--state-dir", str(tmp_path), TRAIN],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == exit_codes.USAGE, out
    assert "ec:3+1 needs at least 4 nodes" in out.stderr and "ec:2+1 fits 3 nodes" in \
        out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_the_node_count_is_checked_once_it_is_known(monkeypatch) -> None:
    """Reading the options does not refuse ec:K+M for want of --nnodes: under Slurm the count
    comes from the allocation later (launch.apply_slurm); check_redundancy, called then, sees
    the final count."""
    from ftrun.launcher.args import build_parser, check_redundancy, ftrun_options

    monkeypatch.delenv("FTRUN_REPLICAS", raising=False)
    for count, ok in (("3", True), ("2:4", True), ("2", False)):
        ns = build_parser().parse_args(["--redundancy", "ec:2+1", "train.py"])
        opts = ftrun_options(ns)  # --nnodes not given: not refused here
        ns.nnodes = count  # as apply_slurm sets it from SLURM_NNODES
        if ok:
            check_redundancy(opts, ns)
        else:
            with pytest.raises(ConfigError, match="needs at least 3 nodes"):
                check_redundancy(opts, ns)



def test_a_survey_with_no_node_lost_rebuilds_and_reads_nothing(cluster, monkeypatch) -> None:
    """Every restore's survey asks: with every node of the placement still listing its
    shards, no fragment is even read."""
    from ftrun.store import ec_store

    c = cluster
    _build_all(c)
    nodes: dict[str, Node] = c["nodes"]
    reads: list[str] = []
    meta = ec_store._Reader.meta

    def spy(self, rec):  # type: ignore[no-untyped-def]
        reads.append(rec["segment"])
        return meta(self, rec)

    monkeypatch.setattr(ec_store._Reader, "meta", spy)
    live = {n: x.addr for n, x in nodes.items()}
    for x in nodes.values():
        assert x.ec.rebuild_lost(live, _holdings(c, sorted(nodes))) == []
        assert not [r for r in x.ec.records() if r.rank >= 0]
    assert reads == []
    # one node lost: its fragments' placement no longer matches the nodes listing shards
    live = _lose(c, sorted(nodes)[0])
    first = nodes[sorted(live)[0]]
    first.ec.rebuild_lost(live, _holdings(c, sorted(live)))
    assert reads and [r.origin for r in first.ec.records() if r.rank >= 0]


# -- what status and inspect show --------------------------------------------------------------

SNAPS = {"committed_step": 9, "redundancy": "ec:2+1", "parity_durable_step": 8,
         "parity": {"vm/1": {"built_step": 9, "durable_step": 8, "parity_bytes": 4_200_000,
                             "rebuilt_bytes": 0},
                    "vm/2": {"built_step": 8, "durable_step": 8, "parity_bytes": 4_200_000,
                             "rebuilt_bytes": 5_600_000},
                    "vm/3": {"built_step": -1, "durable_step": -1, "parity_bytes": 0,
                             "rebuilt_bytes": 0}}}


def test_status_line_shows_the_code_and_the_parity() -> None:
    from ftrun.cli.status import _replica_text

    assert _replica_text(SNAPS) == (" | ec:2+1: durable step 8 (parity of step 9 built on 1/3 "
                                    "node(s); 8.4 MB of parity, 5.6 MB rebuilt)")
    none = {**SNAPS, "parity_durable_step": None,
            "parity": {"vm/1": {**SNAPS["parity"]["vm/3"]}}}
    assert _replica_text(none) == " | ec:2+1: nothing durable yet (no parity built yet)"


def test_inspect_shows_parity_per_node() -> None:
    from rich.console import Console

    from ftrun.cli.inspect import _durability, _render_durability

    d = _durability({"snapshots": SNAPS})
    assert d == {"redundancy": "ec:2+1", "committed_step": 9, "durable_step": 8,
                 "parity": SNAPS["parity"]}
    console = Console(record=True, width=120)
    _render_durability(d, console)
    text = console.export_text()
    assert "committed step 9; durable step 8; ec:2+1 (erasure-coded parity)" in text
    assert [ln.split() for ln in text.splitlines()[2:]] == [
        ["vm/1", "9", "4.2", "0.0"], ["vm/2", "8", "4.2", "5.6"], ["vm/3", "-", "0.0", "0.0"]]


def test_coordinator_reports_the_code_and_each_stores_parity() -> None:
    """A real coordinator, stores reporting as an ec:2+1 job's do: its status names the code,
    the newest step the placement holds in full, and each node's parity."""
    from ftrun.coordinator.server import Coordinator
    from ftrun.protocol.transport import Client

    run_id = f"ecstat-{uuid.uuid4().hex[:8]}"
    secret = os.urandom(32)
    coord = Coordinator(run_id, secret, bind_host="127.0.0.1", node_timeout_s=600.0)
    coord.start()
    clients = []
    try:
        for i, (built, durable) in enumerate([(9, 8), (8, 8), (-1, -1)]):
            c = Client(coord.endpoint, secret, run_id, f"store:vm/{i}", peer="coordinator")
            clients.append(c)
            c.request("store_report", {
                "node_id": f"vm/{i}", "bytes": 0, "segments": 0, "persisted_step": None,
                "ranks": [i], "redundancy": "ec:2+1", "parity_step": built,
                "parity_durable": durable, "parity_bytes": 1000 * (built > 0),
                "rebuilt_bytes": 0}, "ack", 5.0)
        reply = clients[0].request("status_request", {}, "status_reply", 5.0)
        snaps = reply.body["doc"]["snapshots"]
        assert snaps["redundancy"] == "ec:2+1" and snaps["parity_durable_step"] == 8
        assert snaps["parity"]["vm/0"] == {"built_step": 9, "durable_step": 8,
                                           "parity_bytes": 1000, "rebuilt_bytes": 0}
        assert snaps["parity"]["vm/2"]["built_step"] == -1
    finally:
        for c in clients:
            c.close()
        coord.stop(timeout_s=2)


@pytest.mark.parametrize("cluster", [(3, 2)], indirect=True)
def test_too_few_nodes_hold_the_step_parity_is_off_and_nothing_waits_for_it(
        cluster, monkeypatch, caplog) -> None:
    """ec:3+2 with 4 nodes holding the step (the job shrank): no parity is built, the store
    says so, and it is told to stop keeping buffers for parity (the ranks' snapshots go on)."""
    c = cluster
    nodes: dict[str, Node] = c["nodes"]
    x = next(iter(nodes.values()))
    offs: list[bool] = []
    x.ec._off = lambda: offs.append(True)
    monkeypatch.setattr(x.ec, "_stores", lambda: {n: y.addr for n, y in nodes.items()})
    x.ec.work()
    assert offs == [True] and x.ec.built == ("", -1) and not x.ec.records()
    assert "4 node(s) hold step 7; ec:3+2 needs 5" in caplog.text


def test_parity_off_releases_the_kept_buffers() -> None:
    """The store's commit mirror under ec:K+M: from the epoch's start the step resumed from
    is kept; a durable step is kept until a newer one is durable; parity off: nothing kept."""
    from ftrun.store.commits import DURABLE_KEEP_S, CommitMirror

    assert DURABLE_KEEP_S > 1
    cfg = type("Cfg", (), {"node_id": "n"})()
    persister = type("P", (), {"new_epoch": lambda self, restarted: None})()
    mirror = CommitMirror(cfg, None, None, persister)  # type: ignore[arg-type]
    mirror.erasure = True
    mirror.begin_epoch("e", 3, restarted=True)
    mirror.committed = 5
    assert mirror.durable_step() == 3
    assert mirror.claim("e", 5) is None  # step 3 kept: 5 is not durable
    mirror.note_parity_durable(5)
    assert mirror.claim("e", 5) is not None and mirror.durable_step() == 5
    mirror.committed = 6
    assert mirror.claim("e", 6) is None
    mirror.parity_off()
    assert mirror.claim("e", 6) is not None and mirror.durable_step() == -1


@pytest.mark.parametrize("cluster", [(2, 2)], indirect=True)
def test_a_lost_node_after_a_durable_step_keeps_the_buffers(cluster, monkeypatch) -> None:
    """Once a step of the epoch was durable, too few nodes holding the next one means a node
    is being lost: the ranks' buffers of the durable step stay kept (parity not called off),
    whether the lost store still counts as live (it does not answer) or is gone from the
    coordinator's list already. (Calling it off there let the survivors overwrite the very
    shards the rebuild needs: seen in tests/test_ec_integ.py.)"""
    c = cluster
    nodes: dict[str, Node] = c["nodes"]
    _durable_all(c)
    victim = sorted(nodes)[3]
    every = {n: x.addr for n, x in nodes.items()}
    live = _lose(c, victim)
    x = nodes[sorted(live)[0]]
    offs: list[bool] = []
    x.ec._off = lambda: offs.append(True)
    x.ec.built = ("", -1)  # as if a newer step had committed: work() looks again
    for stores in (every, live):  # the lost store listed (not answering), then not listed
        monkeypatch.setattr(x.ec, "_stores", lambda s=stores: dict(s))
        x.ec.work()
    assert offs == []


def test_a_restarted_store_removes_what_its_predecessor_left() -> None:
    """A store that crashed left its fragments and rebuilt shards in shared memory; the store
    its launcher starts next removes them (not listed, and outside the job prefix nothing
    else frees them before the job ends), and leaves other nodes' alone."""
    run_id = f"ecleft-{uuid.uuid4().hex[:8]}"
    node, other = "hostx/1", "hosty/2"
    data = b"x" * 1000
    left = EcSegments(run_id, node, os.getpid())
    theirs = EcSegments(run_id, other, os.getpid())
    manifest = _manifest(0, 2)
    try:
        for segs, holder in ((left, node), (theirs, other)):
            segs.write(parity_name(run_id, holder, "0" * 8, 0, 0, 0, 0), origin=holder,
                       rank=PARITY_RANK, step=3, epoch=EPOCH, manifest=manifest,
                       hashes=chunk_hashes(data, CHUNK), data=[data], n_tensors=0,
                       chunk_size=CHUNK)
        left.close(unlink=False)  # the crashed store: its segments stay
        ec = ErasureCoding(2, 1, run_id, node, os.getpid(), b"s" * 32, lambda: ("", -1),
                           "127.0.0.1:9")
        try:
            assert ec.remove_leftovers() == 1
            assert [p.name for p in shm.list_segments(ec_prefix(run_id))] == theirs.names()
        finally:
            ec.stop(unlink=True, timeout_s=1)
    finally:
        theirs.close(unlink=True)
        for path in shm.list_segments(ec_prefix(run_id)):
            path.unlink(missing_ok=True)
