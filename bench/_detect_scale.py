"""bench/detect.py, part "scale": can one coordinator core keep up with thousands of ranks?

A real detection service (``ftrun.coordinator.detect_service``, the socket and thread the
coordinator runs) receives ``coll_report`` messages over TCP from ``--senders`` processes
that simulate ``ranks`` ranks of one data-parallel group, each reporting every 0.5 s as a
rank does, at ``collectives_per_s`` collectives per second per rank (a few of each report's
ops took longer than one poll interval, so they are listed with their durations, as in a
real report). After ``stall_after_s`` one simulated rank freezes (as under SIGSTOP: it enters
no collective and reports no more) while the others wait for it: the time until the service
names it is the detection latency at that scale.

Reported: reports sent and handled (and so whether the service kept up), coordinator CPU per
report and per collective the reports stand for, the service's backlog, and the detection
latency. The senders run in their own processes; the CPU measured is this process's, which
runs only the service.
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import secrets
import time
from typing import Any

REPORT_S = 0.5
INTERVAL_S = 0.02


def _sender(endpoint: str, secret: bytes, run_id: str, ranks: range, world: int,
            rate: float, duration_s: float, stall_rank: int, stall_at: float,
            t_start: float, sent: Any) -> None:
    from ftrun.protocol.transport import Client

    client = Client(endpoint, secret, run_id, sender=f"sim-{ranks.start}", sndhwm=100_000)
    n = 0
    seq = 0
    next_t = t_start
    try:
        while True:
            now = time.time()
            if now - t_start >= duration_s:
                break
            if now < next_t:
                time.sleep(min(next_t - now, 0.05))
                continue
            next_t += REPORT_S
            seq += 1
            elapsed = now - t_start
            done_ops = int(elapsed * rate)
            stalled = elapsed >= stall_at
            stall_seq = int(stall_at * rate)
            for r in ranks:
                host = f"sim{r // 8}"
                if stalled and r == stall_rank:
                    continue  # frozen (SIGSTOP): it reports no more
                if stalled:
                    enqueued = stall_seq if r == stall_rank else stall_seq + 1
                    completed = stall_seq
                    waiting = None if r == stall_rank else round(elapsed - stall_at, 3)
                    done: list[list[float]] = []
                else:
                    enqueued = completed = done_ops
                    waiting = None
                    done = [[max(1, done_ops - k), INTERVAL_S * (1 + (r + k) % 3)]
                            for k in range(2)]
                body = {
                    "node_id": f"{host}/1", "host": host, "rank": r, "world_size": world,
                    "restart": 0, "pid": 1000 + r, "backend": "nccl", "seq": seq,
                    "interval_s": INTERVAL_S,
                    "groups": [{"pg": "0", "size": world, "enqueued": enqueued,
                                "completed": completed, "waiting_s": waiting,
                                "done": done}],
                }
                if client.send("coll_report", body) is not None:
                    n += 1
    finally:
        with sent.get_lock():
            sent.value += n
        client.close()


def scale(*, ranks: int = 4096, senders: int = 4, collectives_per_s: float = 20.0,
          duration_s: float = 30.0, stall_after_s: float = 15.0) -> dict[str, Any]:
    from ftrun.coordinator.detect import DetectConfig
    from ftrun.coordinator.detect_service import DetectService

    run_id = f"scale-{secrets.token_hex(3)}"
    secret = secrets.token_hex(16).encode()
    found: list[tuple[float, Any]] = []

    def record(type_: str, node: Any, data: dict[str, Any]) -> None:
        if type_ == "detection":
            found.append((time.time(), data))

    service = DetectService(run_id, secret, DetectConfig(on_hang="warn"),
                            direct=lambda node, action, data: "x", record=record,
                            nodes=dict, coordinator_host="coordinator", excluded_file=None,
                            bind_host="127.0.0.1")
    endpoint = service.start()
    ctx = mp.get_context("spawn")
    sent = ctx.Value("q", 0)
    per = -(-ranks // senders)
    stall_rank = ranks // 2 + 3
    t_start = time.time() + 3.0  # the senders start together, once spawned
    procs = [ctx.Process(target=_sender, args=(
        endpoint, secret, run_id, range(i * per, min(ranks, (i + 1) * per)), ranks,
        collectives_per_s, duration_s, stall_rank, stall_after_s, t_start, sent))
        for i in range(senders)]
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(duration_s + 60)
        time.sleep(1.0)  # let the service drain what is queued
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        handled = service.counters["reports"]
        service.stop()
    cpu_s = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    hits = [(t, d) for t, d in found if stall_rank in d.get("ranks", [])]
    collectives = ranks * collectives_per_s * duration_s  # what the reports stand for
    return {
        "ranks": ranks, "senders": senders, "collectives_per_s": collectives_per_s,
        "duration_s": duration_s, "sent": sent.value, "handled": handled,
        "kept_up": handled >= 0.99 * sent.value,
        "cpu_s": round(cpu_s, 2), "cpu_share": round(cpu_s / duration_s, 3),
        "us_per_report": round(1e6 * cpu_s / max(1, handled), 1),
        "us_per_collective": round(1e6 * cpu_s / max(1.0, collectives), 3),
        "detected_s": round(hits[0][0] - (t_start + stall_after_s), 2) if hits else None,
        "named": hits[0][1]["ranks"] if hits else None,
        "other_findings": [d["kind"] for t, d in found if stall_rank not in d.get("ranks", [])],
    }


def table(row: dict[str, Any]) -> str:
    return "\n".join([
        "| ranks | reports sent / handled | kept up | coordinator CPU | µs per report | "
        "µs per collective | hang named after | named | other findings |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {row['ranks']} | {row['sent']} / {row['handled']} | {row['kept_up']} | "
        f"{row['cpu_share'] * 100:.0f}% of a core | {row['us_per_report']} | "
        f"{row['us_per_collective']} | {row['detected_s']} s | {row['named']} | "
        f"{row['other_findings'] or 'none'} |",
    ])
