"""``ftrun inspect (RUN_ID | PATH)``: what a snapshot holds, persisted on disk or live in memory.

PATH (an existing directory) is a persist directory (``step_*`` inside), one ``step_<S>`` or
one ``rank_<r>`` directory: steps (complete or partial), the ranks of the chosen step and
their tensors. RUN_ID is a job running on this host: its stores on this host say which
segments hold which shards (their catalogs; when none answers, the job's segments are looked
up by name in /dev/shm), the segments are read (through :class:`ftrun.store.catalog.Catalog`,
read-only: nothing here names or maps a segment), and the coordinator, when it answers, adds
what it has committed and, with replicas, what is durable and which nodes hold a verified
replica of each rank's shard. ``--verify`` re-hashes the chosen step: every tensor on disk,
every chunk in memory.

Plain functions the typer layer calls; they write to stdout/stderr and return an exit code
from :mod:`ftrun.exit_codes`. JSON output goes through ``sys.stdout.write`` only.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

from ftrun import exit_codes, jobs, knobs
from ftrun.coordinator.client import request
from ftrun.errors import ConfigError, FtrunError, IntegrityError, JobNotFoundError
from ftrun.protocol.transport import Client
from ftrun.snapshot import persist, verify
from ftrun.snapshot.api import SegmentState
from ftrun.snapshot.manifest import entries
from ftrun.store.catalog import Catalog, Look

INSPECT_VERSION = 1
COORDINATOR_TIMEOUT_S = 2.0
STORE_TIMEOUT_S = 2.0
WIDE = 200  # columns when stdout is not a terminal: never cut a tensor key


class _StepNotFound(JobNotFoundError):
    """The asked-for step is not there (exit NOT_FOUND)."""


def _fail(e: FtrunError) -> int:
    sys.stderr.write(f"ftrun inspect: {e}\n")
    sys.stderr.flush()
    return exit_codes.for_error(e)


def run_inspect(target: str, *, step: int | None, json_out: bool, verify: bool,
                state_dir: str | None) -> int:
    """``ftrun inspect``: show a persisted checkpoint (PATH) or a live job's snapshots (RUN_ID)."""
    try:
        path = Path(target).expanduser()
        if path.exists():
            if not path.is_dir():
                raise ConfigError(
                    f"{path} is a file; pass a checkpoint directory (a persist directory, a "
                    "step_<S> or a rank_<r> directory) or the run id of a job on this host"
                )
            doc = _persisted(path, step=step, verify=verify)
        else:
            doc = _live(target, step=step, verify=verify, state_dir=state_dir)
    except FtrunError as e:
        return _fail(e)
    for problem in doc["problems"]:
        sys.stderr.write(f"ftrun inspect: {problem}\n")
    sys.stderr.flush()
    if json_out:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()
    else:
        _render(doc)
    failed = doc["problems"] or (doc["verify"] is not None and doc["verify"]["mismatches"])
    return exit_codes.FAILED if failed else exit_codes.OK


# -- helpers ----------------------------------------------------------------------------------


def _tensor_rows(doc: dict[str, Any], hashes: list[int | None]) -> list[dict[str, Any]]:
    return [{"key": e.key, "dtype": e.dtype, "shape": list(e.shape), "bytes": e.nbytes,
             "xxh3": persist.xxh3_hex(h) if h is not None else None}
            for e, h in zip(entries(doc), hashes, strict=True)]


def _totals(ranks: list[dict[str, Any]]) -> dict[str, int]:
    return {"ranks": len(ranks), "tensors": sum(len(r["tensors"]) for r in ranks),
            "bytes": sum(t["bytes"] for r in ranks for t in r["tensors"])}


@contextmanager
def _progress(total_bytes: int, what: str) -> Iterator[Callable[[int], None]]:
    """A byte progress bar on stderr, only when stderr is a terminal."""
    console = Console(stderr=True)
    if not console.is_terminal or total_bytes <= 0:
        yield lambda _n: None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), console=console,
                  transient=True) as progress:
        task = progress.add_task(what, total=total_bytes)
        yield lambda n: progress.advance(task, n)


# -- persisted checkpoints --------------------------------------------------------------------


def _classify(path: Path) -> tuple[str, list[persist.StepDir], int | None]:
    """(target kind, the steps to show, the one rank to show or None), or raise for others."""
    if path.name.startswith(persist.TMP_PREFIX):
        raise IntegrityError(f"{path} is an unfinished write (a {persist.TMP_PREFIX}* "
                             "directory), never a valid checkpoint; inspect its step directory")
    parent_step = persist.STEP_RE.match(path.parent.name)
    if (path / persist.MANIFEST_FILE).exists() or (persist.RANK_RE.match(path.name)
                                                   and parent_step):
        rd = persist.read_rank_dir(path, step=int(parent_step.group(1)) if parent_step else None)
        if rd.problem is not None:
            raise IntegrityError(rd.problem)
        if parent_step:  # show the real state of its step, but only this rank's shard
            return "rank_dir", [persist.read_step_dir(path.parent)], rd.rank
        step = int(persist.read_manifest(path)["step"])
        return "rank_dir", [persist.StepDir(step, path.parent, (rd,), ())], rd.rank
    if persist.STEP_RE.match(path.name):
        return "step_dir", [persist.read_step_dir(path)], None
    steps = persist.list_steps(path)
    if steps:
        return "persist_dir", steps, None
    if (path / persist.DCP_METADATA).exists():
        raise ConfigError(
            f"{path} is a plain torch.distributed.checkpoint directory, not an ftrun checkpoint "
            f"(no {persist.MANIFEST_FILE}); read it with torch.distributed.checkpoint.load"
        )
    if not any(path.iterdir()):
        raise ConfigError(f"{path} is empty: no checkpoint has been persisted there (yet)")
    raise ConfigError(
        f"{path} is not an ftrun checkpoint (no step_*/ or rank_*/ directories, no "
        f"{persist.MANIFEST_FILE}); pass a persist directory, a step_<S> or rank_<r> "
        "directory, or the run id of a job running on this host"
    )


def _step_status(s: persist.StepDir) -> str:
    if s.problems:
        return "corrupt"
    return "complete" if s.complete else "partial"


def _disk(path: Path) -> tuple[int, list[str]]:
    size, files = 0, []
    for entry in os.scandir(path):
        if entry.is_file(follow_symlinks=False):
            size += entry.stat(follow_symlinks=False).st_size
            if entry.name.endswith(".distcp"):
                files.append(entry.name)
    return size, sorted(files)


def _persisted(path: Path, *, step: int | None, verify: bool) -> dict[str, Any]:
    target, steps, only_rank = _classify(path)
    problems: list[str] = [p for s in steps for p in s.problems] if only_rank is None else []
    if step is not None:
        chosen = next((s for s in steps if s.step == step), None)
        if chosen is None:
            present = ", ".join(str(s.step) for s in steps) or "none"
            raise _StepNotFound(f"no step {step} in {path} (steps present: {present})")
    else:
        chosen = next((s for s in steps if s.complete), steps[0] if steps else None)

    ranks: list[dict[str, Any]] = []
    for rd in chosen.ranks if chosen is not None else ():
        if rd.problem is not None or only_rank not in (None, rd.rank):
            continue
        doc = persist.read_manifest(rd.path)
        try:
            recorded = persist.read_hashes(rd.path)
        except IntegrityError as e:
            problems.append(str(e))
            recorded = {}
        disk_bytes, files = _disk(rd.path)
        ranks.append({
            "rank": rd.rank, "path": str(rd.path), "world_size": rd.world_size,
            "files": files, "disk_bytes": disk_bytes, "meta": doc.get("meta"),
            "tensors": _tensor_rows(doc, [recorded.get(e.key) for e in entries(doc)]),
        })

    verified = None
    if verify and chosen is not None:
        verified = {"tensors": 0, "bytes": 0, "mismatches": []}
        total = sum(t["bytes"] for r in ranks for t in r["tensors"])
        with _progress(total, f"verifying step {chosen.step}") as advance:

            def on_tensor(_key: str, nbytes: int) -> None:
                verified["tensors"] += 1
                verified["bytes"] += nbytes
                advance(nbytes)

            for r in ranks:
                try:
                    bad = persist.verify_dir(r["path"], on_tensor=on_tensor)
                except IntegrityError as e:
                    problems.append(str(e))
                    continue
                verified["mismatches"].extend(
                    {"rank": r["rank"], "key": m.key, "file": m.file, "expected": m.expected,
                     "actual": m.actual, "reason": m.reason} for m in bad)

    return {
        "version": INSPECT_VERSION, "kind": "persisted", "path": str(path), "target": target,
        "steps": [{"step": s.step, "path": str(s.path), "status": _step_status(s),
                   "complete": s.complete, "world_size": s.world_size,
                   "ranks": [r.rank for r in s.ranks if r.problem is None],
                   "pending": len(s.pending), "global_metadata": s.merged,
                   "why": s.why_incomplete} for s in steps],
        "step": chosen.step if chosen is not None else None,
        "ranks": ranks, "totals": _totals(ranks), "verify": verified, "problems": problems,
    }


# -- live snapshots in /dev/shm ---------------------------------------------------------------


def _coordinator(run_id: str, state_dir: str | None) -> dict[str, Any] | None:
    """What the job's coordinator says about snapshots; None when there is no job file."""
    try:
        job = jobs.read_job_file(run_id, state_dir)
    except JobNotFoundError:
        return None
    except ConfigError as e:
        return {"endpoint": None, "reachable": False, "snapshots": None, "note": str(e)}
    out: dict[str, Any] = {"endpoint": job.endpoint, "reachable": False, "snapshots": None,
                           "note": None}
    try:
        secret = jobs.load_secret(run_id, state_dir, create=False)
        reply = request(job.endpoint, secret, run_id, "status_request", {},
                        timeout_s=COORDINATOR_TIMEOUT_S)
        if reply.kind != "status_reply":
            raise FtrunError(f"the coordinator answered {reply.kind!r} to a status request")
    except FtrunError as e:
        out["note"] = f"coordinator at {job.endpoint} not reachable: {e}"
        return out
    out["reachable"] = True
    status = reply.body.get("doc")
    out["snapshots"] = status.get("snapshots") if isinstance(status, dict) else None
    if out["snapshots"] is None:
        out["note"] = "the coordinator reports no snapshots yet"
    return out


def _choose_live_step(infos: list[Look], step: int | None) -> int | None:
    """``step`` if held; else the newest step verified on every rank (or on any, or staged)."""
    usable = [(i.header.step, i) for i in infos if i.doc is not None and i.header is not None]
    if step is not None:
        if not any(s == step for s, _ in usable):
            held = ", ".join(str(s) for s in sorted({s for s, _ in usable})) or "none"
            raise _StepNotFound(f"no staged or verified snapshot of step {step} in memory on "
                                f"this host (steps held: {held})")
        return step
    verified: dict[int, set[int]] = {}
    for s, i in usable:
        if i.hashes is not None:
            verified.setdefault(i.rank, set()).add(s)
    if verified and set(verified) == {i.rank for i in infos}:
        everywhere = set.intersection(*verified.values())
        if everywhere:
            return max(everywhere)
    anywhere = set().union(*verified.values())
    if anywhere:
        return max(anywhere)
    return max((s for s, _ in usable), default=None)


def _stores(run_id: str, state_dir: str | None) -> tuple[list[dict[str, Any]], list[str] | None]:
    """Ask the job's stores on this host what they hold: (stores, segment names), the names
    None when no store answered."""
    found = jobs.store_urls(run_id, state_dir)
    if not found:
        return [], None
    try:
        secret = jobs.load_secret(run_id, state_dir, create=False)
    except FtrunError as e:
        return [dict(s, reachable=False, note=str(e)) for s in found], None
    stores, names = [], []
    for s in found:
        chan = Client(s["url"], secret, run_id, "inspect", peer="snapshot store")
        try:
            reply = chan.request("catalog_request", {}, "catalog_reply", STORE_TIMEOUT_S)
        except FtrunError as e:
            stores.append(dict(s, reachable=False, note=str(e)))
            continue
        finally:
            chan.close()
        records = reply.body["records"]
        stores.append(dict(s, reachable=True, note=None, shards=len(records)))
        names += [str(r["segment"]) for r in records]
    return stores, (names if any(s["reachable"] for s in stores) else None)


def _live(run_id: str, *, step: int | None, verify: bool, state_dir: str | None) -> dict[str, Any]:
    # The stores say which segments are the job's (their catalogs); only when none of them
    # answers (stopped, or killed) are the segments looked up by name.
    catalog = Catalog.reader(run_id)
    stores, names = _stores(run_id, state_dir)
    if names is None:
        names = catalog.rank_buffers()
    coordinator = _coordinator(run_id, state_dir)
    if not names and coordinator is None:
        raise JobNotFoundError(
            f"{run_id!r} is not a directory, and no job with that run id has snapshot segments "
            f"in {catalog.shm_dir()} on this host or a job file in "
            f"{knobs.state_dir(state_dir) / 'jobs'}; "
            "pass a checkpoint directory, or the run id on a host of the job (--state-dir)"
        )
    infos = [i for i in map(catalog.look, names) if i is not None]
    problems = [i.problem for i in infos if i.problem]
    chosen = _choose_live_step(infos, step)

    picked: dict[int, Look] = {}
    if chosen is not None:
        for i in infos:
            if i.doc is None or i.header is None or i.header.step != chosen:
                continue
            if i.rank not in picked or (i.hashes is not None and picked[i.rank].hashes is None):
                picked[i.rank] = i
    ranks = []
    for rank in sorted(picked):
        i = picked[rank]
        assert i.doc is not None and i.header is not None
        # Live snapshots are hashed per fixed-size chunk of the data region, not per tensor.
        ranks.append({"rank": rank, "buffer": i.buffer, "segment": i.name,
                      "state": i.header.state_name, "world_size": i.doc.get("world_size"),
                      "meta": i.doc.get("meta"),
                      "chunks": {"size": i.header.chunk_size, "count": i.header.n_chunks,
                                 "hashed": i.hashes is not None},
                      "tensors": _tensor_rows(i.doc, [None] * len(i.doc["tensors"]))})

    verified = None
    if verify and picked:
        verified = {"tensors": 0, "bytes": 0, "mismatches": [], "skipped": []}
        total = sum(t["bytes"] for r in ranks for t in r["tensors"])
        with _progress(total, f"verifying step {chosen}") as advance:
            for rank in sorted(picked):
                _verify_segment(picked[rank], verified, advance)

    segments = []
    for i in infos:
        h = i.header
        segments.append({
            "segment": i.name, "rank": i.rank, "buffer": i.buffer,
            "state": h.state_name if h else None,
            "step": h.step if h and h.step >= 0 else None,
            "epoch": h.epoch if h else None, "bytes": h.data_len if h else None,
            "capacity": h.capacity if h else None,
            "tensors": len(i.doc["tensors"]) if i.doc else None,
            "owner_pid": h.owner_pid if h else None,
            "owner_alive": i.owner_alive,
            "staged_at": h.staged_at if h and h.staged_at else None, "problem": i.problem,
        })
    return {
        "version": INSPECT_VERSION, "kind": "live", "run_id": run_id,
        "host": socket.gethostname(), "shm_dir": str(catalog.shm_dir()), "stores": stores,
        "segments": segments,
        "coordinator": coordinator, "durability": _durability(coordinator), "step": chosen,
        "ranks": ranks, "totals": _totals(ranks), "verify": verified, "problems": problems,
    }


def _durability(coordinator: dict[str, Any] | None) -> dict[str, Any] | None:
    """Committed and durable steps, and where each rank's shard of them is: the node whose
    ranks wrote it and the nodes holding a verified replica (the coordinator's view). None
    without replication or without an answer from the coordinator."""
    snaps = (coordinator or {}).get("snapshots") or {}
    if snaps.get("redundancy"):  # erasure coding: parity per node instead of replicas
        return {"redundancy": snaps["redundancy"], "committed_step": snaps.get("committed_step"),
                "durable_step": snaps.get("parity_durable_step"),
                "parity": snaps.get("parity") or {}}
    if (snaps.get("replicas") or 1) <= 1:
        return None
    own = {int(r): node for node, st in sorted((snaps.get("stores") or {}).items())
           for r in st.get("ranks") or ()}
    holders: dict[str, dict[str, list[str]]] = snaps.get("replica_holders") or {}
    world = snaps.get("world_size")
    durable = snaps.get("durable_step")
    shards = []
    for step in sorted(holders, key=int):
        ranks = range(world) if isinstance(world, int) else sorted(map(int, holders[step]))
        for r in ranks:
            shards.append({"step": int(step), "rank": r, "node": own.get(r),
                           "replicas": holders[step].get(str(r), []),
                           "durable": int(step) == durable})
    return {"replicas": snaps["replicas"], "replica_nodes": snaps.get("replica_nodes"),
            "committed_step": snaps.get("committed_step"), "durable_step": durable,
            "durable_off": snaps.get("durable_off"),
            "durable_lag_steps": snaps.get("durable_lag_steps"),
            "durable_lag_s": snaps.get("durable_lag_s"), "shards": shards}


def _verify_segment(info: Look, out: dict[str, Any], advance: Callable[[int], None]) -> None:
    """Re-hash a segment's chunks against its hash table (skipped when not verified yet)."""
    assert info.doc is not None and info.header is not None
    table = entries(info.doc)
    if info.hashes is None:
        out["skipped"].append({"rank": info.rank, "segment": info.name,
                               "reason": f"{info.header.state_name}: no hashes recorded yet"})
        advance(sum(e.nbytes for e in table))
        return
    try:
        seg = Catalog.open_private(info.name)
    except (OSError, IntegrityError) as e:
        out["skipped"].append({"rank": info.rank, "segment": info.name,
                               "reason": f"gone or unreadable ({e})"})
        return
    try:
        bad, unchanged = Catalog.rehash(seg, info, advance)
    finally:
        seg.close()
    out["tensors"] += len(table)
    out["bytes"] += sum(e.nbytes for e in table)
    if not unchanged:
        out["skipped"].append({"rank": info.rank, "segment": info.name,
                               "reason": "rewritten by its rank while verifying; run again"})
        return
    for m in bad:
        keys = verify.tensors_in(info.doc, m.lo, m.hi) or ["(padding)"]
        out["mismatches"].append({
            "rank": info.rank, "key": keys[0], "keys": keys, "chunk": m.chunk,
            "bytes": [m.lo, m.hi], "file": info.name,
            "expected": persist.xxh3_hex(m.expected), "actual": persist.xxh3_hex(m.actual),
            "reason": f"chunk {m.chunk} (bytes {m.lo}-{m.hi}) hashes to "
                      f"{persist.xxh3_hex(m.actual)}, recorded {persist.xxh3_hex(m.expected)}",
        })


# -- human output -----------------------------------------------------------------------------


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _console() -> Console:
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, WIDE))
    return console


def _tensor_table(ranks: list[dict[str, Any]]) -> Table:
    table = Table(box=None, pad_edge=False)
    for column in ("rank", "key", "dtype", "shape", "bytes", "xxh3"):
        table.add_column(column, no_wrap=True, justify="right" if column == "bytes" else "left")
    for r in ranks:
        for t in r["tensors"]:
            table.add_row(str(r["rank"]), Text(t["key"]), t["dtype"],
                          str(tuple(t["shape"])), str(t["bytes"]),
                          t["xxh3"] or "-")
    return table


def _render(doc: dict[str, Any]) -> None:
    console = _console()
    if doc["kind"] == "persisted":
        _render_persisted(doc, console)
    else:
        _render_live(doc, console)
    totals = doc["totals"]
    if doc["step"] is not None:
        if totals["tensors"]:
            console.print(_tensor_table(doc["ranks"]))
        console.print(Text(f"step {doc['step']}: {totals['ranks']} rank(s), "
                           f"{totals['tensors']} tensor(s), {_fmt_bytes(totals['bytes'])} "
                           f"({totals['bytes']} bytes)", style="bold"))
    _render_verify(doc["verify"], console)


def _render_persisted(doc: dict[str, Any], console: Console) -> None:
    console.print(Text.assemble(("ftrun checkpoint ", ""), (doc["path"], "bold"),
                                (f" ({doc['target'].replace('_', ' ')})", "")))
    style = {"complete": "green", "partial": "yellow", "corrupt": "bold red"}
    steps = Table(box=None, pad_edge=False)
    for column in ("step", "status", "ranks", "world size", "writing", "why"):
        steps.add_column(column, no_wrap=column != "why")
    for s in doc["steps"]:
        mark = " *" if s["step"] == doc["step"] else ""
        why = (s.get("why") or "").removeprefix("partial: ").removeprefix("corrupt: ")
        steps.add_row(f"{s['step']}{mark}", Text(s["status"], style=style[s["status"]]),
                      str(len(s["ranks"])), str(s["world_size"] or "?"),
                      str(s["pending"]) if s["pending"] else "", Text(why, style="dim"))
    console.print(steps)
    if doc["ranks"]:
        shards = Table(box=None, pad_edge=False)
        for column in ("rank", "tensors", "bytes", "on disk", "files", "path"):
            shards.add_column(column, no_wrap=True)
        for r in doc["ranks"]:
            nbytes = sum(t["bytes"] for t in r["tensors"])
            shards.add_row(str(r["rank"]), str(len(r["tensors"])), _fmt_bytes(nbytes),
                           _fmt_bytes(r["disk_bytes"]), ", ".join(r["files"]), Text(r["path"]))
        console.print(shards)


def _render_live(doc: dict[str, Any], console: Console) -> None:
    console.print(Text.assemble(("job ", ""), (doc["run_id"], "bold"),
                                (f" on {doc['host']}: {len(doc['segments'])} snapshot "
                                 f"segment(s) in {doc['shm_dir']}", "")))
    if doc["segments"]:
        style = {SegmentState.VERIFIED: "green", SegmentState.STAGED: "cyan",
                 SegmentState.WRITING: "yellow", SegmentState.EMPTY: "dim"}
        table = Table(box=None, pad_edge=False)
        for column in ("rank", "buffer", "state", "step", "epoch", "bytes", "tensors", "owner"):
            table.add_column(column, no_wrap=True)
        for s in doc["segments"]:
            state = s["state"] or "unreadable"
            owner = "-" if s["owner_pid"] is None else (
                f"{s['owner_pid']}" + ("" if s["owner_alive"] else " (gone)"))
            table.add_row(str(s["rank"]), f"b{s['buffer']}",
                          Text(state, style=style.get(state, "bold red")),
                          "-" if s["step"] is None else str(s["step"]), s["epoch"] or "-",
                          _fmt_bytes(s["bytes"]),
                          "-" if s["tensors"] is None else str(s["tensors"]), owner)
        console.print(table)
    for st in doc.get("stores") or ():
        if st["reachable"]:
            console.print(Text(f"store of node {st['node_id']}: {st['shards']} shard(s) in its "
                               "catalog"))
        else:
            console.print(Text(f"store of node {st['node_id']} not reachable ({st['note']})",
                               style="yellow"))
    if not doc.get("stores") or not any(st["reachable"] for st in doc["stores"]):
        console.print(Text("no store of this job answered on this host: segments were looked "
                           "up by name", style="dim"))
    coord = doc["coordinator"]
    if coord is None:
        console.print(Text("no job file in the state directory: coordinator not asked",
                           style="dim"))
    elif coord["snapshots"]:
        snaps = coord["snapshots"]
        fields = ", ".join(f"{k} {snaps[k]}" for k in ("committed_step", "epoch", "world_size",
                                                        "persisted_step", "pending_steps")
                           if snaps.get(k) not in (None, [], {}))
        console.print(Text(f"coordinator {coord['endpoint']}: {fields or 'nothing committed'}"))
    else:
        console.print(Text(coord["note"] or "coordinator: no snapshot information",
                           style="yellow"))
    if doc.get("durability"):
        _render_durability(doc["durability"], console)
    if doc["step"] is None:
        console.print(Text("no staged or verified snapshot in memory", style="yellow"))


def _render_durability(d: dict[str, Any], console: Console) -> None:
    committed = d["committed_step"]
    head = f"committed step {committed}" if committed is not None else "nothing committed"
    if d.get("redundancy"):
        durable = d["durable_step"]
        console.print(Text(f"{head}; " + (f"durable step {durable}" if durable is not None
                                          else "nothing durable yet")
                           + f"; {d['redundancy']} (erasure-coded parity)"))
        table = Table(box=None, pad_edge=False)
        for column in ("node", "parity built for step", "parity MB", "rebuilt MB"):
            table.add_column(column, no_wrap=True)
        for node, p in sorted(d["parity"].items()):
            table.add_row(node, str(p["built_step"]) if p["built_step"] > 0 else "-",
                          f"{p['parity_bytes'] / 1e6:.1f}", f"{p['rebuilt_bytes'] / 1e6:.1f}")
        console.print(table)
        return
    if d["durable_off"]:
        console.print(Text(f"{head}; durable n/a: {d['durable_off']}", style="yellow"))
        return
    durable = d["durable_step"]
    lag = (f" ({d['durable_lag_steps']} step(s) / {d['durable_lag_s']:.1f} s behind)"
           if d["durable_lag_steps"] and d["durable_lag_s"] is not None else "")
    console.print(Text(f"{head}; " + (f"durable step {durable}{lag}" if durable is not None
                                      else f"nothing durable yet{lag}")
                       + f"; {d['replicas']} copies of every shard"))
    if not d["shards"]:
        console.print(Text("no verified replica reported yet", style="dim"))
        return
    table = Table(box=None, pad_edge=False)
    for column in ("step", "rank", "node", "verified replicas on"):
        table.add_column(column, no_wrap=True)
    for sh in d["shards"]:
        step = f"{sh['step']}" + (" (durable)" if sh["durable"] else "")
        table.add_row(step, str(sh["rank"]), Text(sh["node"] or "?"),
                      Text(", ".join(sh["replicas"]) or "none",
                           style="" if sh["replicas"] else "yellow"))
    console.print(table)


def _render_verify(verified: dict[str, Any] | None, console: Console) -> None:
    if verified is None:
        return
    for skip in verified.get("skipped", []):
        console.print(Text(f"rank {skip['rank']} ({skip['segment']}): not verified: "
                           f"{skip['reason']}", style="yellow"))
    bad = verified["mismatches"]
    summary = (f"verified {verified['tensors']} tensor(s), {_fmt_bytes(verified['bytes'])}: ")
    if not bad:
        console.print(Text(summary + "all hashes match", style="green"))
        return
    console.print(Text(summary + f"{len(bad)} MISMATCH(ES)", style="bold red"))
    table = Table(box=None, pad_edge=False)
    for column in ("rank", "key", "where", "reason"):
        table.add_column(column, no_wrap=column != "reason")
    for m in bad:
        table.add_row(str(m["rank"]), Text(m["key"]), Text(m["file"] or "?"), Text(m["reason"]))
    console.print(table)
