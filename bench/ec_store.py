"""Erasure coding between stores, measured: parity built store to store and a lost node's
shards rebuilt, on N shard services on loopback in this process (ftrun.store.ec_store).

Each node holds one shard of ``--mb`` MB (random bytes, 4 MiB chunks) in shared memory,
served by a real shard service; every store builds its parity fragments (pulling the data
slices over TCP, every chunk verified, coded with ISA-L via pyeclib), then one node is lost
and the first live node of its group rebuilds its shard (verified against its hashes).

    python bench/ec_store.py --nodes 4 --k 3 --m 1 --mb 64

Prints one line per phase: seconds and MB/s of node state (build: all nodes' state over the
slowest store's wall time, the stores built one after the other here; rebuild: the lost
shard's size over the rebuild's time).
"""

from __future__ import annotations

import argparse
import os
import time
import uuid

from ftrun.coordinator.placement import erasure_placement
from ftrun.snapshot import segment as shm
from ftrun.snapshot.manifest import MANIFEST_VERSION
from ftrun.store.ec_store import EcSegments, ErasureCoding, ec_prefix
from ftrun.store.erasure import chunk_hashes
from ftrun.store.shards import ShardService
from ftrun.store.survey import ask_holdings


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--mb", type=float, default=64.0, help="state per node, MB")
    args = p.parse_args()
    run_id = f"ecbench-{uuid.uuid4().hex[:8]}"
    secret = os.urandom(32)
    size = int(args.mb * 1e6)
    nodes: dict[str, tuple[EcSegments, ShardService, ErasureCoding]] = {}
    try:
        for rank in range(args.nodes):
            node = f"bench{rank}/{rank}"
            own = EcSegments(run_id, node, os.getpid())
            data = os.urandom(size)
            manifest = (f'{{"v": {MANIFEST_VERSION}, "step": 1, "rank": {rank}, '
                        f'"world_size": {args.nodes}, "tensors": []}}').encode()
            own.write(f"{ec_prefix(run_id)}bench-{rank}", origin=node, rank=rank, step=1,
                      epoch="e", manifest=manifest, hashes=chunk_hashes(data), data=[data],
                      n_tensors=0, chunk_size=shm.CHUNK_BYTES)
            ec = ErasureCoding(args.k, args.m, run_id, node, os.getpid(), secret,
                               lambda: ("e", 1), "127.0.0.1:9")
            service = ShardService(run_id, node, os.getpid(), secret,
                                   lambda o=own, e=ec: [*o.records(), *e.records()])
            service.start("127.0.0.1")
            nodes[node] = (own, service, ec)
        stores = {n: s.address for n, (_, s, _) in nodes.items()}
        placement = erasure_placement(sorted(nodes), args.k, args.m)
        records, _ = ask_holdings(stores, secret, run_id, "bench")
        worst = 0.0
        for _, _, ec in nodes.values():
            t = time.perf_counter()
            ec.build(placement, stores, records, "e", 1)
            worst = max(worst, time.perf_counter() - t)
        parity = sum(ec.segments.nbytes() for _, _, ec in nodes.values())
        print(f"ec:{args.k}+{args.m} on {args.nodes} nodes of {args.mb:g} MB: build "
              f"{worst:.2f} s per store (slowest), {size / 1e6 / worst:.0f} MB/s of its state; "
              f"parity held {parity / args.nodes / 1e6:.1f} MB per node "
              f"({parity / args.nodes / size:.2f}x its state)")
        victim = sorted(nodes)[-1]
        own, service, ec = nodes.pop(victim)
        service.stop()
        ec.stop(unlink=True)
        own.close(unlink=True)
        live = {n: s.address for n, (_, s, _) in nodes.items()}
        records, _ = ask_holdings(live, secret, run_id, "bench")
        first = nodes[sorted(nodes)[0]][2]
        t = time.perf_counter()
        first.rebuild_lost(live, records)
        took = time.perf_counter() - t
        assert [r.origin for r in first.records() if r.rank >= 0] == [victim], "not rebuilt"
        print(f"rebuild of one lost node's {args.mb:g} MB: {took:.2f} s, "
              f"{size / 1e6 / took:.0f} MB/s")
    finally:
        for own, service, ec in nodes.values():
            service.stop()
            ec.stop(unlink=True)
            own.close(unlink=True)
        for path in shm.list_segments(ec_prefix(run_id)):
            path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
