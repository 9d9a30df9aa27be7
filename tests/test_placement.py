"""Replica placement (group/mixed and ring) and the recovery-probability simulation."""

from __future__ import annotations

import math

import pytest

from ftrun.coordinator.placement import (
    group_placement,
    holders_of,
    node_ids,
    recovery_probability,
    ring_placement,
)
from ftrun.errors import ConfigError


def test_group_placement_disjoint_groups_when_m_divides_n() -> None:
    nodes = node_ids(6)
    p = group_placement(nodes, 3)
    assert p["node0000"] == ["node0001", "node0002"]
    assert p["node0004"] == ["node0003", "node0005"]
    groups = {frozenset([x, *peers]) for x, peers in p.items()}
    assert groups == {frozenset(nodes[:3]), frozenset(nodes[3:])}


def test_mixed_placement_rings_the_last_group() -> None:
    # 7 nodes, 3 copies: one regular group, then a ring over the last 3 + 7 % 3 = 4 nodes.
    p = group_placement(node_ids(7), 3)
    assert p["node0000"] == ["node0001", "node0002"]
    assert p["node0003"] == ["node0004", "node0005"]
    assert p["node0005"] == ["node0006", "node0003"]
    assert p["node0006"] == ["node0003", "node0004"]
    assert all(len(peers) == 2 and x not in peers for x, peers in p.items())
    # every node holds exactly m - 1 replicas of others
    assert sorted(len(v) for v in holders_of(p).values()) == [2] * 7


def test_small_memberships() -> None:
    assert group_placement([], 2) == {}
    assert group_placement(["a"], 2) == {"a": []}
    assert group_placement(["a", "b"], 3) == {"a": ["b"], "b": ["a"]}
    assert group_placement(["a", "b", "c"], 2) == {"a": ["b"], "b": ["c"], "c": ["a"]}
    assert group_placement(node_ids(4), 1) == {x: [] for x in node_ids(4)}


def test_deterministic_and_follows_membership() -> None:
    nodes = node_ids(9)
    assert group_placement(nodes, 2) == group_placement(list(nodes), 2)
    smaller = [x for x in nodes if x != "node0002"]
    p = group_placement(smaller, 2)
    assert "node0002" not in p and all("node0002" not in v for v in p.values())
    assert p["node0001"] == ["node0000"] and p["node0003"] == ["node0004"]


def test_ring_placement() -> None:
    p = ring_placement(node_ids(5), 3)
    assert p["node0003"] == ["node0004", "node0000"]
    assert p["node0004"] == ["node0000", "node0001"]


def test_bad_input_is_refused() -> None:
    with pytest.raises(ConfigError, match="sorted"):
        group_placement(["b", "a"], 2)
    with pytest.raises(ConfigError, match=">= 1"):
        ring_placement(["a"], 0)


def test_reproduces_gemini_figures_exactly() -> None:
    group = group_placement(node_ids(16), 2)
    k2, k3 = recovery_probability(group, 2), recovery_probability(group, 3)
    assert k2.exact and k3.exact and k2.trials == math.comb(16, 2)
    assert round(k2.probability * 100, 1) == 93.3
    assert round(k3.probability * 100, 1) == 80.0
    # and the counts behind them: 8 fatal pairs of 120; 8 * 14 fatal triples of 560
    assert k2.probability == pytest.approx(1 - 8 / 120)
    assert k3.probability == pytest.approx(1 - 8 * 14 / 560)
    ring = ring_placement(node_ids(16), 2)
    for k in (2, 3, 4):
        assert recovery_probability(ring, k).probability < recovery_probability(group, k).probability
    # ring: 16 fatal adjacent pairs of 120
    assert recovery_probability(ring, 2).probability == pytest.approx(1 - 16 / 120)
    assert recovery_probability(group, 1).probability == 1.0


def test_monte_carlo_matches_closed_form() -> None:
    # Group placement, m = 2, N = 1024, k = 4: recovery iff no group loses both members,
    # i.e. the 4 lost nodes come from 4 different groups.
    n, k = 1024, 4
    exact = math.comb(n // 2, k) * 2**k / math.comb(n, k)
    est = recovery_probability(group_placement(node_ids(n), 2), k, trials=20_000)
    assert not est.exact and est.trials == 20_000
    assert abs(est.probability - exact) < 5 * est.stderr + 1e-9
    again = recovery_probability(group_placement(node_ids(n), 2), k, trials=20_000)
    assert again == est  # fixed seed: the same estimate every run


def test_exact_limit_switches_to_sampling() -> None:
    p = group_placement(node_ids(16), 2)
    est = recovery_probability(p, 3, exact_limit=100, trials=50_000)
    assert not est.exact
    assert abs(est.probability - 0.8) < 5 * est.stderr
