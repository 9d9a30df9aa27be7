"""Benchmark: erasure-coded snapshots (issue 28) — coding speed, memory, survival.

    .venv/bin/python bench/erasure.py [--output bench/RESULTS.md]      # every part
    .venv/bin/python bench/erasure.py speed|units|libraries|memory|survival [options]

Parts:

- ``speed``: ftrun's own coding path (``ftrun.store.erasure``: each data chunk checked
  against its xxh3 hash, coded by pyeclib/ISA-L in units, parity chunks hashed) on one stripe
  of ``--size-mib`` of data (default 256 MiB, cut into K slices of 4 MiB chunks), into
  output buffers allocated and touched beforehand (as a store's shared memory is): encode
  (GB of data coded per second) and the rebuild of M lost data slices from the other K - M
  slices and the M parity fragments (GB rebuilt per second, and GB of stripe data per
  second), for ec:K+M, K = 2, 3, 4, M = 1, 2. Every rebuild is compared with the original
  bytes. Best and median of ``--repeats`` runs (the machine is shared).
- ``units``: the same encode at coding units of 16 KiB to 4 MiB (ec:4+2): the unit sets how
  long one library call (which holds the GIL) lasts, and the throughput.
- ``libraries``: the libraries bare, coding ``--size-mib`` of data in calls of K pieces of
  ftrun's unit (ec:2+1 and ec:4+2): pyeclib's backends here (ISA-L Cauchy and Vandermonde,
  liberasurecode's own Reed-Solomon), and zfec when it is importable (it is not a dependency
  of ftrun: ``PYTHONPATH=<a pip --target folder holding zfec>``).
- ``memory``: bytes held per node, as a multiple of its own shard, computed from the
  placement code (``ftrun.coordinator.placement``) with equal shards (exact) and with shards
  of unequal sizes (uniform in 0.5..1.5 of the mean, seeded): replicas:2 and :3 (Gemini
  group placement) against ec:K+M, K = 2, 3, 4, M = 1, 2, and ec:4+4 and ec:2+4 (the
  memory of replicas:2 and :3).
- ``survival``: the probability that a step survives f simultaneous node losses (every set of
  f nodes equally likely), computed from the placements (exact enumeration up to 1,000,000
  loss sets, else seeded Monte Carlo), schemes grouped by memory per node, for N nodes.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ftrun.coordinator import placement  # noqa: E402
from ftrun.snapshot.segment import CHUNK_BYTES, chunk_count  # noqa: E402
from ftrun.store import erasure as ec  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from replicate import hardware, load  # noqa: E402  (the same host line as the other benches)

CODES = ((2, 1), (3, 1), (4, 1), (2, 2), (3, 2), (4, 2))
# memory and survival only: the same memory per node as replicas:2 (ec:4+4) and :3 (ec:2+4)
EQUAL_BUDGET = ((4, 4), (2, 4))
UNITS = (16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
GB = 1e9
PARTS = ("speed", "units", "libraries", "memory", "survival")


def _best_median(times: list[float]) -> tuple[float, float]:
    return min(times), statistics.median(times)


def _timed(repeats: int, fn: Callable[..., object], *args: object) -> tuple[list[float], object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn(*args)
        times.append(time.perf_counter() - t0)
    return times, out


def _slices(data: bytes, k: int) -> list[memoryview]:
    """``data`` cut into k slices of whole chunks (the last one taking the rest)."""
    view = memoryview(data)
    per = chunk_count(len(data), CHUNK_BYTES) // k * CHUNK_BYTES
    return [view[j * per:(j + 1) * per] if j < k - 1 else view[j * per:] for j in range(k)]


# -- speed ------------------------------------------------------------------------------------

def speed(size_mib: int, repeats: int, codes: tuple[tuple[int, int], ...],
          unit: int = ec.UNIT_BYTES) -> list[dict[str, float]]:
    data = os.urandom(size_mib << 20)
    rows = []
    for k, m in codes:
        codec = ec.Codec(k, m, unit=unit)
        slices = _slices(data, k)
        hashes = [ec.chunk_hashes(s) for s in slices]
        # outputs allocated and touched once, as a store's pre-faulted shared memory is: the
        # first touch of fresh pages (~2 GB/s here) is not the coding's cost
        parity = [bytearray(b"\1" * ec.Encoder(codec, [len(x) for x in slices], hashes,
                                                CHUNK_BYTES).parity_length) for _ in range(m)]
        enc_t, frags = _timed(repeats, ec.encode, codec, slices, CHUNK_BYTES, hashes, parity)
        assert isinstance(frags, list)
        info = frags[0].info
        lost = list(range(m))
        have: dict[int, ec.Column] = {j: slices[j] for j in range(m, k)}
        have.update({f.position: f.data for f in frags})
        into = {j: bytearray(b"\1" * len(slices[j])) for j in lost}
        dec_t, got = _timed(repeats, ec.rebuild, codec, info, have, lost, into)
        assert isinstance(got, dict)
        if any(got[j] != slices[j] for j in lost):
            raise SystemExit(f"ec:{k}+{m}: a rebuilt slice differs from the original")
        rebuilt = sum(len(slices[j]) for j in lost)
        eb, em = _best_median(enc_t)
        db, dm = _best_median(dec_t)
        rows.append({"k": k, "m": m, "bytes": len(data), "rebuilt": rebuilt,
                     "enc_best": len(data) / eb / GB, "enc_median": len(data) / em / GB,
                     "dec_best": rebuilt / db / GB, "dec_median": rebuilt / dm / GB,
                     "dec_stripe_best": len(data) / db / GB})
        print(f"speed ec:{k}+{m}: encode {rows[-1]['enc_best']:.2f} GB/s, rebuild "
              f"{rows[-1]['dec_best']:.2f} GB/s", flush=True)
    return rows


def speed_table(rows: list[dict[str, float]]) -> str:
    lines = ["| code | encode GB/s best (median) | rebuild M data slices: GB rebuilt/s best "
             "(median) | stripe GB/s during rebuild (best) |", "|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| ec:{r['k']}+{r['m']} | {r['enc_best']:.2f} ({r['enc_median']:.2f}) | "
                     f"{r['dec_best']:.2f} ({r['dec_median']:.2f}) | "
                     f"{r['dec_stripe_best']:.2f} |")
    return "\n".join(lines)


# -- units ------------------------------------------------------------------------------------

def units(size_mib: int, repeats: int) -> list[dict[str, float]]:
    rows = []
    k, m = 4, 2
    for unit in UNITS:
        (r,) = speed(size_mib, repeats, ((k, m),), unit)
        calls = chunk_count(int(r["bytes"]) // k, CHUNK_BYTES) * -(-CHUNK_BYTES // unit)
        r["unit"] = unit
        r["call_ms"] = r["bytes"] / (r["enc_best"] * GB) / calls * 1e3
        rows.append(r)
    return rows


def units_table(rows: list[dict[str, float]]) -> str:
    lines = ["| unit (per data piece) | encode GB/s best (median) | rebuild GB/s best | "
             "one encode call (ms, mean) |", "|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {int(r['unit']) >> 10} KiB | {r['enc_best']:.2f} "
                     f"({r['enc_median']:.2f}) | {r['dec_best']:.2f} | {r['call_ms']:.2f} |")
    return "\n".join(lines)


# -- libraries --------------------------------------------------------------------------------

def _loop(fn: Callable[..., object], args: list[tuple[object, ...]]) -> None:
    for a in args:
        fn(*a)


def libraries(size_mib: int, repeats: int) -> list[dict[str, object]]:
    """Each library coding the whole of ``size_mib`` of data in calls of K pieces of ftrun's
    unit, the inputs made beforehand (the libraries take bytes): what ftrun's path would cost
    without its own copies, hashing and checks."""
    from pyeclib.ec_iface import VALID_EC_TYPES, ECDriver

    piece = ec.UNIT_BYTES
    data = os.urandom(size_mib << 20)
    rows: list[dict[str, object]] = []
    for k, m in ((2, 1), (4, 2)):
        step = k * piece
        bufs = [data[i:i + step] for i in range(0, len(data) - step + 1, step)]
        size = len(bufs) * step
        for backend in ("isa_l_rs_cauchy", "isa_l_rs_vand", "liberasurecode_rs_vand"):
            if backend not in VALID_EC_TYPES:
                continue
            d = ECDriver(k=k, m=m, ec_type=backend)
            frags = [(d.encode(b)[m:],) for b in bufs]  # the first m data fragments lost
            et, _ = _timed(repeats, _loop, d.encode, [(b,) for b in bufs])
            dt, _ = _timed(repeats, _loop, d.decode, frags)
            del frags
            rows.append({"library": f"pyeclib {backend}", "k": k, "m": m,
                         "enc": size / min(et) / GB, "dec": size / min(dt) / GB})
            print(f"libraries {rows[-1]}", flush=True)
        try:
            import zfec  # type: ignore[import-not-found]
        except ImportError:
            rows.append({"library": "zfec", "k": k, "m": m, "enc": None, "dec": None})
            continue
        pieces = [[b[j * piece:(j + 1) * piece] for j in range(k)] for b in bufs]
        encoder, decoder = zfec.Encoder(k, k + m), zfec.Decoder(k, k + m)
        wanted = list(range(k, k + m))
        survivors = list(range(m, k)) + wanted
        blocks = [(p[m:] + encoder.encode(p, wanted), survivors) for p in pieces]
        et, _ = _timed(repeats, _loop, encoder.encode, [(p, wanted) for p in pieces])
        dt, _ = _timed(repeats, _loop, decoder.decode, blocks)
        del blocks
        where = Path(zfec.__file__).parent.parent
        rows.append({"library": f"zfec {getattr(zfec, '__version__', '?')} (from {where})",
                     "k": k, "m": m, "enc": size / min(et) / GB, "dec": size / min(dt) / GB})
        print(f"libraries {rows[-1]}", flush=True)
    return rows


def libraries_table(rows: list[dict[str, object]]) -> str:
    lines = ["| library, backend | code | encode GB/s (best) | decode, M data lost, GB/s (best) |",
             "|---|---|---:|---:|"]
    for r in rows:
        if r["enc"] is None:
            lines.append(f"| {r['library']} | ec:{r['k']}+{r['m']} | not installed | |")
            continue
        lines.append(f"| {r['library']} | ec:{r['k']}+{r['m']} | {r['enc']:.2f} | "
                     f"{r['dec']:.2f} |")
    return "\n".join(lines)


# -- memory -----------------------------------------------------------------------------------

def _ec_held(p: placement.ErasurePlacement, sizes: dict[str, int]) -> dict[str, int]:
    """Parity bytes each node holds: per stripe, one fragment as long as the stripe's longest
    slice, chunk by chunk (ftrun.store.erasure.StripeInfo.length)."""
    lengths = {x: ec.slice_lengths(n, p.k) for x, n in sizes.items()}
    held = {x: 0 for x in sizes}
    for s in p.stripes:
        info_lengths = [lengths[x][j] for j, x in enumerate(s.data)]
        chunks = max(chunk_count(n, CHUNK_BYTES) for n in info_lengths)
        last = max(max(0, min(CHUNK_BYTES, n - (chunks - 1) * CHUNK_BYTES))
                   for n in info_lengths) if chunks else 0
        frag = (chunks - 1) * CHUNK_BYTES + last if chunks else 0
        for x in s.parity:
            held[x] += frag
    return held


def _schemes() -> list[tuple[str, float, Callable[[list[str]], object]]]:
    out: list[tuple[str, float, Callable[[list[str]], object]]] = [
        (f"replicas:{r}", float(r), lambda ids, r=r: placement.group_placement(ids, r))
        for r in (2, 3)]
    for k, m in (*CODES, *EQUAL_BUDGET):
        out.append((f"ec:{k}+{m}", 1 + m / k,
                    lambda ids, k=k, m=m: placement.erasure_placement(ids, k, m)))
    return out


def memory(n: int, shard_gib: float) -> list[dict[str, object]]:
    ids = placement.node_ids(n)
    mean = int(shard_gib * 2**30)
    rng = random.Random(20231023)
    shapes = {"equal": {x: mean for x in ids},
              "unequal": {x: int(mean * rng.uniform(0.5, 1.5)) for x in ids}}
    rows: list[dict[str, object]] = []
    for name, nominal, build in _schemes():
        p = build(ids)
        row: dict[str, object] = {"scheme": name, "nominal": nominal}
        for shape, sizes in shapes.items():
            if isinstance(p, placement.ErasurePlacement):
                held = _ec_held(p, sizes)
                tolerance = f"any {p.m} per group of {min(len(g) for g in p.groups)}" + (
                    f"-{max(len(g) for g in p.groups)}"
                    if len({len(g) for g in p.groups}) > 1 else "")
            else:
                assert isinstance(p, dict)
                held = {x: 0 for x in ids}
                for origin, peers in p.items():
                    for q in peers:
                        held[q] += sizes[origin]
                tolerance = f"any {int(nominal) - 1} per group of {int(nominal)}"
            total = sum(sizes.values())
            row[f"{shape}_all"] = (total + sum(held.values())) / total
            row[f"{shape}_max"] = max(sizes[x] + held[x] for x in ids) / (total / n)
            row["tolerance"] = tolerance
        rows.append(row)
    return rows


def memory_table(rows: list[dict[str, object]]) -> str:
    lines = ["| scheme | nominal | equal shards: all memory / all shards | unequal shards "
             "(0.5-1.5x): all / all, fullest node / mean shard | node losses survived |",
             "|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['scheme']} | {r['nominal']:.2f}x | {r['equal_all']:.3f}x | "
                     f"{r['unequal_all']:.3f}x, {r['unequal_max']:.3f}x | {r['tolerance']} |")
    return "\n".join(lines)


# -- survival ---------------------------------------------------------------------------------

def survival(n: int, losses: tuple[int, ...]) -> list[dict[str, object]]:
    ids = placement.node_ids(n)
    rows: list[dict[str, object]] = []
    for name, nominal, build in sorted(_schemes(), key=lambda s: s[1]):
        p = build(ids)
        row: dict[str, object] = {"scheme": name, "memory": nominal, "N": n}
        for f in losses:
            est = placement.recovery_probability(p, f)  # type: ignore[arg-type]
            row[f] = (est.probability, est.exact, est.stderr)
        rows.append(row)
    return rows


def survival_table(rows: list[dict[str, object]], losses: tuple[int, ...]) -> str:
    head = " | ".join(f"f={f}" for f in losses)
    lines = [f"| memory per node | scheme | {head} |",
             "|---:|---|" + "---:|" * len(losses)]
    for r in rows:
        cells = []
        for f in losses:
            p, exact, se = r[f]  # type: ignore[misc]
            cells.append(f"{100 * p:.2f}%" + ("" if exact else f" ±{100 * se:.2g} (MC)"))
        lines.append(f"| {r['memory']:.2f}x | {r['scheme']} | {' | '.join(cells)} |")
    return "\n".join(lines)


# -- report -----------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("parts", nargs="*", metavar="part",
                   help=f"{', '.join(PARTS)} (default: all)")
    p.add_argument("--output", type=Path, help="append the results to this file (RESULTS.md)")
    p.add_argument("--size-mib", type=int, default=256, help="data per stripe (MiB)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nodes", type=int, nargs="+", default=[16, 64],
                   help="node counts for memory and survival")
    p.add_argument("--losses", type=int, nargs="+", default=[1, 2, 3, 4, 6])
    p.add_argument("--shard-gib", type=float, default=10.0, help="mean shard per node (GiB)")
    args = p.parse_args(argv)
    unknown = [x for x in args.parts if x not in PARTS]
    if unknown:
        p.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parts = args.parts or list(PARTS)
    started = datetime.now(timezone.utc)
    loads = [load()]
    sections: list[str] = []
    import pyeclib_c  # fails here, not mid-run, when pyeclib is missing

    lec = pyeclib_c.get_liberasurecode_version()
    versions = (f"pyeclib {_version('pyeclib')}, liberasurecode "
                f"{lec >> 16}.{(lec >> 8) & 0xff}.{lec & 0xff}, backend {ec.BACKEND}, "
                f"chunks of {CHUNK_BYTES >> 20} MiB, coding unit {ec.UNIT_BYTES >> 10} KiB")
    if "speed" in parts:
        rows = speed(args.size_mib, args.repeats, CODES)
        sections.append(
            f"Speed of ftrun's coding path (ftrun.store.erasure.encode / rebuild), one thread, "
            f"one stripe of {args.size_mib} MiB of data cut into K slices of 4 MiB chunks; "
            "outputs written into buffers touched beforehand (as the store's pre-faulted shared "
            "memory); encode checks every data chunk against its xxh3 hash and hashes the parity; "
            "rebuild loses data slices 0..M-1 and rebuilds them from the other slices and the M "
            "parity fragments, checking every piece used and rebuilt. Best (median) of "
            f"{args.repeats}.\n\n{speed_table(rows)}")
        loads.append(load())
    if "units" in parts:
        rows = units(args.size_mib, args.repeats)
        sections.append(
            "Coding unit (bytes of each data piece per library call; pyeclib holds the GIL for "
            f"the length of a call), ec:4+2, same stripe, best (median) of {args.repeats}.\n\n"
            f"{units_table(rows)}")
        loads.append(load())
    if "libraries" in parts:
        rows_l = libraries(args.size_mib, args.repeats)
        sections.append(
            f"The libraries bare, {args.size_mib} MiB of data per run in calls of K x "
            f"{ec.UNIT_BYTES >> 10} KiB, inputs made beforehand, best of {args.repeats}; decode "
            "with the first M data fragments lost.\n\n"
            f"{libraries_table(rows_l)}")
        loads.append(load())
    for n in args.nodes:
        if "memory" in parts:
            rows_m = memory(n, args.shard_gib)
            sections.append(
                f"Memory per node, N = {n}, from the placements (ftrun.coordinator.placement; "
                f"erasure fragments as long as each stripe's longest slice, 4 MiB chunks), "
                f"mean shard {args.shard_gib:g} GiB.\n\n{memory_table(rows_m)}")
        if "survival" in parts:
            t0 = time.perf_counter()
            rows_s = survival(n, tuple(args.losses))
            sections.append(
                f"Probability that a step survives f simultaneous node losses, N = {n}, every "
                "set of f nodes equally likely (exact below 1,000,000 loss sets, else Monte "
                f"Carlo, seed {placement.MC_SEED}, 200,000 draws, ± one standard error); "
                "replicas: Gemini group placement; ec: ftrun's erasure placement. "
                f"{time.perf_counter() - t0:.1f} s.\n\n"
                f"{survival_table(rows_s, tuple(args.losses))}")
    loads.append(load())
    argv_text = " ".join(sys.argv[1:]) if argv is None else " ".join(argv)
    report = "\n".join([
        "## Erasure coding (issue 28): coding speed, memory per node, survival", "",
        f"- Command: `.venv/bin/python bench/erasure.py{' ' + argv_text if argv_text else ''}`",
        f"- Date (UTC): {started:%Y-%m-%d %H:%M}; {hardware()}; load average "
        f"(1/5/15 min) {' -> '.join(loads)}",
        f"- {versions}",
        "", "\n\n".join(sections), ""])
    print(report)
    if args.output:
        with args.output.open("a") as f:
            f.write("\n" + report)
    return 0


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    raise SystemExit(main())
