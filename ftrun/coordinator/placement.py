"""Where each node's snapshot replicas live, and how likely a placement survives node losses.

Pure logic, deterministic given the membership: every store and the coordinator compute the
same answer from the same sorted list of live node ids, and compute it again when that list
changes.

**Group placement** (Gemini, SOSP'23). With ``m`` copies of every shard (the node's own and
``m - 1`` replicas), the nodes are split, in order, into disjoint groups of ``m``, and each
node sends its shards to the other members of its group. A group loses data only when all
``m`` of its members are lost at once, which makes this the placement that maximises the
probability of recovering from memory. When ``m`` does not divide ``N``, Gemini's *mixed*
placement is used: the first ``N // m - 1`` groups are regular, and the last ``m + N % m``
nodes form a ring in which each node sends to the ``m - 1`` nodes after it.

**Ring placement**, for comparison: node ``i`` sends to nodes ``i+1 .. i+m-1`` (mod ``N``).

With fewer than ``m`` nodes, every node replicates to all the others (``N - 1`` peers).

:func:`recovery_probability` answers: if ``k`` nodes chosen uniformly at random are lost at
the same time, how likely is it that every node's shards still exist somewhere (on the node
itself or on one of its replica holders)? Exact, by enumerating every loss set, when there
are few enough of them; otherwise a Monte Carlo estimate with a fixed seed.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ftrun.errors import ConfigError

# Enumerate loss sets exactly up to this many; beyond, sample.
EXACT_LIMIT = 1_000_000
MC_TRIALS = 200_000
MC_SEED = 20231023  # fixed: the same membership gives the same estimate on every run

Placement = dict[str, list[str]]  # node -> the peers that hold its replicas, in send order


def _check(nodes: Sequence[str], m: int) -> list[str]:
    if m < 1:
        raise ConfigError(f"replicas must be >= 1 (1: no replication), got {m}")
    ordered = list(nodes)
    if ordered != sorted(set(ordered)):
        raise ConfigError("placement needs the node ids sorted and without duplicates, got "
                          f"{ordered[:8]}{'...' if len(ordered) > 8 else ''}")
    return ordered


def _ring(members: Sequence[str], copies: int) -> Placement:
    n = len(members)
    peers = min(copies - 1, n - 1)
    return {members[i]: [members[(i + j) % n] for j in range(1, peers + 1)] for i in range(n)}


def ring_placement(nodes: Sequence[str], m: int) -> Placement:
    """Node ``i`` sends its shards to the ``m - 1`` nodes after it, wrapping around."""
    return _ring(_check(nodes, m), m)


def group_placement(nodes: Sequence[str], m: int) -> Placement:
    """Gemini's group placement (mixed placement when ``m`` does not divide ``N``)."""
    ordered = _check(nodes, m)
    n = len(ordered)
    if m == 1 or n == 0:
        return {x: [] for x in ordered}
    groups = n // m
    if groups <= 1:
        return _ring(ordered, m)  # one group (or fewer nodes than copies): all in one ring
    regular = groups if n % m == 0 else groups - 1
    out: Placement = {}
    for g in range(regular):
        members = ordered[g * m:(g + 1) * m]
        for x in members:
            out[x] = [y for y in members if y != x]
    out.update(_ring(ordered[regular * m:], m))
    return out


STRATEGIES = {"group": group_placement, "ring": ring_placement}


def holders_of(placement: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """The inverse view: node -> the nodes whose replicas it holds."""
    out: dict[str, list[str]] = {x: [] for x in placement}
    for origin, peers in placement.items():
        for p in peers:
            out.setdefault(p, []).append(origin)
    return out


@dataclass(frozen=True)
class Estimate:
    """A recovery probability and how it was obtained."""

    probability: float
    exact: bool
    trials: int  # loss sets enumerated (exact) or sampled

    @property
    def stderr(self) -> float:
        """Standard error of a sampled estimate (0 for an exact one)."""
        if self.exact or not self.trials:
            return 0.0
        p = self.probability
        return math.sqrt(p * (1 - p) / self.trials)


class _Survival:
    """Decides quickly whether a set of lost nodes leaves every node's shards somewhere."""

    def __init__(self, placement: Mapping[str, Sequence[str]]) -> None:
        self.nodes = sorted(placement)
        index = {x: i for i, x in enumerate(self.nodes)}
        # copies[i]: the nodes holding node i's shards (itself included), as indices
        self.copies = [frozenset([index[x], *(index[p] for p in placement[x])])
                       for x in self.nodes]
        # touching[j]: the copy sets node j belongs to; only those can be wiped out by losing j
        self.touching: list[list[frozenset[int]]] = [[] for _ in self.nodes]
        for c in self.copies:
            for j in c:
                self.touching[j].append(c)

    def survives(self, lost: Sequence[int]) -> bool:
        gone = set(lost)
        return not any(c <= gone for j in lost for c in self.touching[j])


def recovery_probability(placement: Mapping[str, Sequence[str]], k: int, *,
                         exact_limit: int = EXACT_LIMIT, trials: int = MC_TRIALS,
                         seed: int = MC_SEED) -> Estimate:
    """Probability that losing ``k`` nodes at random (uniformly among all sets of ``k``)
    leaves a copy of every node's shards. Exact when at most ``exact_limit`` loss sets exist,
    else estimated from ``trials`` sets drawn with ``seed``."""
    n = len(placement)
    if not 0 <= k <= n:
        raise ConfigError(f"cannot lose {k} of {n} nodes")
    check = _Survival(placement)
    total = math.comb(n, k)
    if total <= exact_limit:
        ok = sum(check.survives(lost) for lost in itertools.combinations(range(n), k))
        return Estimate(ok / total, True, total)
    rng = random.Random(seed)
    population = range(n)
    ok = sum(check.survives(rng.sample(population, k)) for _ in range(trials))
    return Estimate(ok / trials, False, trials)


def node_ids(n: int) -> list[str]:
    """``n`` sortable node ids for simulations (``node0000`` ...)."""
    return [f"node{i:04d}" for i in range(n)]
