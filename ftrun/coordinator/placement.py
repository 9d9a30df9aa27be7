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

**Erasure-coded placement** (REFT), ``ec:K+M``: see :func:`erasure_placement`. Each node keeps
its own shards and holds parity worth about ``M/K`` of its own shards' size, and any ``M``
nodes of a group can be lost at once.

:func:`recovery_probability` answers: if ``k`` nodes chosen uniformly at random are lost at
the same time, how likely is it that every node's shards can still be had (from the node
itself, one of its replica holders, or decoded from a stripe's survivors)? Exact, by
enumerating every loss set, when there are few enough of them; otherwise a Monte Carlo
estimate with a fixed seed.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable, Mapping, Sequence
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
    """Decides quickly whether a set of lost nodes leaves every node's shards recoverable.

    The placement is given as *risks*: (a set of nodes, how many of them may be lost). A
    replicated node's copies form one risk that tolerates all but one loss; an erasure-coded
    stripe's ``K + M`` nodes form one that tolerates ``M``."""

    def __init__(self, nodes: Sequence[str], risks: Iterable[tuple[Iterable[str], int]]) -> None:
        self.nodes = sorted(nodes)
        index = {x: i for i, x in enumerate(self.nodes)}
        # touching[j]: the risks node j belongs to; only those can be tipped by losing j
        self.touching: list[list[tuple[frozenset[int], int]]] = [[] for _ in self.nodes]
        for members, tolerance in risks:
            risk = (frozenset(index[x] for x in members), tolerance)
            for j in risk[0]:
                self.touching[j].append(risk)

    def survives(self, lost: Sequence[int]) -> bool:
        gone = set(lost)
        return not any(len(c & gone) > tolerance for j in lost for c, tolerance in self.touching[j])


def _risks(placement: Mapping[str, Sequence[str]] | ErasurePlacement,
           ) -> tuple[list[str], list[tuple[list[str], int]]]:
    """(the nodes, their risks) of a replica placement or an erasure-coded one."""
    if isinstance(placement, ErasurePlacement):
        return (placement.nodes,
                [([*s.data, *s.parity], placement.m) for s in placement.stripes])
    copies = [[x, *peers] for x, peers in placement.items()]
    return list(placement), [(c, len(c) - 1) for c in copies]


def recovery_probability(placement: Mapping[str, Sequence[str]] | ErasurePlacement, k: int, *,
                         exact_limit: int = EXACT_LIMIT, trials: int = MC_TRIALS,
                         seed: int = MC_SEED) -> Estimate:
    """Probability that losing ``k`` nodes at random (uniformly among all sets of ``k``)
    leaves every node's shards recoverable. Exact when at most ``exact_limit`` loss sets
    exist, else estimated from ``trials`` sets drawn with ``seed``."""
    nodes, risks = _risks(placement)
    n = len(nodes)
    if not 0 <= k <= n:
        raise ConfigError(f"cannot lose {k} of {n} nodes")
    check = _Survival(nodes, risks)
    total = math.comb(n, k)
    if total <= exact_limit:
        ok = sum(check.survives(lost) for lost in itertools.combinations(range(n), k))
        return Estimate(ok / total, True, total)
    rng = random.Random(seed)
    population = range(n)
    ok = sum(check.survives(rng.sample(population, k)) for _ in range(trials))
    return Estimate(ok / trials, False, trials)


# ---- erasure coding (REFT) -------------------------------------------------------------------

# liberasurecode's ceiling on data + parity fragments of one code word.
EC_MAX_FRAGMENTS = 32


@dataclass(frozen=True)
class Stripe:
    """One code word of a group: ``K`` data slices and ``M`` parity fragments, on ``K + M``
    distinct nodes of the group.

    Data position ``j`` is slice ``j`` of node ``data[j]``'s bytes (the node's chunks
    ``j, j + K, j + 2K, ...``); parity fragment ``t`` is held by ``parity[t]``."""

    group: int
    data: tuple[str, ...]
    parity: tuple[str, ...]


@dataclass(frozen=True)
class ErasurePlacement:
    """Where the parity of ``ec:K+M`` lives. Build it with :func:`erasure_placement`."""

    k: int
    m: int
    groups: tuple[tuple[str, ...], ...]
    stripes: tuple[Stripe, ...]

    @property
    def nodes(self) -> list[str]:
        return sorted(x for g in self.groups for x in g)

    def stripe_of(self, node: str, slice_index: int) -> Stripe:
        """The stripe that slice ``slice_index`` of ``node``'s bytes belongs to."""
        for s in self.stripes:
            if s.data[slice_index] == node:
                return s
        raise ConfigError(f"node {node!r} is not in this erasure placement")

    def held_by(self, node: str) -> list[tuple[Stripe, int]]:
        """The (stripe, parity index) pairs whose parity fragment ``node`` holds."""
        return [(s, t) for s in self.stripes for t, x in enumerate(s.parity) if x == node]


def erasure_placement(nodes: Sequence[str], k: int, m: int) -> ErasurePlacement:
    """``ec:K+M``: disjoint groups of (at least) ``K + M`` nodes, rotating stripes in each.

    Why groups of ``K + M`` and not of ``K``: every node keeps its own shards, so a node of a
    group of ``K`` that also held part of its group's parity would take data *and* parity with
    it when lost, and no spread of ``M/K`` parity per node inside the group survives ``M``
    losses (with ``K = 2, M = 1``: node A holds ``a`` and half of ``a ^ b``; losing A loses
    the half of the parity that ``a``'s first half needs). Instead each node's bytes are cut
    into ``K`` slices (chunk ``c`` goes to slice ``c mod K``), and a group of ``n`` nodes
    ``g[0..n-1]`` has ``n`` stripes: stripe ``r`` takes slice ``j`` of node ``g[r+M+j]`` as
    data position ``j`` and puts parity fragment ``t`` on node ``g[r+t]`` (indices mod
    ``n``). A stripe's ``K + M`` nodes are distinct, so losing any ``M`` nodes of a group
    leaves every stripe decodable; each node's ``K`` slices go to ``K`` different stripes and
    it holds the parity of ``M`` stripes, each about one slice in size: ``M/K`` of its own
    bytes when the nodes' shards are of one size.

    Groups: the sorted nodes are cut in order into ``N // (K + M)`` groups of as equal sizes
    as can be (they differ by at most one, the larger ones last). A group larger than
    ``K + M`` still tolerates any ``M`` losses, and some larger loss sets too, when they fall
    in different stripes; spreading the remainder evenly survives more loss sets than
    Gemini's one large last group (ec:2+2 on 14 nodes, 3 losses: 93.4% with groups of
    4, 5, 5 against 92.9% with 4, 4, 6). Fewer than ``K + M`` nodes cannot hold the code and
    are refused.
    """
    ordered = _check(nodes, 1)
    if k < 2:
        raise ConfigError(f"erasure coding needs K >= 2 data fragments, got ec:{k}+{m} "
                          "(ec:1+M is M+1 copies: use replicas)")
    if m < 1:
        raise ConfigError(f"erasure coding needs M >= 1 parity fragments, got ec:{k}+{m}")
    if k + m > EC_MAX_FRAGMENTS:
        raise ConfigError(f"ec:{k}+{m} has {k + m} fragments per stripe; the erasure-coding "
                          f"library allows at most {EC_MAX_FRAGMENTS}")
    size = k + m
    n = len(ordered)
    if n < size:
        raise ConfigError(f"ec:{k}+{m} needs at least {size} nodes (each stripe spans K + M "
                          f"distinct nodes), the job has {n}: use a smaller K or M, or replicas")
    count = n // size
    base, extra = divmod(n, count)  # base >= K + M
    sizes = [base + (1 if g >= count - extra else 0) for g in range(count)]
    groups: list[tuple[str, ...]] = []
    stripes: list[Stripe] = []
    start = 0
    for g, width in enumerate(sizes):
        members = tuple(ordered[start:start + width])
        start += width
        groups.append(members)
        for r in range(width):
            stripes.append(Stripe(
                group=g,
                data=tuple(members[(r + m + j) % width] for j in range(k)),
                parity=tuple(members[(r + t) % width] for t in range(m))))
    return ErasurePlacement(k, m, tuple(groups), tuple(stripes))


def node_ids(n: int) -> list[str]:
    """``n`` sortable node ids for simulations (``node0000`` ...)."""
    return [f"node{i:04d}" for i in range(n)]


# ---- which redundancy a job uses --------------------------------------------------------------

@dataclass(frozen=True)
class Redundancy:
    """How committed snapshots survive a lost node: ``replicas:M`` (M copies of every shard,
    the node's own included; 1: none) or ``ec:K+M`` (groups of K data nodes, M parity
    fragments per stripe: :func:`erasure_placement`)."""

    kind: str  # "replicas" or "ec"
    copies: int = 1  # replicas: copies of every shard, the node's own included
    k: int = 0  # ec: data fragments per stripe
    m: int = 0  # ec: parity fragments per stripe

    @property
    def erasure(self) -> bool:
        return self.kind == "ec"

    def __str__(self) -> str:
        return f"ec:{self.k}+{self.m}" if self.erasure else f"replicas:{self.copies}"

    def check_nodes(self, nodes: int) -> None:
        """Refuse a job of ``nodes`` nodes (its most) that this redundancy cannot protect."""
        if self.erasure and nodes < self.k + self.m:
            fits = (f"ec:{nodes - self.m}+{self.m} fits {nodes} nodes" if nodes - self.m >= 2
                    else "erasure coding needs at least 3 nodes (ec:2+1)")
            raise ConfigError(
                f"--redundancy {self} needs at least {self.k + self.m} nodes (every stripe "
                f"spans K + M = {self.k + self.m} distinct nodes), the job has at most {nodes}: "
                f"{fits}; or use replicas:2")


def parse_redundancy(text: str) -> Redundancy:
    """``replicas:M`` or ``ec:K+M`` (case and spaces ignored); ConfigError naming the value and
    the forms accepted otherwise."""
    raw = text.strip().lower().replace(" ", "")
    kind, _, rest = raw.partition(":")
    forms = "replicas:M (M copies of every shard, e.g. replicas:2) or ec:K+M (e.g. ec:3+1)"
    if kind == "replicas" and rest.isdigit():
        copies = int(rest)
        if copies < 1:
            raise ConfigError(f"--redundancy {text!r}: replicas:M needs M >= 1 (1: none)")
        return Redundancy("replicas", copies=copies)
    if kind == "ec":
        k_text, plus, m_text = rest.partition("+")
        if plus and k_text.isdigit() and m_text.isdigit():
            k, m = int(k_text), int(m_text)
            if k < 2:
                raise ConfigError(f"--redundancy {text!r}: erasure coding needs K >= 2 data "
                                  f"fragments (ec:1+{m} is {m + 1} copies: use "
                                  f"replicas:{m + 1})")
            if m < 1:
                raise ConfigError(f"--redundancy {text!r}: erasure coding needs M >= 1 parity "
                                  "fragments (M = 0 protects nothing: use replicas:1)")
            if k + m > EC_MAX_FRAGMENTS:
                raise ConfigError(f"--redundancy {text!r}: {k + m} fragments per stripe; the "
                                  f"erasure-coding library allows at most {EC_MAX_FRAGMENTS}")
            return Redundancy("ec", k=k, m=m)
    raise ConfigError(f"--redundancy must be {forms}, got {text!r}")
