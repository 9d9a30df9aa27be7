"""Benchmark: the coordinator under thousands of nodes, as an operator would run it.

    .venv/bin/python bench/control_plane.py [--nodes 1024,2048,4096] [--modes direct,aggregated]
        [--group 16] [--output bench/RESULTS.md]

For each node count N: a real ``ftrun coordinator`` process (it also hosts the rendezvous
store), and N simulated nodes of 8 workers each, spread over ``--generators`` processes. Every
simulated node is what a launcher's reporter is on the wire: its own connection, a ``hello``,
then one heartbeat a second composed by :class:`ftrun.coordinator.client.HeartbeatComposer`
(full when its state changed or every 30 s, a keep-alive otherwise; the workers' step moves
on every second), signed and validated by the real protocol code. After ``--warmup`` seconds
(every node joined and sent its first full heartbeat), over ``--seconds``:

- coordinator CPU per message: user + system CPU time of the coordinator process (its
  serving thread and ZeroMQ's I/O thread) over the messages it read in the window;
- its CPU load (CPU seconds per second: 1.0 is one core) and the messages per second;
- reply latency: round trips of a ``hello`` (answered with an ack) from one more client, every
  0.2 s, queued behind the nodes' heartbeats like any message;
- status latency: ``ftrun status``'s default request (summary and problem nodes), every 2 s;
- after the window, ``ftrun status`` run as an operator runs it (a new process), timed whole;
  and the whole document fetched page by page as ``ftrun status --json`` does: time, pages,
  bytes, the largest reply;
- the coordinator's resident memory (VmRSS at the end, VmHWM peak);
- false "lost": every simulated node stays alive, so every node reported lost by the end of
  the window is false (read while the generators still run).

Two modes (``--modes``, each node count run in each, side by side): ``direct``, every node
reports to the coordinator itself as above; ``aggregated`` (ftrun.coordinator.aggregation),
the nodes are cut into groups of ``--group`` by node rank, and each group's aggregator sends
its members' heartbeats and keep-alives (each composed by the member's own composer) in one
``aggregate`` message per interval over its own connection; it follows the coordinator's
plan (the members' ``plan`` numbers, full heartbeats when asked) as the launcher's relay
does. The hop from member to aggregator costs the aggregator, not the coordinator, and is not
simulated; hellos travel on the aggregators' connections.

The machine this runs on is shared: the generators and the coordinator compete for its cores,
so a generator may fall behind its schedule (``late`` is how far).

``--reform`` measures instead the vote that re-forms a world whose members stay (an in-process
restart that keeps the membership, ftrun.launcher.reform) at N nodes: one c10d TCPStore
server (libuv, as the rendezvous store is), N voters each with a connection of its own,
spread over ``--generators`` processes of a thread per voter; every voter runs
``Reform.vote(keep=True)`` once a start key is written, as a launcher does after its ranks
failed in place. Reported: the time from the start to the last voter holding the decision,
the median, the decision each got, and the store operations per voter (one addition, the
wait, a read; the last voter's compare-and-set; a wait that outlives ``CHECK_EVERY_S`` is
asked again):

    .venv/bin/python bench/control_plane.py --reform --nodes 1024,4096,16384 --generators 16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import zmq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ftrun import jobs  # noqa: E402
from ftrun.coordinator.client import (  # noqa: E402
    FULL_EVERY_S,
    HeartbeatComposer,
    coordinator_client,
)
from ftrun.coordinator.directives import REPORT_ACTION  # noqa: E402
from ftrun.protocol.transport import Client  # noqa: E402
from ftrun.testing import free_port  # noqa: E402

WORKERS = 8
COLL_SUMMARY_S = 0.25  # ftrun.coordinator.collsum.SUMMARY_S (urgent; 1 s otherwise)
CULPRIT = 5  # the rank that hangs (--hang)


def worker_state(node: int, step: int, interval_s: float = 1.0) -> dict[str, Any]:
    """What a healthy launcher of 8 workers reports (verdict fields included)."""
    return {
        "state": "healthy", "group_rank": node, "group_world_size": None, "restarts": 0,
        "max_restarts": 3, "last_error": None,
        "workers": [{"local_rank": i, "rank": node * WORKERS + i, "pid": 10_000 + i,
                     "state": "healthy", "exitcode": None, "health": "ok", "cause": None,
                     "reason": None, "step": step, "progress_age_s": 0.25,
                     "step_interval_s": interval_s, "progress_limit_s": 30.0}
                    for i in range(WORKERS)],
    }


# -- a generator process: ``count`` simulated nodes ------------------------------------------


def paced(n: int, t0: float, seconds: float, interval_s: float, clients: list[Client],
          stats: dict[str, Any]) -> Iterator[tuple[int, int, float]]:
    """(round r, sender j, now) for the ``n`` senders in turn, each once per interval
    (sender j of round r is due at t0 + (r + j / n) * interval), until ``seconds`` passed;
    reads replies while it waits, and notes in ``stats`` how late it fell behind."""
    end = t0 + seconds
    k = 0
    while True:
        r, j = divmod(k, n)
        due = t0 + (r + j / n) * interval_s
        now = time.monotonic()
        if due >= end:
            return
        if due > now:
            time.sleep(min(due - now, 0.05))
            for client in clients[::max(1, n // 64)]:
                client.poll(0)
            continue
        stats["late_max_s"] = max(stats["late_max_s"], now - due)
        yield r, j, now
        k += 1


def generate(endpoint: str, secret: bytes, job: str, first: int, count: int,
             seconds: float, interval_s: float, full_every_s: float,
             group: int = 0, coll: bool = False, hang_wall: float = 0.0,
             hang_kind: str = "elsewhere") -> dict[str, Any]:
    if group > 1:
        return generate_aggregated(endpoint, secret, job, first, count, seconds, interval_s,
                                   full_every_s, group, coll, hang_wall, hang_kind)
    ctx: zmq.Context[Any] = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 3 * count + 64)  # a client, its monitor and ZeroMQ's end
    asked: set[int] = set()
    nodes = []
    for i in range(first, first + count):
        node_id = f"sim-{i:05d}/1"
        composer = HeartbeatComposer(node_id, f"sim-{i:05d}", 1, full_every_s)

        def on_reply(msg: Any, i: int = i) -> None:
            if msg.kind == "directives" and any(d["action"] == REPORT_ACTION
                                                for d in msg.body["directives"]):
                asked.add(i)

        client = coordinator_client(endpoint, secret, job, node_id, context=ctx,
                                    on_reply=on_reply)
        nodes.append((i, composer, client))
    stats = {"sent": 0, "dropped": 0, "full": 0, "keepalive": 0, "asked_full": 0,
             "late_max_s": 0.0}
    t0 = time.monotonic()
    for i, _, client in nodes:
        client.send("hello", {"node_id": f"sim-{i:05d}/1", "host": f"sim-{i:05d}", "pid": 1})
    step = 0
    for r, j, now in paced(count, t0, seconds, interval_s,
                           [client for *_, client in nodes], stats):
        i, composer, client = nodes[j]
        if i in asked:
            asked.discard(i)
            composer.want_full()
            stats["asked_full"] += 1
        step = r
        kind, body = composer.compose(worker_state(i, step), now)
        stats["full" if kind == "heartbeat" else "keepalive"] += 1
        if client.send(kind, body) is None:
            stats["dropped"] += 1
            composer.want_full()
        else:
            stats["sent"] += 1
        if j % 256 == 255:
            for _, _, c in nodes[j - 255:j + 1]:
                c.poll(0)
    for _, _, client in nodes:
        client.close()
    ctx.term()
    return stats


def coll_summary(g0: int, members: list[int], r: int, hang_wall: float, hang_kind: str,
                 seq: int) -> dict[str, Any]:
    """What a group's aggregator sends the detection service (every second; every 0.25 s
    once ranks have waited 0.5 s): its members' 8 ranks each summarised
    (ftrun.coordinator.collsum). Healthy: most ranks between two
    collectives, a few waiting a moment in the next; each op takes 4 ms. From ``hang_wall``
    on, global rank CULPRIT (node 0) never enters the next op: it waits in a side group
    (``elsewhere``) or falls silent (``silent``), and every other rank waits in the op."""
    ranks = [i * WORKERS + k for i in members for k in range(WORKERS)]
    now = time.time()
    hung = hang_wall and now >= hang_wall
    e = int(hang_wall * 4) if hung else int(now * 4)  # one op per round
    body: dict[str, Any] = {"node_id": f"sim-{g0:05d}/1",
                            "nodes": [f"sim-{i:05d}/1" for i in members], "restart": 0,
                            "interval_s": 0.02, "seq": seq, "world": "sim:29500"}
    if not hung:
        classes = [{"enqueued": e, "completed": e, "count": len(ranks) - 16,
                    "ranks": ranks[:8], "waiting": 0},
                   {"enqueued": e + 1, "completed": e, "count": 16, "ranks": ranks[-16:-8],
                    "waiting": 16, "waiting_min_s": 0.001, "waiting_max_s": 0.003,
                    "op": "gloo:all_reduce"}]
    else:
        wait = round(now - hang_wall, 4)
        others = [x for x in ranks if x != CULPRIT]
        classes = [{"enqueued": e + 1, "completed": e, "count": len(others),
                    "ranks": others[:8], "waiting": len(others), "waiting_min_s": wait,
                    "waiting_max_s": wait, "op": "gloo:all_reduce"}]
        if CULPRIT in ranks:
            c: dict[str, Any] = {"enqueued": e, "completed": e, "count": 1,
                                 "ranks": [CULPRIT], "waiting": 0}
            if hang_kind == "elsewhere":
                c["elsewhere"] = [[CULPRIT, "side", 3, wait]]
            elif wait >= 1.5:
                body["silent"] = [[CULPRIT, wait]]
            classes.append(c)
    body["groups"] = [{"pg": "0", "size": 1 << 30, "members": len(ranks), "classes": classes,
                       "ops": [[e - 1, 0.004]]}]
    if seq % 20 == 1:
        body["roster"] = [[x, f"sim-{x // WORKERS:05d}/1", f"sim-{x // WORKERS:05d}"]
                          for x in ranks]
    return body


def generate_aggregated(endpoint: str, secret: bytes, job: str, first: int, count: int,
                        seconds: float, interval_s: float, full_every_s: float,
                        group: int, coll: bool = False, hang_wall: float = 0.0,
                        hang_kind: str = "elsewhere") -> dict[str, Any]:
    """``count`` nodes from ``first`` as groups of ``group``: one connection and one
    ``aggregate`` a second per group, each holding every member's own report; with ``coll``,
    also one collective summary every 0.25 s per group to the detection service, on a
    connection of its own."""
    ctx: zmq.Context[Any] = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 6 * (count // group + 1) + 64)  # 2 clients a group, 3 sockets each
    plans: dict[int, int] = {}  # node -> the plan it follows
    want_full: set[int] = set()
    detect: list[str] = []  # the detection endpoint, from the answer to hello
    groups = []
    for g0 in range(first, first + count, group):
        members = list(range(g0, min(g0 + group, first + count)))
        composers = {i: HeartbeatComposer(f"sim-{i:05d}/1", f"sim-{i:05d}", 1, full_every_s)
                     for i in members}

        def on_reply(msg: Any) -> None:
            if msg.kind == "ack" and msg.body.get("detect") and not detect:
                detect.append(msg.body["detect"])
            if msg.kind != "aggregate_reply":
                return
            for entry in msg.body["members"]:
                i = int(entry["node_id"][4:9])
                for d in entry["directives"]:
                    if d["action"] == REPORT_ACTION:
                        want_full.add(i)
                    elif d["action"] == "aggregate":
                        plans[i] = int(d["data"]["plan"])

        client = coordinator_client(endpoint, secret, job, f"sim-{g0:05d}/1", context=ctx,
                                    on_reply=on_reply, sndhwm=100)
        groups.append((g0, members, composers, client))
    stats = {"sent": 0, "dropped": 0, "full": 0, "keepalive": 0, "asked_full": 0,
             "late_max_s": 0.0, "reports": 0, "summaries": 0, "summaries_dropped": 0}
    t0 = time.monotonic()
    for _, members, _, client in groups:
        for i in members:
            client.send("hello", {"node_id": f"sim-{i:05d}/1", "host": f"sim-{i:05d}",
                                  "pid": 1})
    detect_clients: dict[int, Client] = {}
    per_beat = max(1, round(interval_s / COLL_SUMMARY_S)) if coll else 1
    for r, j, now in paced(len(groups), t0, seconds, interval_s / per_beat,
                           [client for *_, client in groups], stats):
        g0, members, composers, client = groups[j]
        urgent = hang_wall and time.time() >= hang_wall + 0.5  # waits past URGENT_WAIT_S
        if coll and detect and (r % per_beat == 0 or urgent):
            dc = detect_clients.get(g0)
            if dc is None:
                dc = detect_clients[g0] = Client(detect[0], secret, job, f"sim-{g0:05d}/1",
                                                 peer="detection", send_timeout_s=0.0,
                                                 sndhwm=16, context=ctx)
            ok = dc.send("coll_summary", coll_summary(g0, members, r, hang_wall, hang_kind,
                                                      r + 1)) is not None
            stats["summaries" if ok else "summaries_dropped"] += 1
        if r % per_beat:
            continue
        heartbeats, keepalives = [], []
        for i in members:
            composer = composers[i]
            if i in want_full:
                want_full.discard(i)
                composer.want_full()
                stats["asked_full"] += 1
            state = worker_state(i, r)
            if i == g0:
                state["aggr_addr"] = f"sim-{g0:05d}:1"
            kind, body = composer.compose(state, now)
            if i in plans:
                body["plan"] = plans[i]
            stats["full" if kind == "heartbeat" else "keepalive"] += 1
            (heartbeats if kind == "heartbeat" else keepalives).append(body)
        if client.send("aggregate", {"node_id": f"sim-{g0:05d}/1", "heartbeats": heartbeats,
                                     "keepalives": keepalives}) is None:
            stats["dropped"] += 1
            for i in members:
                composers[i].want_full()
        else:
            stats["sent"] += 1
            stats["reports"] += len(members)
        if j % 64 == 63:
            for *_, c in groups[j - 63:j + 1]:
                c.poll(0)
    for *_, client in groups:
        client.close()
    for dc in detect_clients.values():
        dc.close()
    ctx.term()
    return stats


# -- the measurement -------------------------------------------------------------------------


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (ZeroMQ's I/O thread is ``ZMQbg/IO/0``)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        out[name] = out.get(name, 0.0) + cpu
    return out


def proc_mem_mib(pid: int) -> tuple[float, float]:
    rss = hwm = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
        elif line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) / 1024
    return rss, hwm


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def status_page(client: Client, body: dict[str, Any]) -> tuple[dict[str, Any], int, float]:
    t = time.perf_counter()
    reply = client.request("status_request", body, "status_reply", 30.0)
    dt = time.perf_counter() - t
    size = len(json.dumps(reply.body["doc"], separators=(",", ":")))
    return reply.body["doc"], size, dt


def run_one(n_nodes: int, mode: str, args: argparse.Namespace,
            env: dict[str, str]) -> dict[str, Any]:
    group = args.group if mode == "aggregated" else 0
    env = {**env, "FTRUN_AGGREGATE_GROUP": str(group)}
    tmp = Path(tempfile.mkdtemp(prefix="ftrun-cp-"))
    run_id = f"cp{n_nodes}-{os.getpid()}"
    state = str(tmp / "state")
    rdzv = f"127.0.0.1:{free_port()}"
    with open(tmp / "coordinator.log", "w") as log_fh:
        coord = subprocess.Popen(
            [sys.executable, "-m", "ftrun.cli.main", "coordinator", "--rdzv-endpoint", rdzv,
             "--rdzv-id", run_id, "--state-dir", state, "--node-timeout",
             str(args.node_timeout)],
            env=env, stdout=subprocess.DEVNULL, stderr=log_fh,
        )
    gens: list[subprocess.Popen[str]] = []
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                endpoint = jobs.read_job_file(run_id, state).endpoint
                break
            except Exception:  # noqa: BLE001 - not written yet
                if time.monotonic() > deadline or coord.poll() is not None:
                    raise RuntimeError(f"ftrun coordinator did not start: "
                                       f"{(tmp / 'coordinator.log').read_text()[-2000:]}"
                                       ) from None
                time.sleep(0.1)
        secret = jobs.load_secret(run_id, state, create=False)
        total = args.warmup + args.seconds
        coll = args.coll and group > 1
        # The hang starts halfway through the window: the first half measures the steady
        # state, the second the hang's (summaries four times a second while ranks wait).
        hang_wall = time.time() + 1.0 + args.warmup + args.seconds / 2 \
            if coll and args.hang != "none" else 0.0
        per = -(-n_nodes // args.generators)
        if group > 1:  # whole groups per generator
            per = -(-per // group) * group
        for g in range(args.generators):
            first, count = g * per, min(per, n_nodes - g * per)
            if count <= 0:
                break
            gens.append(subprocess.Popen(
                [sys.executable, __file__, "_generate", "--endpoint", endpoint,
                 "--secret-hex", secret.hex(), "--job", run_id, "--first", str(first),
                 "--count", str(count), "--seconds", str(total),
                 "--interval", str(args.interval), "--full-every", str(args.full_every),
                 "--group", str(group), "--hang-wall", repr(hang_wall), "--hang-kind",
                 args.hang] + (["--coll"] if coll else []),
                env=env, stdout=subprocess.PIPE, text=True))
        client = coordinator_client(endpoint, secret, run_id, "bench-probe")
        t_start = time.monotonic()
        time.sleep(args.warmup)
        doc, _, _ = status_page(client, {"nodes": "none"})
        cpu0, msgs0, t0 = proc_cpu_s(coord.pid), doc["coordinator"]["messages"]["messages"], \
            time.monotonic()
        threads0 = thread_cpu_s(coord.pid)
        latencies: list[float] = []
        status_lat: list[float] = []
        next_status = t0
        at_hang: tuple[float, float] | None = None  # (CPU, monotonic) when the hang began
        while time.monotonic() < t_start + total - 0.5:
            if hang_wall and at_hang is None and time.time() >= hang_wall:
                at_hang = (proc_cpu_s(coord.pid), time.monotonic())
            t = time.perf_counter()
            client.request("hello", {"node_id": "bench-probe/1", "host": "bench-probe",
                                     "pid": os.getpid()}, "ack", 30.0)
            latencies.append(time.perf_counter() - t)
            if time.monotonic() >= next_status:
                next_status += 2.0
                _, _, dt = status_page(client, {"nodes": "problems"})
                status_lat.append(dt)
            time.sleep(0.2)
        doc, _, _ = status_page(client, {"nodes": "none"})
        cpu1, msgs1, t1 = proc_cpu_s(coord.pid), doc["coordinator"]["messages"]["messages"], \
            time.monotonic()
        # False "lost" is read here, while every simulated node still reports: once the
        # generators stop, every node falls silent, and on a slow machine the reads below
        # can outlast the node timeout.
        lost_at_end, t1_wall = doc["summary"]["nodes_lost"], time.time()
        agg = doc["coordinator"].get("aggregation") or {}
        threads1 = thread_cpu_s(coord.pid)
        by_thread = {name: round((threads1[name] - threads0.get(name, 0.0))
                                 / max(1, msgs1 - msgs0) * 1e6, 1)
                     for name in threads1 if threads1[name] - threads0.get(name, 0.0) > 0}
        gen_stats = []
        for p in gens:
            out, _ = p.communicate(timeout=300)
            gen_stats.append(json.loads(out.strip().splitlines()[-1]))
        # `ftrun status` as an operator types it (a new process: interpreter start, the job
        # file, the request and the table of problem nodes), timed whole.
        t = time.perf_counter()
        cli = subprocess.run([sys.executable, "-m", "ftrun", "status", run_id,
                              "--state-dir", state], env=env, capture_output=True, text=True,
                             timeout=60, check=False)
        cli_s = time.perf_counter() - t
        if cli.returncode not in (0, 3):
            raise RuntimeError(f"ftrun status failed ({cli.returncode}): {cli.stderr[-2000:]}")
        # The whole document, page by page (ftrun status --json).
        t = time.perf_counter()
        offset: int | None = 0
        pages, nbytes, largest, listed = 0, 0, 0, 0
        while offset is not None:
            page, size, _ = status_page(client, {"nodes": "all", "offset": offset})
            pages, nbytes, largest = pages + 1, nbytes + size, max(largest, size)
            listed += len(page["nodes"])
            offset = page["page"]["next"]
        full_s = time.perf_counter() - t
        final = page
        rss, hwm = proc_mem_mib(coord.pid)
        lost_events = 0
        detections: list[dict[str, Any]] = []
        since = 0
        while True:
            reply = client.request("events_request", {"since": since}, "events_reply", 30.0)
            events = reply.body["events"]
            lost_events += sum(1 for e in events if e["type"] == "node_lost"
                               and e["ts"] <= t1_wall
                               and str(e.get("node", "")).startswith("sim-"))
            detections += [e for e in events if e["type"] == "detection"]
            if not reply.body.get("more") or not events:
                break
            since = events[-1]["seq"]
        client.close()
        msgs = msgs1 - msgs0
        named = [e for e in detections if hang_wall and e.get("time", 0) >= hang_wall]
        first = min(named, key=lambda e: e["time"]) if named else None
        steady, during = (None, None) if at_hang is None else (
            (at_hang[0] - cpu0) / (at_hang[1] - t0), (cpu1 - at_hang[0]) / (t1 - at_hang[1]))
        return {
            "coll": coll, "hang": args.hang if coll else "none",
            "cpu_load_before_hang": round(steady, 3) if steady is not None else None,
            "cpu_load_after_hang": round(during, 3) if during is not None else None,
            "summaries_per_s": round(sum(g.get("summaries", 0) for g in gen_stats) / total, 1),
            "hang_named_s": round(first["time"] - hang_wall, 2) if first else None,
            "hang_ranks": first["ranks"] if first else None,
            "false_findings": sum(1 for e in detections if not hang_wall
                                  or e.get("time", 0) < hang_wall),
            "mode": mode, "group": group or 1,
            "nodes": n_nodes, "ranks": n_nodes * WORKERS, "full_every_s": args.full_every,
            "window_s": round(t1 - t0, 2), "messages": msgs,
            "msg_per_s": round(msgs / (t1 - t0), 1),
            "cpu_us_per_msg": round((cpu1 - cpu0) / max(1, msgs) * 1e6, 1),
            "cpu_load": round((cpu1 - cpu0) / (t1 - t0), 3),
            "cpu_us_per_msg_by_thread": by_thread,
            # Python threads (the serving thread does all their work), and ZeroMQ's I/O.
            "cpu_us_python": round(sum(v for k, v in by_thread.items()
                                       if not k.startswith("ZMQ")), 1),
            "cpu_us_zmq_io": round(sum(v for k, v in by_thread.items()
                                       if k.startswith("ZMQ")), 1),
            "reply_ms_p50": round(pct(latencies, 0.5) * 1e3, 2),
            "reply_ms_p99": round(pct(latencies, 0.99) * 1e3, 2),
            "reply_ms_max": round(max(latencies) * 1e3, 2) if latencies else None,
            "status_ms_p50": round(pct(status_lat, 0.5) * 1e3, 1),
            "status_ms_max": round(max(status_lat) * 1e3, 1) if status_lat else None,
            "cli_status_s": round(cli_s, 3),
            "full_status_s": round(full_s, 3), "full_status_pages": pages,
            "full_status_bytes": nbytes, "largest_reply_bytes": largest,
            "listed": listed, "joined": final["summary"]["nodes"] - 1,
            "rss_mib": round(rss, 1), "peak_rss_mib": round(hwm, 1),
            "lost": lost_at_end, "lost_events": lost_events,
            "behind_s": final["coordinator"]["behind_s"],
            "sent": sum(g["sent"] for g in gen_stats),
            "full": sum(g["full"] for g in gen_stats),
            "keepalive": sum(g["keepalive"] for g in gen_stats),
            "dropped": sum(g["dropped"] for g in gen_stats),
            "asked_full": sum(g["asked_full"] for g in gen_stats),
            "gen_late_max_s": round(max(g["late_max_s"] for g in gen_stats), 2),
            "reports_per_s": round(sum(g.get("reports", g["sent"]) for g in gen_stats) / total,
                                   1),
            "groups": agg.get("groups", 0),
            "members_via_aggregator": agg.get("members_via_aggregator", 0),
        }
    finally:
        for p in gens:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        coord.terminate()
        try:
            coord.wait(15)
        except subprocess.TimeoutExpired:
            coord.kill()
            coord.wait(10)


COLUMNS = [
    ("mode", "mode"), ("nodes", "nodes"), ("ranks", "ranks"), ("group", "group"),
    ("reports_per_s", "node reports/s"), ("msg_per_s", "msgs/s"), ("cpu_us_per_msg", "CPU µs/msg"),
    ("cpu_us_python", "of which Python"), ("cpu_us_zmq_io", "of which ZeroMQ I/O"),
    ("cpu_load", "CPU load (cores)"),
    ("reply_ms_p50", "reply p50 ms"), ("reply_ms_p99", "reply p99 ms"),
    ("status_ms_p50", "status p50 ms"), ("status_ms_max", "status max ms"),
    ("cli_status_s", "`ftrun status` s"),
    ("full_status_s", "full --json s"), ("full_status_pages", "pages"),
    ("largest_reply_bytes", "largest reply B"), ("peak_rss_mib", "peak RSS MiB"),
    ("lost", "lost (false)"), ("gen_late_max_s", "generator late s"),
    ("summaries_per_s", "coll summaries/s"), ("cpu_load_before_hang", "CPU before hang"),
    ("cpu_load_after_hang", "CPU after hang"), ("hang", "hang"),
    ("hang_named_s", "hang named after s"), ("hang_ranks", "named"),
    ("false_findings", "false findings"),
]


def reform_voters(host: str, port: int, prefix: str, nodes: int, count: int,
                  timeout_s: float) -> dict[str, Any]:
    """``count`` voters of a re-formation among ``nodes`` (one generator process): their
    connections opened, then each votes in a thread of its own once the start key is there.
    Returns when each decided, relative to the start, and what it decided."""
    import resource
    import threading
    from datetime import timedelta

    from torch.distributed import TCPStore

    from ftrun.launcher.reform import Reform

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * count + 256)), hard))
    stores = [TCPStore(host, port, None, False, timedelta(seconds=timeout_s),
                       wait_for_workers=False, use_libuv=True) for _ in range(count)]
    print("ready", flush=True)
    threading.stack_size(256 << 10)
    got: list[tuple[float, str, float]] = []
    lock = threading.Lock()

    def vote(store: Any) -> None:
        store.wait([f"{prefix}/go"], timedelta(seconds=timeout_s))
        d = Reform(store, prefix, nodes).vote(True, "", None, timeout_s, lambda: None)
        with lock:
            got.append((time.time(), d.verdict, d.waited_s))

    threads = [threading.Thread(target=vote, args=(s,), daemon=True) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    go = float(stores[0].get(f"{prefix}/go").decode())
    return {"decided": [t - go for t, _, _ in got], "verdicts": [v for _, v, _ in got],
            "waited": [w for _, _, w in got], "count": count}


def run_reform(n_nodes: int, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    from datetime import timedelta

    from torch.distributed import TCPStore

    from ftrun.launcher.reform import CHECK_EVERY_S

    port = free_port()
    server = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=args.reform_timeout),
                      wait_for_workers=False, use_libuv=True)
    prefix = f"reform-{n_nodes}"
    per = [n_nodes // args.generators + (i < n_nodes % args.generators)
           for i in range(args.generators)]
    t_open = time.monotonic()
    gens = [subprocess.Popen(
        [sys.executable, __file__, "_reform", "--port", str(port), "--prefix", prefix,
         "--voters", str(n_nodes), "--count", str(c), "--timeout", str(args.reform_timeout)],
        stdout=subprocess.PIPE, text=True, env=env) for c in per if c]
    try:
        for g in gens:
            line = g.stdout.readline() if g.stdout else ""
            if line.strip() != "ready":
                raise RuntimeError(f"a voter process did not connect ({line!r})")
        opened = time.monotonic() - t_open
        cpu0 = proc_cpu_s(os.getpid())
        server.set(f"{prefix}/go", repr(time.time()))
        outs = []
        for g in gens:
            out, _ = g.communicate(timeout=args.reform_timeout + 60)
            outs.append(json.loads(out.strip().splitlines()[-1]))
        server_cpu = proc_cpu_s(os.getpid()) - cpu0
    finally:
        for g in gens:
            if g.poll() is None:
                g.kill()
                g.wait(timeout=30)
    decided = sorted(x for o in outs for x in o["decided"])
    verdicts = [v for o in outs for v in o["verdicts"]]
    waited = [w for o in outs for w in o["waited"]]
    if len(decided) != n_nodes or set(verdicts) != {"keep"}:
        raise RuntimeError(f"{n_nodes} voters: {len(decided)} decided, verdicts "
                           f"{sorted(set(verdicts))}")
    asks = sum(1 + int(w // CHECK_EVERY_S) for w in waited)
    return {"nodes": n_nodes, "connect_s": round(opened, 1),
            "last_decided_s": round(decided[-1], 3), "median_decided_s":
            round(decided[len(decided) // 2], 3), "verdicts": "keep" if verdicts else "",
            "ops_per_voter": round(3 + asks / n_nodes + 1 / n_nodes, 2),
            "server_cpu_s": round(server_cpu, 2)}


def reform_table(results: list[dict[str, Any]]) -> str:
    lines = ["| nodes | start -> last voter decided (s) | median (s) | decision | store ops "
             "per voter | the store's CPU s (its process) | connections opened in (s) |",
             "|---:|---:|---:|---|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['nodes']:,} | {r['last_decided_s']} | {r['median_decided_s']} | "
                     f"{r['verdicts']} (all) | {r['ops_per_voter']} | {r['server_cpu_s']} | "
                     f"{r['connect_s']} |")
    return "\n".join(lines)


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for r in results:
        lines.append("| " + " | ".join(str(r[k]) for k, _ in COLUMNS) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd")
    g = sub.add_parser("_generate")
    g.add_argument("--endpoint", required=True)
    g.add_argument("--secret-hex", required=True)
    g.add_argument("--job", required=True)
    g.add_argument("--first", type=int, required=True)
    g.add_argument("--count", type=int, required=True)
    g.add_argument("--seconds", type=float, required=True)
    g.add_argument("--interval", type=float, default=1.0)
    g.add_argument("--full-every", type=float, default=FULL_EVERY_S)
    g.add_argument("--group", type=int, default=0)
    g.add_argument("--coll", action="store_true")
    g.add_argument("--hang-wall", type=float, default=0.0)
    g.add_argument("--hang-kind", default="elsewhere")
    v = sub.add_parser("_reform")
    v.add_argument("--port", type=int, required=True)
    v.add_argument("--prefix", required=True)
    v.add_argument("--voters", type=int, required=True)
    v.add_argument("--count", type=int, required=True)
    v.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--reform", action="store_true",
                        help="measure the re-formation vote (ftrun.launcher.reform) at each "
                             "node count instead")
    parser.add_argument("--reform-timeout", type=float, default=300.0)
    parser.add_argument("--nodes", default="1024,2048,4096")
    parser.add_argument("--seconds", type=float, default=20.0, help="measurement window")
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=1.0, help="heartbeat interval")
    parser.add_argument("--generators", type=int, default=2)
    parser.add_argument("--full-every", type=float, default=FULL_EVERY_S,
                        help="seconds between full heartbeats of an unchanged node (0: every "
                             "heartbeat is full, as before keep-alives)")
    parser.add_argument("--modes", default="direct",
                        help="direct, aggregated, or both (comma-separated): each node count "
                             "is run in each")
    parser.add_argument("--group", type=int, default=16,
                        help="launchers per aggregation group in the aggregated mode")
    parser.add_argument("--node-timeout", type=float, default=10.0)
    parser.add_argument("--coll", action="store_true",
                        help="aggregated mode: each group's aggregator also sends its ranks' "
                             "collective reports summarised to the detection service every "
                             "second, every 0.25 s once a wait passes 0.5 s "
                             "(ftrun.coordinator.collsum)")
    parser.add_argument("--hang", default="elsewhere", choices=("elsewhere", "silent", "none"),
                        help="with --coll: a third into the window rank 5 hangs, waiting in "
                             "a side group (elsewhere) or silent, while every other rank "
                             "waits for it; reports how long until it is named")
    parser.add_argument("--output", type=Path, default=None,
                        help="append the results as a section of this Markdown file")
    args = parser.parse_args()
    if args.cmd == "_generate":
        stats = generate(args.endpoint, bytes.fromhex(args.secret_hex), args.job, args.first,
                         args.count, args.seconds, args.interval, args.full_every, args.group,
                         args.coll, args.hang_wall, args.hang_kind)
        print(json.dumps(stats), flush=True)
        return 0
    if args.cmd == "_reform":
        print(json.dumps(reform_voters("127.0.0.1", args.port, args.prefix, args.voters,
                                       args.count, args.timeout)), flush=True)
        return 0
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if args.reform:
        results = []
        for n in (int(x) for x in args.nodes.split(",")):
            r = run_reform(n, args, env)
            print(json.dumps(r), flush=True)
            results.append(r)
        text = (f"\n## Re-formation vote at scale (`bench/control_plane.py --reform`)\n\n"
                f"`python bench/control_plane.py {' '.join(sys.argv[1:])}`, "
                f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}: "
                f"{os.cpu_count()} CPU cores, shared by the store and the "
                f"{args.generators} voter processes.\n\n" + reform_table(results) + "\n")
        print(text)
        if args.output is not None:
            with open(args.output, "a", encoding="utf-8") as f:
                f.write(text)
        return 0
    results = []
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"direct", "aggregated"}:
        parser.error(f"--modes {args.modes!r}: give direct, aggregated, or both")
    for n in (int(x) for x in args.nodes.split(",")):
        for mode in modes:
            r = run_one(n, mode, args, env)
            print(json.dumps(r), flush=True)
            results.append(r)
    cmd = "python bench/control_plane.py " + " ".join(sys.argv[1:])
    text = (f"\n## Control plane at scale (`bench/control_plane.py`)\n\n"
            f"`{cmd}`, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
            f"{platform.node()}: {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
            f"shared by the coordinator, the {args.generators} generator processes and "
            f"other work; modes {', '.join(modes)} (aggregation groups of {args.group}); "
            f"heartbeats every {args.interval:g} s (full every "
            f"{args.full_every:g} s when unchanged, keep-alives between), 8 workers per node, "
            f"{args.seconds:g} s window after {args.warmup:g} s warm-up.\n\n"
            + table(results) + "\n")
    print(text)
    if args.output is not None:
        with open(args.output, "a", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
