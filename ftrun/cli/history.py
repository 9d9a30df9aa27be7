"""A job's history from its event log: outcome, faults and their recoveries, where the time went.

``ftrun status RUN`` on an ended job and ``ftrun report RUN`` read ``events.jsonl`` in the
job's directory (:func:`ftrun.jobs.events_path`) and never contact a coordinator. Everything
here is derived from the events the launchers and the coordinator record; a figure that needs
a field no event carries is :data:`NOT_RECORDED` (``None`` in JSON, named in ``missing``),
never estimated.

A fault is a failure event (``worker_failure``, ``hang_detected``, ``node_lost``, a
``detection`` that restarted ranks, ``corruption_detected``) and the first ``recovery`` event
of a node after it; the step it resumed from is the first ``restore`` after that recovery
(the ranks restored a snapshot: they train again from there).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from ftrun import jobs
from ftrun.errors import FtrunError

HISTORY_VERSION = 1
# Fields are only ever added under one version (snapshot commits and spare waiting came so);
# a field changed or taken out makes a new one.
REPORT_VERSION = 1
NOT_RECORDED = "not recorded"
# The snapshot interval the projection assumes: no event records the job's, nor what a
# snapshot blocked; a free snapshot this often leaves the model faults' own costs only.
FREE_SNAPSHOT_S = 0.001

# Failure events, and the fault kind of bench/ettr.py each one is.
FAILURE_KINDS = {"worker_failure": "rank_crash", "hang_detected": "hang",
                 "node_lost": "host_loss", "corruption_detected": "silent_corruption"}
# Failures the coordinator records, under another node than the ones that recover from them.
COORDINATOR_FAILURES = ("node_lost", "detection", "corruption_detected")
# A recovery event's phases, in order (ftrun/launcher/inplace.py measures them).
PHASES = (("detect_s", "detect"), ("abort_s", "abort"), ("rendezvous_s", "rendezvous"),
          ("world_s", "new world"), ("in_place_s", "in-place attempt"),
          ("restart_s", "restart"))
# Fields no event records (yet), and what each would give.
MISSING = {
    "fault_step": "the step a rank failed in (a worker_failure without a step: the rank never "
                  "reported progress, or an ftrun from before it was recorded): steps lost",
    "steps_trained": "the job's last step (no job_end with a last_step)",
    "step_time": "the time of a step (no job_end or worker_failure with step_s): the "
                 "seconds the steps lost cost",
    "snapshot_commits": "snapshot commits (no snapshots_committed event: an ftrun from "
                        "before they were recorded, or no step committed): their place on "
                        "the timeline",
    "snapshot_blocked": "the time snapshots held training (no node_left with "
                        "snapshot_blocked_s)",
    "snapshot_skips": "snapshots the ranks skipped (no node_left event with a count: a node "
                      "whose store never reported, or an ftrun from before it was recorded)",
}


class HistoryError(FtrunError):
    """The job's event log is missing or unreadable: the message says where it was looked for."""


def read_events(run_id: str, state_dir: str | None) -> list[dict[str, Any]]:
    """The job's events, oldest first. JobNotFoundError without the job's directory;
    HistoryError without its event log."""
    jobs.read_job_file(run_id, state_dir)  # JobNotFoundError: no such job here
    path = jobs.events_path(run_id, state_dir)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise HistoryError(
            f"job {run_id!r} has no event log ({path}): its coordinator ran on another host "
            "or with another state directory; run this where the coordinator ran, or point "
            "--state-dir at that state directory") from None
    except OSError as e:
        raise HistoryError(f"cannot read the event log {path}: {e}") from e
    events = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError:
            # The last line of a log whose writer died mid-write: the rest still counts.
            if n == len(lines):
                continue
            raise HistoryError(f"{path}:{n} is not a JSON event; the log is damaged") from None
        if isinstance(event, dict) and isinstance(event.get("ts"), (int, float)):
            events.append(event)
    if not events:
        raise HistoryError(f"the event log {path} of job {run_id!r} holds no event yet")
    return sorted(events, key=lambda e: (e["ts"], e.get("seq", 0)))


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


def _failure(e: dict[str, Any]) -> dict[str, Any] | None:
    """The fault a failure event opens, or None when the event is no failure."""
    kind = e["type"]
    if kind == "detection":
        if str(e.get("action") or "") not in ("restart", "isolate"):
            return None
        fault_kind = "hang" if "hang" in str(e.get("kind")) else "slow_rank"
    elif kind in FAILURE_KINDS:
        fault_kind = FAILURE_KINDS[kind]
    else:
        return None
    ranks = e.get("ranks") if isinstance(e.get("ranks"), list) else (
        [e["rank"]] if isinstance(e.get("rank"), int) else [])
    at = _num(e.get("timestamp")) or float(e["ts"])
    what = e.get("message") or e.get("summary") or e.get("reason") or e.get("signal") or kind
    return {"kind": fault_kind, "event": kind, "node": e.get("node"), "ranks": list(ranks),
            "host": e.get("host") or _host_of(e.get("node")), "at": at,
            "what": str(what), "step": e.get("step") if isinstance(e.get("step"), int) else None}


def _host_of(node: Any) -> str | None:
    # Launcher node ids are HOST/PID (ftrun/launcher/launch.py).
    return str(node).rsplit("/", 1)[0] if isinstance(node, str) and "/" in node else None


def job_history(events: list[dict[str, Any]], now: float | None = None,
                gone: bool = False) -> dict[str, Any]:
    """The job's history: start, end and outcome, and one row per fault (see the module
    docstring). ``now`` ends the wall time of a job with no ``job_end`` yet; ``gone``: the
    job's coordinator process is known to be gone (ended, with or without a ``job_end``)."""
    start = next((e["ts"] for e in events if e["type"] == "job_start"), events[0]["ts"])
    ends = [e for e in events if e["type"] == "job_end"]
    joined = {e.get("node") for e in events if e["type"] == "node_joined"}
    left = {e.get("node") for e in events if e["type"] in ("node_left", "node_lost")}
    ended = (bool(ends) and joined <= left) or gone
    if ends and ended:
        end = max(e["ts"] for e in ends)
    elif ended:  # killed before its job_end: its last event is the last sign of it
        end = events[-1]["ts"]
    else:
        end = now if now is not None else time.time()
    # A node whose host was isolated leaves (exit code 8) and the job goes on without it.
    failed = [e for e in ends if e.get("exitcode") not in (0, None)
              and e.get("state") != "isolated"]
    outcome = _outcome(ended, ends, failed)
    faults: list[dict[str, Any]] = []
    open_by_node: dict[Any, dict[str, Any]] = {}
    awaiting_restore: list[dict[str, Any]] = []
    # The step a suspect rank is stuck in (rank_suspect carries it): a hang's fault step.
    stuck: dict[tuple[Any, Any], int] = {}
    for e in events:
        kind = e["type"]
        if kind == "rank_suspect" and isinstance(e.get("step"), int):
            stuck[(e.get("node"), e.get("rank"))] = e["step"]
        elif kind == "rank_cleared":
            stuck.pop((e.get("node"), e.get("rank")), None)
        fault = _failure(e)
        if fault is not None and fault["step"] is None:
            steps = [stuck.pop((fault["node"], r)) for r in fault["ranks"]
                     if (fault["node"], r) in stuck]
            fault["step"] = min(steps) if steps else None
        if fault is not None:
            mine = open_by_node.get(fault["node"])
            if mine is not None:
                # More ranks of the node failing before its recovery (or the rank a hang
                # detection killed, failing): one fault, one recovery.
                mine["ranks"] = sorted(set(mine["ranks"]) | set(fault["ranks"]))
                continue
            fault.update(recovery=None, resumed_from=None, restored_from=None,
                         recovered_at=None)
            faults.append(fault)
            open_by_node[fault["node"]] = fault
        elif kind == "recovery":
            fault = open_by_node.pop(e.get("node"), None)
            if fault is None:
                # A fault the coordinator saw (a node lost, a finding) is recovered by the
                # other nodes: the oldest one still open.
                fault = next((f for f in open_by_node.values()
                              if f["event"] in COORDINATOR_FAILURES), None)
                if fault is None:
                    continue
                del open_by_node[fault["node"]]
            fault["recovery"] = {k: e.get(k) for k in (
                "how", "why", "fallback_reason", "total_s", "new_processes", "kept",
                *(key for key, _ in PHASES)) if e.get(k) is not None}
            fault["recovery_at"] = e["ts"]
            awaiting_restore.append(fault)
        elif kind == "restore" and awaiting_restore:
            for fault in awaiting_restore:
                fault["resumed_from"] = e.get("step") if isinstance(e.get("step"), int) else None
                fault["restored_from"] = e.get("source")
                fault["recovered_at"] = e["ts"]
            awaiting_restore = []
    rows = [_fault_row(i, f, end) for i, f in enumerate(faults, 1)]
    last_restore = next((e for e in reversed(events) if e["type"] == "restore"), None)
    return {
        "started_at": start, "ended_at": end if ended else None, "ended": ended,
        "wall_s": round(end - start, 3), "outcome": outcome,
        "exitcode": (failed[0].get("exitcode") if failed else 0) if ends and ended else None,
        "end_state": [str(e.get("state")) for e in ends],
        "restarts": sum(1 for e in events if e["type"] == "restart"),
        "steps_trained": max((e["last_step"] for e in ends
                              if isinstance(e.get("last_step"), int)), default=None),
        "step_s": _step_time(events),
        "last_restored_step": last_restore.get("step") if last_restore else None,
        "faults": rows,
        "persist_skipped": [e.get("step") for e in events if e["type"] == "persist_skipped"],
        # The only steps the log places in time: where ranks restored, what was persisted.
        "restores": [{"at": e["ts"], "step": e.get("step"), "source": e.get("source")}
                     for e in events if e["type"] == "restore"],
        "persist_targets": [{"at": e["ts"], "step": e.get("step"), "final": bool(e.get("final"))}
                            for e in events if e["type"] == "persist_target"],
        **_commits(events),
        "spares": _spares(events, end),
        "snapshots_skipped": _skipped(events),
        "snapshot_skip_reasons": _skip_reasons(events),
        "snapshot_blocked_s": _blocked(events),
        "nodes_lost": sum(1 for e in events if e["type"] == "node_lost"),
        "hosts_isolated": [e.get("host") for e in events if e["type"] == "host_isolated"],
    }


def _commits(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The snapshot commits the ``snapshots_committed`` events list (each batched by the
    coordinator, ftrun.coordinator.commits.CommitBatch): every one listed, oldest first, how
    many committed in all (``snapshots_committed``, more than listed when a batch was
    thinned) and the newest. No such event: nothing recorded (None)."""
    batches = [e for e in events if e["type"] == "snapshots_committed"]
    listed: list[dict[str, Any]] = []
    for e in batches:
        for pair in e.get("commits") or ():
            if (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], int)
                    and (at := _num(pair[1])) is not None):
                listed.append({"at": at, "step": pair[0]})
    listed.sort(key=lambda c: (c["at"], c["step"]))
    count = sum(e["count"] if isinstance(e.get("count"), int) else len(e.get("commits") or ())
                for e in batches)
    return {"snapshot_commits": listed,
            "snapshots_committed": count if batches else None,
            "snapshot_commits_unlisted": max(0, count - len(listed)) if batches else None,
            "last_commit": listed[-1] if listed else None}


def _spares(events: list[dict[str, Any]], end: float) -> list[dict[str, Any]]:
    """The launchers that waited while the job trained without them (spares, and nodes that
    joined late): a node whose first rendezvous ended after the ranks first restored (the job
    trained by then), or that never ended one. Each waited from its rendezvous' start (its
    ``rendezvous`` event's time less its ``duration_s``; else its ``node_joined``) until that
    rendezvous ended and it took over, or (``took_over_at`` None) until it left or the end."""
    first_restore = next((e["ts"] for e in events if e["type"] == "restore"), None)
    if first_restore is None:
        return []
    joined: dict[Any, float] = {}
    first_round: dict[Any, dict[str, Any]] = {}
    left: dict[Any, float] = {}
    for e in events:
        node = e.get("node")
        if e["type"] == "node_joined":
            joined.setdefault(node, e["ts"])
        elif e["type"] == "rendezvous" and node not in first_round:
            first_round[node] = e
        elif e["type"] in ("node_left", "node_lost"):
            left.setdefault(node, e["ts"])
    out = []
    for node, since in joined.items():
        rdzv = first_round.get(node)
        if rdzv is not None and rdzv["ts"] <= first_restore:
            continue  # in the job's first world
        took_over = rdzv["ts"] if rdzv is not None else None
        waited = _num(rdzv.get("duration_s")) if rdzv is not None else None
        began = took_over - waited if took_over is not None and waited is not None else since
        until = took_over if took_over is not None else left.get(node, end)
        out.append({"node": node, "host": _host_of(node), "waited_from": began,
                     "took_over_at": took_over, "waited_s": round(max(0.0, until - began), 3)})
    return out


def _step_time(events: list[dict[str, Any]]) -> float | None:
    """The job's step time: the median of what its nodes' job_end (else its failures)
    recorded; None when none did."""
    for kinds in (("job_end",), ("worker_failure",)):
        times = sorted(t for e in events if e["type"] in kinds
                       if (t := _num(e.get("step_s"))) is not None and t > 0)
        if times:
            return times[len(times) // 2]
    return None


def _blocked(events: list[dict[str, Any]]) -> float | None:
    """The time snapshots held training: the most any rank was held (each node's last
    report, on its node_left); None when no node left with one."""
    held = {e.get("node"): t for e in events if e["type"] == "node_left"
            if (t := _num(e.get("snapshot_blocked_s"))) is not None}
    return round(max(held.values()), 3) if held else None


def _skip_reasons(events: list[dict[str, Any]]) -> dict[str, int]:
    """The snapshots skipped, by reason: each node's last counts (node_left), added up."""
    last: dict[Any, dict[str, Any]] = {}
    for e in events:
        if e["type"] == "node_left" and isinstance(e.get("snapshot_skip_reasons"), dict):
            last[e.get("node")] = e["snapshot_skip_reasons"]
    out: dict[str, int] = {}
    for reasons in last.values():
        for reason, n in reasons.items():
            if isinstance(n, int):
                out[str(reason)] = out.get(str(reason), 0) + n
    return out


def reasons_text(reasons: dict[str, int]) -> str:
    """" (2 store_busy, 1 no_forward)", most first; "" for none."""
    if not reasons:
        return ""
    ranked = sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))
    return " (" + ", ".join(f"{n} {reason}" for reason, n in ranked) + ")"


def _skipped(events: list[dict[str, Any]]) -> int | None:
    """Snapshots the ranks skipped, over the job: each node's last count (its node_left
    event's, as its store reported it); None when no node left with one."""
    counts = {e.get("node"): e["snapshots_skipped"] for e in events
              if e["type"] == "node_left" and isinstance(e.get("snapshots_skipped"), int)}
    return sum(counts.values()) if counts else None


def _outcome(ended: bool, ends: list[dict[str, Any]], failed: list[dict[str, Any]]) -> str:
    """running; killed (ended without a job_end); failed; stopped (by a signal: SIGTERM,
    Ctrl-C); succeeded."""
    if not ended:
        return "running"
    if not ends:
        return "killed"
    if any(e.get("state") != "stopped" for e in failed):
        return "failed"
    return "stopped" if failed else "succeeded"


def _fault_row(n: int, f: dict[str, Any], end: float) -> dict[str, Any]:
    rec = f.get("recovery") or {}
    detect = _num(rec.get("detect_s"))
    total = _num(rec.get("total_s"))
    back = f.get("recovered_at")
    resumed = f.get("resumed_from")
    lost = (f["step"] - resumed if f.get("step") is not None and resumed is not None else None)
    return {
        "n": n, "kind": f["kind"], "event": f["event"], "ranks": f["ranks"], "node": f["node"],
        "host": f["host"], "at": f["at"], "what": f["what"],
        "detected_after_s": detect,
        "recovery_s": total,
        "recovery": rec or None,
        # From the failure until the ranks restored a snapshot: training stood still.
        "recovered_after_s": round(back - f["at"], 3) if back is not None else None,
        "restore_s": (round(back - f["recovery_at"], 3)
                      if back is not None and f.get("recovery_at") is not None else None),
        "resumed_from": resumed, "restored_from": f.get("restored_from"),
        "fault_step": f.get("step"), "steps_lost": lost,
        "open": f.get("recovery") is None and back is None and end is not None,
    }


def time_split(events: list[dict[str, Any]], history: dict[str, Any]) -> dict[str, Any]:
    """The wall time, split: startup (until the ranks first restored), waiting in rendezvous
    outside a recovery, and per fault its detection, each recovery phase and the restore,
    the time snapshots held training and the recomputed steps; the rest is training.
    Seconds; every ``*_s`` part within the wall time, and together the wall time.

    ``beside`` holds what went on beside the job's own time: the time spare launchers
    waited before they took over (the job trained meanwhile, on other machines; after a
    fault, the part of it until the spare joined is in the recovery's rendezvous phase)."""
    start, wall = history["started_at"], history["wall_s"]
    windows = [(f["at"], f["at"] + (f["recovered_after_s"] or f["recovery_s"] or 0.0))
               for f in history["faults"]]
    # A spare's rendezvous is its wait (``beside``), not the job's: the job trained meanwhile.
    spare_rounds = {(s["node"], s["took_over_at"]) for s in history.get("spares") or ()}
    rendezvous = sum(_num(e.get("duration_s")) or 0.0 for e in events
                     if e["type"] == "rendezvous"
                     and (e.get("node"), e["ts"]) not in spare_rounds
                     and not any(a <= e["ts"] <= b for a, b in windows))
    first_restore = next((e["ts"] for e in events if e["type"] == "restore"), None)
    startup = (max(0.0, first_restore - start - rendezvous)
               if first_restore is not None and (not windows or first_restore <= windows[0][0])
               else None)
    phases = {name: 0.0 for _, name in PHASES}
    restore = unaccounted = 0.0
    for f in history["faults"]:
        rec = f.get("recovery") or {}
        for key, name in PHASES:
            phases[name] += _num(rec.get(key)) or 0.0
        restore += f.get("restore_s") or 0.0
        if not rec and f.get("recovered_after_s"):
            unaccounted += f["recovered_after_s"]
    parts = {"startup_s": startup, "rendezvous_wait_s": rendezvous,
             "detection_s": phases.pop("detect"),
             **{f"recovery_{name.replace(' ', '_').replace('-', '_')}_s": v
                for name, v in phases.items()},
             "restore_s": restore, "recovery_unphased_s": unaccounted}
    parts = {k: (round(v, 3) if v is not None else None) for k, v in parts.items()}
    # Recomputed steps: each fault's steps lost at the job's step time.
    steps_lost = [f["steps_lost"] for f in history["faults"]]
    step_s = history.get("step_s")
    recompute = (round(sum(steps_lost) * step_s, 3)
                 if step_s is not None and all(n is not None for n in steps_lost) else None)
    blocked = history.get("snapshot_blocked_s")
    lost = sum(v for v in parts.values() if v) + (recompute or 0.0) + (blocked or 0.0)
    training = max(0.0, wall - lost)
    unknown = [what for what, v in (("the time blocked by snapshots", blocked),
                                    ("the recomputed steps", recompute)) if v is None]
    spares = history.get("spares") or []
    beside = {"spare_wait_s": round(sum(s["waited_s"] for s in spares), 3),
              "spares": len(spares),
              "spares_never_took_over": sum(1 for s in spares if s["took_over_at"] is None)}
    return {"wall_s": wall, **parts, "recompute_s": recompute, "snapshot_blocked_s": blocked,
            "training_s": round(training, 3),
            "ettr": round(training / wall, 4) if wall > 0 else None,
            "ettr_note": (f"an upper bound: the training time still holds {' and '.join(unknown)}"
                          " (not recorded)" if unknown else "measured"),
            "beside": beside}


def _ettr_model() -> ModuleType | None:
    """bench/ettr.py of the checkout this ftrun runs from; None for an installed ftrun."""
    path = Path(__file__).resolve().parents[2] / "bench" / "ettr.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("ftrun_bench_ettr", path)
    if spec is None or spec.loader is None:
        return None
    module = sys.modules.get(spec.name)
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    return module


def projected_ettr(history: dict[str, Any], split: dict[str, Any]) -> dict[str, Any]:
    """What bench/ettr.py's model (``simulate``) projects for this job: its faults at the
    times they came, each detected and recovered in the seconds measured for its kind (mean),
    over the same wall time, with snapshots free and every step (snapshot blocking and lag
    are not recorded: the model's best case for them)."""
    ettr = _ettr_model()
    if ettr is None:
        return {"ettr": None, "why": "bench/ettr.py is not beside this ftrun (an installed "
                                     "package): run from a checkout for the projection"}
    wall = history["wall_s"]
    if wall <= 0:
        return {"ettr": None, "why": "no wall time yet"}
    by_kind: dict[str, list[tuple[float, float]]] = {}
    for f in history["faults"]:
        detect = f["detected_after_s"] or 0.0
        back = f["recovered_after_s"] if f["recovered_after_s"] is not None else f["recovery_s"]
        by_kind.setdefault(f["kind"], []).append((detect, max(0.0, (back or 0.0) - detect)))
    detect_s = {k: 0.0 for k in ettr.KINDS}
    recover_s = {k: 0.0 for k in ettr.KINDS}
    for kind, costs in by_kind.items():
        detect_s[kind] = sum(c[0] for c in costs) / len(costs)
        recover_s[kind] = sum(c[1] for c in costs) / len(costs)
    policy = ettr.Policy(name="this job", interval_s=FREE_SNAPSHOT_S, save_block_s=0.0,
                         save_lag_s=0.0, detect_s=detect_s, recover_s=recover_s)
    faults = [ettr.Event(time_s=f["at"] - history["started_at"], kind=f["kind"])
              for f in history["faults"]]
    out = ettr.simulate(faults, policy, wall)
    return {"ettr": round(out.ettr, 4), "detection_s": round(out.detection, 3),
            "recovery_s": round(out.recovery, 3), "recompute_s": round(out.recompute, 3),
            "faults": out.faults,
            "costs": {k: {"detect_s": round(detect_s[k], 3), "recover_s": round(recover_s[k], 3)}
                      for k in by_kind},
            "model": f"bench/ettr.py simulate(): measured detection and recovery per fault "
                     f"kind, snapshots free every {FREE_SNAPSHOT_S * 1000:g} ms (not recorded)"}


def report(events: list[dict[str, Any]], run_id: str, now: float | None = None,
           gone: bool = False) -> dict[str, Any]:
    """The ``ftrun report`` document (version :data:`REPORT_VERSION`)."""
    history = job_history(events, now, gone)
    split = time_split(events, history)
    return {"version": REPORT_VERSION, "run_id": run_id, "history": history,
            "time": split, "projected": projected_ettr(history, split),
            "missing": missing(history)}


def missing(history: dict[str, Any]) -> dict[str, str]:
    """The fields of :data:`MISSING` this job's events do not give."""
    out = dict(MISSING)
    if history.get("steps_trained") is not None:
        del out["steps_trained"]
    if all(f.get("fault_step") is not None for f in history["faults"]):
        del out["fault_step"]
    if history.get("snapshots_skipped") is not None:
        del out["snapshot_skips"]
    if history.get("step_s") is not None:
        del out["step_time"]
    if history.get("snapshot_blocked_s") is not None:
        del out["snapshot_blocked"]
    if history.get("snapshots_committed") is not None:
        del out["snapshot_commits"]
    return out
