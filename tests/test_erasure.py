"""Erasure coding (ftrun.store.erasure) and its placement (ftrun.coordinator.placement).

Small chunks and coding units (bytes, not MiB) so that every size class (empty, under a chunk,
exactly a chunk, many chunks and a partial one, several units per chunk and a partial unit)
and every set of lost positions is exercised in a few seconds; one test runs at the store's
real chunk size.
"""

from __future__ import annotations

import itertools
import random

import pytest

from ftrun.coordinator.placement import (
    ErasurePlacement,
    erasure_placement,
    node_ids,
    recovery_probability,
)
from ftrun.errors import ConfigError, IntegrityError, RestoreError
from ftrun.snapshot.segment import CHUNK_BYTES
from ftrun.store import erasure as ec

C = 1024  # chunk size of these tests
UNIT = 300  # coding unit: three full units and a partial one per full chunk
SIZES = [0, 1, 100, C - 1, C, C + 1, 3 * C, 5 * C + 37]
CODES = [(k, m) for k in (2, 3, 4) for m in (1, 2)]


def _bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _codec(k: int, m: int) -> ec.Codec:
    return ec.Codec(k, m, unit=UNIT)


def _flip(b: bytes, at: int) -> bytes:
    out = bytearray(b)
    out[at] ^= 0x40
    return bytes(out)


@pytest.mark.parametrize(("k", "m"), CODES)
def test_every_size_and_every_loss_of_up_to_m_positions(k: int, m: int) -> None:
    codec = _codec(k, m)
    cases = 0
    for shift in range(len(SIZES)):
        lengths = [SIZES[(shift + 3 * j) % len(SIZES)] for j in range(k)]
        slices = [_bytes(n, 1000 * shift + j) for j, n in enumerate(lengths)]
        frags = ec.encode(codec, slices, C)
        assert [f.index for f in frags] == list(range(m))
        info = ec.stripe_info(frags)
        assert info.lengths == tuple(lengths)
        assert all(len(f.data) == info.length(k + f.index) for f in frags)
        # parity is laid out like a shard: full chunks, the last one as wide as the widest piece
        if max(lengths):
            assert info.length(k) == (info.chunks - 1) * C + info.width(info.chunks - 1)
        columns = {**dict(enumerate(slices)), **{f.position: f.data for f in frags}}
        for lost in range(1, m + 1):
            for gone in itertools.combinations(range(k + m), lost):
                have = {p: col for p, col in columns.items() if p not in gone}
                got = ec.rebuild(codec, info, have, gone)
                assert got == {p: columns[p] for p in gone}, (lengths, gone)
                cases += 1
    assert cases == len(SIZES) * sum(len(list(itertools.combinations(range(k + m), x)))
                                     for x in range(1, m + 1))


def test_all_empty_stripe() -> None:
    codec = _codec(3, 2)
    frags = ec.encode(codec, [b"", b"", b""], C)
    assert [f.data for f in frags] == [b"", b""]
    info = frags[0].info
    assert info.chunks == 0 and info.hashes == ((),) * 5
    assert ec.rebuild(codec, info, {2: b"", 3: b"", 4: b""}, [0, 1]) == {0: b"", 1: b""}


def test_padding_is_recorded_and_parity_differs_from_zero() -> None:
    codec = _codec(2, 1)
    a, b = _bytes(2 * C + 10, 1), _bytes(5, 2)
    (p,) = ec.encode(codec, [a, b], C)
    info = p.info
    assert info.chunks == 3 and [info.width(s) for s in range(3)] == [C, C, 10]
    assert [info.padding(1, s) for s in range(3)] == [C - 5, C, 10]
    assert [info.padding(0, s) for s in range(3)] == [0, 0, 0]
    assert len(p.data) == 2 * C + 10 and p.data != bytes(len(p.data))


def test_real_chunk_size_and_default_unit() -> None:
    codec = ec.Codec(3, 2)
    lengths = [2 * CHUNK_BYTES + 12345, CHUNK_BYTES, 0]
    slices = [_bytes(n, j) for j, n in enumerate(lengths)]
    frags = ec.encode(codec, slices)
    info = frags[0].info
    assert info.chunk_size == CHUNK_BYTES and info.unit == ec.UNIT_BYTES
    got = ec.rebuild(codec, info, {1: slices[1], 2: slices[2], 4: frags[1].data}, [0, 3])
    assert got == {0: slices[0], 3: frags[0].data}
    got = ec.rebuild(codec, info, {2: slices[2], 3: frags[0].data, 4: frags[1].data}, [0, 1])
    assert got == {0: slices[0], 1: slices[1]}


def test_encoder_chunk_by_chunk_in_any_order() -> None:
    codec = _codec(3, 2)
    slices = [_bytes(n, 7 + j) for j, n in enumerate([4 * C + 5, 0, 2 * C])]
    hashes = [ec.chunk_hashes(s, C) for s in slices]
    enc = ec.Encoder(codec, [len(s) for s in slices], hashes, C)
    order = [(j, s) for j, col in enumerate(slices) for s in range(len(hashes[j]))]
    random.Random(3).shuffle(order)
    coded = 0
    for j, s in order:
        assert not enc.complete
        with pytest.raises(RestoreError, match="incomplete"):
            enc.fragments()
        coded += enc.add(j, s, slices[j][s * C:(s + 1) * C])
        assert not enc.add(j, s, slices[j][s * C:(s + 1) * C])  # again: checked, ignored
    assert enc.complete and enc.missing() == [] and coded == 5  # chunks 0..4 of the stripe
    assert enc.fragments() == ec.encode(codec, slices, C)


def test_parity_and_rebuilt_columns_go_into_given_buffers() -> None:
    codec = _codec(2, 2)
    slices = [_bytes(3 * C + 11, 1), _bytes(C, 2)]
    plain = ec.encode(codec, slices, C)
    size = plain[0].info.length(2)
    bufs = [bytearray(b"\xff" * (size + 7)) for _ in range(2)]
    frags = ec.encode(codec, slices, C, into=bufs)
    assert frags == plain and all(b[:size] == f.data for b, f in zip(bufs, frags, strict=True))
    assert all(b[size:] == b"\xff" * 7 for b in bufs)  # nothing written past the fragment
    target = bytearray(b"\xee" * len(slices[0]))
    got = ec.rebuild(codec, frags[0].info, {1: slices[1], 3: frags[1].data}, [0, 2],
                     into={0: target})
    assert got[0].obj is target and target == slices[0] and got[2] == frags[0].data
    with pytest.raises(ValueError, match="needs 3083 writable"):
        ec.rebuild(codec, frags[0].info, {1: slices[1], 3: frags[1].data}, [0],
                   into={0: memoryview(bytes(len(slices[0])))})
    with pytest.raises(ValueError, match="2 buffers of 3083 bytes"):
        ec.encode(codec, slices, C, into=[bytearray(size - 1), bytearray(size)])


def test_encoder_refuses_pieces_that_do_not_verify() -> None:
    codec = _codec(2, 1)
    a, b = _bytes(2 * C, 1), _bytes(C, 2)
    enc = ec.Encoder(codec, [len(a), len(b)], [ec.chunk_hashes(a, C), ec.chunk_hashes(b, C)], C)
    with pytest.raises(IntegrityError, match=r"data slice 0 chunk 1: xxh3 .* != recorded"):
        enc.add(0, 1, _flip(a[C:], 3))
    with pytest.raises(IntegrityError, match="data slice 1 chunk 0: 1023 bytes, expected 1024"):
        enc.add(1, 0, b[:-1])
    with pytest.raises(ValueError, match="no chunk 1"):
        enc.add(1, 1, b"x")
    assert enc.missing() == [(0, 0), (0, 1), (1, 0)]  # nothing refused was kept


@pytest.mark.parametrize("corrupt", ["data", "parity"])
def test_corrupt_piece_is_refused_when_it_would_be_needed(corrupt: str) -> None:
    codec = _codec(3, 1)
    slices = [_bytes(3 * C + 9, j) for j in range(3)]
    (p,) = ec.encode(codec, slices, C)
    have: dict[int, bytes] = {1: slices[1], 2: slices[2], 3: p.data}
    if corrupt == "data":
        have[2] = _flip(have[2], 2 * C + 5)  # chunk 2 of slice 2
        where = "position 2"
    else:
        have[3] = _flip(have[3], C + 1)  # chunk 1 of the parity
        where = "position 3"
    with pytest.raises(IntegrityError, match=rf"chunk \d of the stripe: 2 verified pieces of "
                                             rf"the 3 needed .*refused: {where}: xxh3"):
        ec.rebuild(codec, p.info, have, [0])


def test_corrupt_piece_is_passed_over_when_others_remain(
        caplog: pytest.LogCaptureFixture) -> None:
    codec = _codec(2, 2)
    slices = [_bytes(2 * C + 1, 5), _bytes(C + 7, 6)]
    p0, p1 = ec.encode(codec, slices, C)
    # lose slice 0; slice 1's chunk 1 is corrupt, but both parity fragments are there
    have = {1: _flip(slices[1], C + 3), 2: p0.data, 3: p1.data}
    with caplog.at_level("WARNING", logger="ftrun.store.erasure"):
        assert ec.rebuild(codec, p0.info, have, [0]) == {0: slices[0]}
    # and says so, for that chunk only
    assert [r.getMessage()[:42] for r in caplog.records] == [
        "chunk 1 of the stripe: position 1: xxh3 0x"]
    # wrong length counts as unusable too
    have = {1: slices[1][:-1], 2: p0.data, 3: p1.data}
    assert ec.rebuild(codec, p0.info, have, [0]) == {0: slices[0]}


def test_consistent_but_foreign_parity_is_never_decoded_into_a_wrong_result() -> None:
    # A parity fragment that matches its own hashes but was coded from other bytes (a stale
    # step's, say) decodes to bytes that do not match the lost slice's hash: refused.
    codec = _codec(2, 1)
    ours = [_bytes(C + 50, 1), _bytes(C + 50, 2)]
    theirs = [_bytes(C + 50, 3), ours[1]]
    (p_ours,) = ec.encode(codec, ours, C)
    (p_theirs,) = ec.encode(codec, theirs, C)
    info = p_ours.info
    forged = ec.StripeInfo(info.k, info.m, info.chunk_size, info.unit, info.backend,
                           info.lengths, (*info.hashes[:2], p_theirs.info.hashes[2]))
    with pytest.raises(IntegrityError, match=r"rebuilt position 0 chunk 0: xxh3 .* not used"):
        ec.rebuild(codec, forged, {1: ours[1], 2: p_theirs.data}, [0])
    with pytest.raises(IntegrityError, match="disagree"):
        ec.stripe_info([p_ours, ec.ParityFragment(forged, 0, p_theirs.data)])


def test_too_few_pieces_and_mismatched_codec_are_refused() -> None:
    codec = _codec(3, 1)
    slices = [_bytes(C, j) for j in range(3)]
    (p,) = ec.encode(codec, slices, C)
    with pytest.raises(RestoreError, match=r"2 verified pieces of the 3 needed \(absent: "
                                           r"positions \[0, 1\]\)"):
        ec.rebuild(codec, p.info, {2: slices[2], 3: p.data}, [0, 1])
    with pytest.raises(IntegrityError, match="in units of 300, decoder .* units of 299"):
        ec.rebuild(ec.Codec(3, 1, unit=299), p.info, {1: slices[1], 2: slices[2], 3: p.data}, [0])
    with pytest.raises(IntegrityError, match="decoder is ec:3\\+2"):
        ec.rebuild(_codec(3, 2), p.info, {1: slices[1], 2: slices[2], 3: p.data}, [0])
    with pytest.raises(ValueError, match="both given and wanted"):
        ec.rebuild(codec, p.info, {0: slices[0], 1: slices[1], 3: p.data}, [0])
    with pytest.raises(RestoreError, match="no parity fragment"):
        ec.stripe_info([])
    with pytest.raises(ConfigError, match="not available here"):
        ec.Codec(2, 1, backend="no_such_backend")


@pytest.mark.parametrize("nbytes", SIZES)
def test_slices_of_a_node(nbytes: int) -> None:
    data = _bytes(nbytes, nbytes)
    for k in (2, 3, 4):
        chunks = ec.slice_chunks(data, k, C)
        cols = [b"".join(c) for c in chunks]
        assert [len(c) for c in cols] == ec.slice_lengths(nbytes, k, C)
        assert ec.join_slices(cols, k, C) == data
        assert ec.slice_hashes(ec.chunk_hashes(data, C), k) == [
            tuple(ec.chunk_hashes(c, C)) for c in cols]
        # only the slice holding the node's last chunk may end with a partial chunk
        assert all(len(c) % C == 0 for j, c in enumerate(cols)
                   if j != (max(1, -(-nbytes // C)) - 1) % k)


# ---- placement --------------------------------------------------------------------------------

def _check_invariants(p: ErasurePlacement, n: int) -> None:
    k, m = p.k, p.m
    nodes = node_ids(n)
    assert sorted(x for g in p.groups for x in g) == nodes  # disjoint, cover every node
    sizes = [len(g) for g in p.groups]
    assert min(sizes) >= k + m and max(sizes) - min(sizes) <= 1
    group_of = {x: g for g, members in enumerate(p.groups) for x in members}
    for s in p.stripes:
        members = [*s.data, *s.parity]
        assert len(set(members)) == k + m  # a stripe spans K + M distinct nodes ...
        assert {group_of[x] for x in members} == {s.group}  # ... of one group
    for x in nodes:
        # each slice of each node in exactly one stripe, at its own data position
        assert [sum(s.data[j] == x for s in p.stripes) for j in range(k)] == [1] * k
        assert p.stripe_of(x, k - 1).data[k - 1] == x
        assert len(p.held_by(x)) == m  # parity of M stripes


@pytest.mark.parametrize(("k", "m"), CODES)
@pytest.mark.parametrize("extra", [0, 1, 3, 7])
def test_placement_invariants(k: int, m: int, extra: int) -> None:
    n = 2 * (k + m) + extra
    p = erasure_placement(node_ids(n), k, m)
    _check_invariants(p, n)
    assert len(p.groups) == n // (k + m)
    assert p == erasure_placement(list(node_ids(n)), k, m)  # deterministic


def test_placement_shapes_and_refusals() -> None:
    p = erasure_placement(node_ids(3), 2, 1)
    assert p.groups == (tuple(node_ids(3)),)
    a, b, c = node_ids(3)
    # stripe r: parity on g[r], data slices j from g[r+1+j]
    assert [(s.parity, s.data) for s in p.stripes] == [
        ((a,), (b, c)), ((b,), (c, a)), ((c,), (a, b))]
    # 11 nodes in groups of 3: 3 groups, the remainder of 2 spread over the last two
    assert [len(g) for g in erasure_placement(node_ids(11), 2, 1).groups] == [3, 4, 4]
    with pytest.raises(ConfigError, match="needs at least 6 nodes .* the job has 5"):
        erasure_placement(node_ids(5), 4, 2)
    with pytest.raises(ConfigError, match="K >= 2"):
        erasure_placement(node_ids(4), 1, 1)
    with pytest.raises(ConfigError, match="M >= 1"):
        erasure_placement(node_ids(4), 3, 0)
    with pytest.raises(ConfigError, match="at most 32"):
        erasure_placement(node_ids(40), 30, 3)
    with pytest.raises(ConfigError, match="sorted"):
        erasure_placement(["b", "a", "c"], 2, 1)
    with pytest.raises(ConfigError, match="not in this erasure placement"):
        p.stripe_of("node9999", 0)


@pytest.mark.parametrize(("k", "m"), CODES)
def test_each_node_holds_m_over_k_of_its_own_bytes_in_parity(k: int, m: int) -> None:
    n = k + m + 2
    p = erasure_placement(node_ids(n), k, m)
    nbytes = 6 * k * C  # a whole number of chunks per slice: exact shares
    data = {x: _bytes(nbytes, i) for i, x in enumerate(p.nodes)}
    parity = ec.encode_nodes(_codec(k, m), p, data, C)
    for x in p.nodes:
        held = sum(len(f.data) for f in parity[x].values())
        assert held * k == nbytes * m


def test_survival_by_formula() -> None:
    # one group of exactly K + M: any M losses survive, any M + 1 do not
    for k, m in CODES:
        p = erasure_placement(node_ids(k + m), k, m)
        assert [recovery_probability(p, f).probability for f in range(m + 2)] == \
            [1.0] * (m + 1) + [0.0]
    # two groups of 3 (ec:2+1): 2 losses are fatal iff in one group: 2 * C(3,2) of C(6,2)
    p = erasure_placement(node_ids(6), 2, 1)
    assert recovery_probability(p, 2).probability == pytest.approx(1 - 6 / 15)


@pytest.mark.parametrize(("k", "m", "n"), [(2, 1, 7), (2, 2, 9), (3, 1, 9)])
def test_rebuild_nodes_matches_the_survival_rule_for_every_loss_set(k: int, m: int,
                                                                     n: int) -> None:
    # Every loss set of up to M + 1 nodes: the codec rebuilds the lost nodes bit-identical
    # exactly when the placement's survival rule says the step survives.
    p = erasure_placement(node_ids(n), k, m)
    sizes = [0, 1, C, 2 * C + 3, 7 * C + 100, C - 1, 3 * C, 4 * C + 1, 5]
    data = {x: _bytes(sizes[i % len(sizes)], i) for i, x in enumerate(p.nodes)}
    codec = _codec(k, m)
    parity = ec.encode_nodes(codec, p, data, C)
    rebuilt = refused = 0
    for f in range(1, m + 2):
        expect = recovery_probability(p, f)
        ok = 0
        for gone in itertools.combinations(p.nodes, f):
            survivors = {x: d for x, d in data.items() if x not in gone}
            held = {x: v for x, v in parity.items() if x not in gone}
            try:
                got = ec.rebuild_nodes(codec, p, gone, survivors, held)
            except RestoreError:
                refused += 1
                continue
            assert got == {x: data[x] for x in gone}
            ok += 1
            rebuilt += 1
        assert expect.exact and ok == round(expect.probability * expect.trials)
    assert rebuilt and refused  # both outcomes happened


def test_rebuild_nodes_refuses_corrupt_parity() -> None:
    p = erasure_placement(node_ids(3), 2, 1)
    data = {x: _bytes(3 * C, i) for i, x in enumerate(p.nodes)}
    codec = _codec(2, 1)
    parity = ec.encode_nodes(codec, p, data, C)
    lost = p.nodes[0]
    # the stripe holding slice 0 of the lost node: corrupt its parity fragment
    i = p.stripes.index(p.stripe_of(lost, 0))
    holder = p.stripes[i].parity[0]
    frag = parity[holder][(i, 0)]
    parity[holder][(i, 0)] = ec.ParityFragment(frag.info, 0, _flip(frag.data, 10))
    survivors = {x: d for x, d in data.items() if x != lost}
    with pytest.raises(IntegrityError, match="refused: position 2: xxh3"):
        ec.rebuild_nodes(codec, p, [lost], survivors,
                         {x: v for x, v in parity.items() if x != lost})
