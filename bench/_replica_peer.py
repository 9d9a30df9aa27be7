"""One end of a replication throughput measurement (``bench/replicate.py throughput``).

    python bench/_replica_peer.py recv --host H --run-id R
    python bench/_replica_peer.py send --store H:P --raw H:P --run-id R --size-mib N ...

``recv`` listens twice on ``H`` and prints ``{"store": "H:P", "raw": "H:P"}``: ftrun's
:class:`~ftrun.store.replica.ReplicaReceiver` (the one a store runs, on its own thread) and
a bare ZeroMQ ROUTER socket that receives messages and drops them, counting their bytes. It
serves until its stdin closes.

``send`` stages one rank segment of ``--size-mib`` in shared memory as a rank and its store
leave it (data, manifest, chunk hashes, VERIFIED), then sends it ``--transfers`` times each
way, alternating, so both see the same load on the machine: ``raw``, a bare DEALER socket
streaming the segment's data zero-copy in messages of the chunk size (4 MiB), then one round
trip that says every byte arrived; ``store``, ftrun's
:class:`~ftrun.store.replica.ReplicaSender` (``send_step``, a new step each time: the whole
transfer from ``replica_begin`` to ``replica_end``, every chunk verified into the replica
segment). One JSON line per transfer, with its seconds and the sender's CPU seconds (ZeroMQ's
I/O thread included). ``--warmup`` store transfers come first: they create the receiver's two
replica segments, which a store's steady state reuses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ftrun import protocol  # noqa: E402
from ftrun.protocol.endpoints import join_endpoint  # noqa: E402
from ftrun.snapshot import segment as shm  # noqa: E402
from ftrun.snapshot import verify  # noqa: E402
from ftrun.snapshot.manifest import flatten, manifest_blob, tensor_view  # noqa: E402
from ftrun.store.replica import WINDOW, Peer, ReplicaReceiver, ReplicaSender  # noqa: E402

SECRET = b"bench-replicate-secret-0123456789"
ORIGIN = "bench-sender"
HOLDER = "bench-receiver"
EPOCH = "bench"
RAW_END = b"end"


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def out(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


# -- receiving ----------------------------------------------------------------------------------


def receive(host: str, run_id: str) -> None:
    receiver = ReplicaReceiver(run_id, HOLDER, os.getpid(), SECRET)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 10_000)
    try:
        store = receiver.start(host)
        bind_host = f"[{host}]" if ":" in host else host
        sock.bind(f"tcp://{bind_host}:*")
        port = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        out(store=store, raw=join_endpoint(host, port))
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(sys.stdin.fileno(), zmq.POLLIN)
        received = 0
        while True:
            events = dict(poller.poll(1000))
            if sys.stdin.fileno() in events and not sys.stdin.buffer.read1(4096):
                return
            while sock in events:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                if frames[1].bytes == RAW_END:
                    sock.send_multipart([frames[0], str(received).encode()])
                    received = 0
                else:
                    received += len(frames[1])
    finally:
        sock.close(0)
        receiver.stop(unlink=True)


# -- sending ------------------------------------------------------------------------------------


def stage(run_id: str, size_mib: int) -> shm.Segment:
    """A rank's segment of ``size_mib`` MiB of float32 noise, as its store leaves it."""
    n = size_mib * 2**20 // 4 // 4
    gen = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(n, generator=gen) for i in range(4)}
    flat = flatten(state)
    blob = manifest_blob(flat, step=1, rank=0, world_size=1, meta={})
    seg = shm.Segment.create(shm.segment_name(run_id, 0, 0), manifest_cap=2 * len(blob) + 4096,
                             n_tensors=len(flat.tensors), data_len=flat.data_len,
                             owner_pid=os.getpid())
    try:
        with seg.data() as data:
            for entry, src in zip(flat.tensors, flat.sources, strict=True):
                tensor_view(data, entry).copy_(src)
            hashes = verify.hash_chunks(data, seg.header().chunk_size)
        xm = seg.write_manifest(blob)
        seg.set_state(shm.STAGED, step=1, epoch=EPOCH, manifest_len=len(blob), manifest_xxh3=xm)
        seg.set_state(shm.VERIFIED, hashes_xxh3=seg.write_hashes(hashes))
    except BaseException:
        seg.unlink()
        raise
    return seg


class Sender:
    def __init__(self, seg: shm.Segment, run_id: str, store: str, raw: str,
                 window: int) -> None:
        self.seg = seg
        self.step = 1
        self.sender = ReplicaSender(run_id, ORIGIN, os.getpid(), SECRET,
                                    lambda: (EPOCH, self.step), window=window)
        self.store = Peer(HOLDER, store)
        self.raw = raw
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(protocol.zmq_url(raw))

    def close(self) -> None:
        self.sender.stop()
        self.sock.close(0)

    def send_store(self) -> int:
        self.step += 1
        self.seg.set_state(shm.VERIFIED, step=self.step)
        self.sender.send_step(self.store, EPOCH, self.step)
        return self.seg.header().data_len

    def send_raw(self) -> int:
        h = self.seg.header()
        with memoryview(self.seg.mm) as mapped:
            for lo, hi in verify.chunk_ranges(h.data_len, h.chunk_size):
                self.sock.send(mapped[h.data_off + lo:h.data_off + hi], copy=False)
        self.sock.send(RAW_END)
        if not self.sock.poll(120_000):
            raise SystemExit(f"the raw receiver at {self.raw} did not answer within 120 s")
        got = int(self.sock.recv())
        if got != h.data_len:
            raise SystemExit(f"the raw receiver got {got} bytes of {h.data_len}")
        return got

    def timed(self, mode: str, k: int) -> None:
        c0, t0 = cpu_s(), time.perf_counter()
        n = self.send_raw() if mode == "raw" else self.send_store()
        out(mode=mode, transfer=k, bytes=n, s=time.perf_counter() - t0, cpu_s=cpu_s() - c0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role", choices=("recv", "send"))
    p.add_argument("--run-id", required=True)
    p.add_argument("--host", default="127.0.0.1", help="recv: the address to listen on")
    p.add_argument("--store", default="", help="send: the ReplicaReceiver's host:port")
    p.add_argument("--raw", default="", help="send: the raw receiver's host:port")
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--transfers", type=int, default=3, help="timed transfers, each way")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--window", type=int, default=WINDOW)
    args = p.parse_args()
    if args.role == "recv":
        receive(args.host, args.run_id)
        return 0
    seg = stage(args.run_id, args.size_mib)
    sender = Sender(seg, args.run_id, args.store, args.raw, args.window)
    try:
        for k in range(args.warmup):
            sender.timed("warmup", k)
        for k in range(args.transfers):
            for mode in ("raw", "store") if k % 2 == 0 else ("store", "raw"):
                sender.timed(mode, k)
    finally:
        sender.close()
        seg.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
