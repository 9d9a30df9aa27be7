"""Benchmark: replication of snapshots to peer nodes.

    .venv/bin/python bench/replicate.py simulate [--json FILE]

Parts:

- (d) ``simulate``: over ftrun's own placement code (``ftrun.snapshot.placement``), the
  probability that ``k`` simultaneous node losses, every set of ``k`` nodes equally likely,
  leave a copy of every node's snapshot shards in some live node's memory, for Gemini's group
  placement (mixed when ``m`` does not divide ``N``) against ring placement. Exact (every loss
  set enumerated) while there are at most ``--exact-limit`` loss sets, otherwise a Monte
  Carlo estimate from ``--trials`` sets drawn with a fixed seed (the standard error is
  printed). It must reproduce Gemini's figures, N=16, m=2: k=2 93.3%, k=3 80.0%, and exits 1
  if it does not.

Parts (a) replication throughput against raw ZeroMQ TCP, (b) training throughput with
replication on and off and (c) time from node loss to resumed training are to come.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ftrun.snapshot import placement  # noqa: E402

NODES = (16, 64, 256, 1024)
COPIES = (2, 3)
LOSSES = (1, 2, 3, 4)
# Gemini (SOSP'23), N=16, m=2, group placement: (k, recovery probability in percent).
GEMINI = ((2, 93.3), (3, 80.0))


def simulate(nodes: tuple[int, ...], copies: tuple[int, ...], losses: tuple[int, ...],
             exact_limit: int, trials: int) -> list[dict[str, object]]:
    rows = []
    for n in nodes:
        ids = placement.node_ids(n)
        for m in copies:
            for k in losses:
                row: dict[str, object] = {"N": n, "m": m, "k": k}
                for name, place in placement.STRATEGIES.items():
                    est = placement.recovery_probability(place(ids, m), k,
                                                         exact_limit=exact_limit, trials=trials)
                    row[name] = est.probability
                    row[f"{name}_stderr"] = est.stderr
                    row["exact"] = est.exact
                    row["trials"] = est.trials
                rows.append(row)
    return rows


def _pct(p: float, se: float, exact: bool, trials: int) -> str:
    if not exact and p == 1.0:
        # No failure drawn: one standard error says nothing; give the 95% bound instead
        # (rule of three: the failure rate is below 3/trials).
        return f"> {100 * (1 - 3 / trials):.4f}% (no loss in {trials:,})"
    return f"{100 * p:.4f}%" + (f" ±{100 * se:.2g}" if se else "")


def table(rows: list[dict[str, object]]) -> str:
    lines = ["| N | m | k | group | ring | how |", "|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        how = (f"exact ({r['trials']:,} loss sets)" if r["exact"]
               else f"Monte Carlo ({r['trials']:,} draws, seed {placement.MC_SEED})")
        lines.append(f"| {r['N']} | {r['m']} | {r['k']} | "
                     f"{_pct(r['group'], r['group_stderr'], r['exact'], r['trials'])} | "  # type: ignore[arg-type]
                     f"{_pct(r['ring'], r['ring_stderr'], r['exact'], r['trials'])} | {how} |")  # type: ignore[arg-type]
    return "\n".join(lines)


def check_gemini() -> list[str]:
    """Gemini's published figures, recomputed; returns what does not match."""
    group = placement.group_placement(placement.node_ids(16), 2)
    wrong = []
    for k, want in GEMINI:
        got = 100 * placement.recovery_probability(group, k).probability
        if round(got, 1) != want:
            wrong.append(f"N=16 m=2 k={k}: {got:.2f}% (Gemini: {want}%)")
    return wrong


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="part", required=True)
    sim = sub.add_parser("simulate", help="(d) recovery probability, group vs ring placement")
    sim.add_argument("--nodes", type=int, nargs="+", default=list(NODES))
    sim.add_argument("--copies", type=int, nargs="+", default=list(COPIES),
                     help="m: copies of every shard (the node's own and m-1 replicas)")
    sim.add_argument("--losses", type=int, nargs="+", default=list(LOSSES))
    sim.add_argument("--exact-limit", type=int, default=placement.EXACT_LIMIT,
                     help="enumerate every loss set up to this many; sample beyond")
    sim.add_argument("--trials", type=int, default=placement.MC_TRIALS)
    sim.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    rows = simulate(tuple(args.nodes), tuple(args.copies), tuple(args.losses),
                    args.exact_limit, args.trials)
    wrong = check_gemini()
    print("(d) Probability that k simultaneous node losses (every set of k nodes equally "
          "likely) leave a copy of every node's shards in memory, for ftrun's placement code "
          "(ftrun.snapshot.placement): Gemini's group placement (mixed when m does not divide "
          "N: ring over the last m + N mod m nodes) vs ring placement. m = copies of each "
          f"shard. Exact enumeration up to {args.exact_limit:,} loss sets, else Monte Carlo "
          f"(± one standard error). {time.perf_counter() - t0:.1f} s.")
    print()
    print(table(rows))
    print()
    print("Gemini's figures (N=16, m=2, group: k=2 93.3%, k=3 80.0%): "
          + ("reproduced" if not wrong else "NOT reproduced: " + "; ".join(wrong)))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
