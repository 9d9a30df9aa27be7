"""The coordinator's detection service: where the ranks' collective reports arrive, and where
the findings of :mod:`ftrun.coordinator.detect` become decisions.

It listens on a socket of its own, served by a thread of its own, so that per-collective
records never delay heartbeats or ``ftrun status``. Every ``TICK_S`` it runs the analysis and
acts on each new finding, per the job's :class:`~ftrun.coordinator.detect.DetectConfig`:

========================  ==========================================================
finding                    action
========================  ==========================================================
``hang``                   ``--on-hang``: warn; restart (the culprit ranks are killed,
                           every rank restarts from the freshest snapshot); isolate
                           (also exclude the culprits' host)
``comm_hang``              probe the links between the group's hosts, and restart
                           (``--on-hang`` warn: only probe)
``slow_rank``              ``--on-slow``: warn, or isolate the rank's host
``slow_comm``              probe the links between the group's hosts
``slow_host``              ``--on-slow``: warn, or isolate the host
``slow_link``              warn (a link has two ends; the operator decides)
========================  ==========================================================

Isolating a host puts it on the job's exclude list (``<job dir>/excluded.json``, kept across
coordinator restarts; with a coordinator that fails over, also in its role's store, etcd, so a
successor on another host has it), orders every launcher on it to stop its workers and exit with code 8,
and runs ``--isolate-hook CMD HOST`` once (bounded, off the loop). A launcher that starts on an
excluded host later is told the same at its first heartbeat. The host running the
coordinator is never isolated (that would end the job): the finding is acted on as a restart
and the log says so.

After acting, the service waits for the job to restart (ranks report a new world: their
``MASTER_ADDR:MASTER_PORT``) or ``ACTION_COOLDOWN_S`` before it acts on the same kind of
finding again, so one fault is one decision. Killing or isolating a rank restarts every
worker of its world, so until the new world reports, a finding about ranks of the world
acted on is the action's own consequence (the killed rank stops reporting while the others,
until their launchers restart them, still wait for it, and then stop reporting too): it is
logged and counted as a follow-up, not recorded as a new detection. The same holds after a
launcher restarts its workers on its own (its ``worker_failure`` or ``restart`` event: a rank
died or raised, the world changes), so that a rank's crash is one restart, not a crash and
then a hang named in the survivors that wait for it. A restart order names the world it
was decided in; a launcher whose workers have moved on to another world drops it. A repeat
about hosts alone (probes) is recorded as a ``warn`` that says the fault was already acted on.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftrun import jobs
from ftrun.coordinator.api import Action, FindingKind
from ftrun.coordinator.detect import DetectConfig, Detector, Finding
from ftrun.errors import FtrunError
from ftrun.protocol import messages as m
from ftrun.protocol.service import Service
from ftrun.protocol.transport import Server

log = logging.getLogger(__name__)

TICK_S = 0.5
POLL_S = 0.1
MAX_MESSAGES_PER_POLL = 2000
ACTION_COOLDOWN_S = 30.0
HOOK_TIMEOUT_S = 60.0
PROBE_BYTES = 1 << 20
MAX_FINDINGS_KEPT = 100

# Directive sink: (node_id, action, data) -> directive id.
Direct = Callable[[str, str, dict[str, Any]], str]
# Event sink: (type, node, data) -> None.
Record = Callable[[str, "str | None", dict[str, Any]], Any]
# The live nodes: node_id -> {"host": str, "probe_addr": str | None}.
Nodes = Callable[[], dict[str, dict[str, Any]]]


class DetectService:
    """Receives ``coll_report``/``probe_result``, runs the analysis, issues directives."""

    def __init__(
        self,
        run_id: str,
        secret: bytes,
        config: DetectConfig,
        *,
        direct: Direct,
        record: Record,
        nodes: Nodes,
        coordinator_host: str,
        excluded_file: Path | None,
        bind_host: str = "0.0.0.0",
        advertise_host: str = "127.0.0.1",
        acting: Callable[[], bool] = lambda: True,
        role: Any = None,
        term: int = 0,
    ) -> None:
        self.run_id = run_id
        self._secret = secret
        # The coordinator's incarnation (or etcd term): reports signed for an earlier one, a
        # capture replayed after a restart, are refused; its clients follow the new one.
        self._term = term
        self.config = config
        self.detector = Detector(config)
        self._direct = direct
        self._record = record
        self._nodes = nodes
        self._coordinator_host = coordinator_host
        self._excluded_file = excluded_file
        self._bind_host = bind_host
        self._advertise_host = advertise_host
        # Whether the coordinator may decide now (its lease holds: see
        # ftrun.coordinator.server), and its CoordinatorRole, where the exclude list is kept.
        self._acting = acting
        self._role = role
        self._lock = threading.Lock()
        self._excluded: dict[str, dict[str, Any]] = self._load_excluded()
        self._told: set[str] = set()  # nodes already ordered out as excluded
        self._findings: list[dict[str, Any]] = []
        self._acted: dict[str, tuple[float, int]] = {}  # kind -> (mono, world generation)
        self._service: Service | None = None
        self._next_tick = 0.0
        self.endpoint: str | None = None
        self.counters = {"reports": 0, "summaries": 0, "probe_results": 0, "findings": 0,
                         "followups": 0, "directives": 0}

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> str:
        """Bind and serve in a daemon thread; returns the endpoint ranks report to."""
        if self._service is not None:
            assert self.endpoint is not None
            return self.endpoint
        server = Server("detection service", self._secret, self.run_id,
                        {"coll_report": self._on_report, "coll_summary": self._on_summary,
                         "probe_result": self._on_probe},
                        sender="coordinator", typed={"probe_result"}, term=self._term)
        service = Service(server, poll_s=POLL_S, max_messages=MAX_MESSAGES_PER_POLL,
                          after=self._after, own_context=True, thread_name="ftrun-detect")
        bound = service.bind_tcp(self._bind_host)
        port = int(bound.rsplit(":", 1)[1])
        from ftrun.protocol import join_endpoint

        self.endpoint = join_endpoint(self._advertise_host, port)
        self._service = service
        self._next_tick = time.monotonic() + TICK_S
        service.start()
        log.info("detection service listening on %s (on hang: %s, on slow: %s)", self.endpoint,
                 self.config.on_hang, self.config.on_slow)
        return self.endpoint

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._service is not None and self._service.stop(timeout_s):
            self._service = None

    def _after(self, n: int) -> None:
        """Between reads, on the service thread: the analysis every TICK_S."""
        now = time.monotonic()
        if now >= self._next_tick:
            self._next_tick = now + TICK_S
            self.tick(now)

    # -- input -------------------------------------------------------------------------------

    def _on_report(self, msg: Any) -> None:
        body = msg.body
        with self._lock:
            self.counters["reports"] += 1
            self.detector.add_report(body, time.monotonic())

    def _on_summary(self, msg: Any) -> None:
        with self._lock:
            self.counters["summaries"] += 1
            self.detector.add_summary(msg.body, time.monotonic())

    def _on_probe(self, msg: Any) -> m.Ack:
        b: m.ProbeResult = msg.body
        results = [m.to_dict(r) for r in b.results]
        with self._lock:
            self.counters["probe_results"] += 1
            self.detector.add_probe_result({"node_id": b.node_id, "host": b.host, "id": b.id,
                                            "results": results}, time.monotonic())
        self._record("probe_result", b.node_id, {"id": b.id, "results": results})
        return m.Ack(re=msg.id)

    def note_restart(self, node_id: str, why: str) -> None:
        """A launcher restarts its workers on its own (a rank failed, or the world changes):
        the world the analysis watches is ending, and what its ranks do meanwhile (the
        dead rank stops reporting, the others wait for it) is that fault's consequence.
        Findings about this world's ranks are held as follow-ups until the new world
        reports (or ACTION_COOLDOWN_S), as after this service's own restart orders."""
        with self._lock:
            generation = self.detector.generation
            self._acted["launcher_restart"] = (time.monotonic(), generation)
        log.info("%s restarts its workers (%s): holding findings about world %d until the "
                 "new world reports", node_id, why, generation)

    # -- decisions ---------------------------------------------------------------------------

    def tick(self, now: float) -> list[Finding]:
        """Run the analysis once and act on what it found (the service thread calls this)."""
        with self._lock:
            findings = self.detector.analyse(now)
            generation = self.detector.generation  # bumped by every new world
        if not self._acting():
            return []  # the coordinator stepped down: another one decides
        self._order_out_excluded()
        for f in findings:
            self._act(f, now, generation)
        return findings

    def _act(self, f: Finding, now: float, generation: int) -> None:
        if self._follows_from_an_action(f, now, generation):
            self.counters["followups"] += 1
            log.info("%s: %s: this world's ranks were already acted on; waiting for the "
                     "restart", f.kind, f.summary)
            return
        self.counters["findings"] += 1
        evidence = _jsonable(f.evidence)
        entry = {"kind": f.kind, "ranks": list(f.ranks), "hosts": list(f.hosts),
                 "nodes": list(f.nodes), "summary": f.summary, "evidence": evidence,
                 "time": time.time()}
        action = self._action_for(f)
        last = self._acted.get(f.kind)
        if action not in (Action.WARN, Action.PROBE) and last is not None and \
                last[1] == generation and now - last[0] < ACTION_COOLDOWN_S:
            action = Action.WARN  # already acted on this fault; wait for the restart it caused
            entry["note"] = "already acted on this fault; waiting for the restart"
        entry["action"] = action
        with self._lock:
            self._findings.append(entry)
            del self._findings[:-MAX_FINDINGS_KEPT]
        log.warning("detected %s: %s (action: %s)", f.kind, f.summary, action)
        self._record("detection", f.nodes[0] if f.nodes else None, entry)
        if action == Action.WARN:
            return
        if action == Action.PROBE:
            self._probe(f)
            return
        self._acted[f.kind] = (now, generation)
        if f.kind == FindingKind.COMM_HANG:
            self._probe(f)
        if action == Action.ISOLATE:
            hosts = [h for h in f.hosts if h]
            if self._coordinator_host in hosts:
                log.error("not isolating %s: it runs the coordinator, and the job would end; "
                          "restarting instead (run `ftrun coordinator` on a separate host to "
                          "allow isolating every training host)", self._coordinator_host)
                self._record("isolate_refused", None, {"host": self._coordinator_host,
                                                       "reason": "coordinator host"})
                hosts.remove(self._coordinator_host)
            for host in hosts:
                self.isolate(host, f.summary, evidence)
            if hosts:
                return
        self._restart(f)

    def _follows_from_an_action(self, f: Finding, now: float, generation: int) -> bool:
        # The newest action (the one with the latest monotonic time), of whatever kind.
        when, acted_generation = max(self._acted.values(), default=(0.0, -1))
        return (bool(f.ranks) and acted_generation == generation
                and now - when < ACTION_COOLDOWN_S)

    def _action_for(self, f: Finding) -> Action:
        if f.kind == FindingKind.HANG:
            return Action(self.config.on_hang)
        if f.kind == FindingKind.COMM_HANG:
            return Action.PROBE if self.config.on_hang == Action.WARN else Action.RESTART
        if f.kind in (FindingKind.SLOW_RANK, FindingKind.SLOW_HOST):
            return Action(self.config.on_slow)
        if f.kind == FindingKind.SLOW_COMM:
            return Action.PROBE
        return Action.WARN

    def _restart(self, f: Finding) -> None:
        """Kill the culprit ranks (or, for a hang without one, every rank of the finding);
        torch's restart path brings every rank back from the freshest snapshot."""
        by_node: dict[str, list[int]] = {}
        for node, rank in zip(f.nodes, f.ranks, strict=False):
            by_node.setdefault(node, []).append(rank)
        with self._lock:
            world = self.detector.world
        for node, ranks in sorted(by_node.items()):
            # The world named: a launcher that has restarted since drops the order.
            self._send(node, Action.RESTART, {"ranks": sorted(set(ranks)), "reason": f.summary,
                                              "world": world,
                                              "evidence_age_s": _evidence_age(f)})

    def isolate(self, host: str, reason: str, evidence: dict[str, Any] | None = None) -> None:
        """Put ``host`` on the exclude list, order its launchers out, run the hook."""
        if not self._acting():
            log.warning("not isolating host %s: the coordinator stepped down", host)
            return
        with self._lock:
            if host in self._excluded:
                return
            self._excluded[host] = {"reason": reason, "time": time.time(),
                                    "evidence": evidence or {}}
            self._save_excluded()
        log.error("isolating host %s: %s", host, reason)
        self._record("host_isolated", None, {"host": host, "reason": reason,
                                             "evidence": evidence or {}})
        self._order_out_excluded()
        if self.config.isolate_hook:
            threading.Thread(target=self._run_hook, args=(host, reason),
                             name="ftrun-isolate-hook", daemon=True).start()

    def _order_out_excluded(self) -> None:
        with self._lock:
            excluded = dict(self._excluded)
        if not excluded:
            return
        for node, info in self._nodes().items():
            host = info.get("host")
            if host in excluded and node not in self._told:
                self._told.add(node)
                self._send(node, Action.ISOLATE, {
                    "reason": f"host {host} is on the job's exclude list: "
                              f"{excluded[host]['reason']}",
                    "evidence": excluded[host].get("evidence", {})})

    def _probe(self, f: Finding) -> None:
        """Order the probes the analysis planned (both directions of each host pair of the
        group), or, without a plan, between every pair of the finding's hosts."""
        nodes = self._nodes()
        by_host = {i.get("host"): (n, i) for n, i in nodes.items() if i.get("probe_addr")}
        with self._lock:
            plan = self.detector.probe_plan()
        if not plan:
            hosts = [h for h in f.hosts if h in by_host]
            plan = {by_host[h][0]: [{"node_id": by_host[p][0], "host": p}
                                    for p in hosts if p != h] for h in hosts}
        issued = 0
        for node, peers in sorted(plan.items()):
            if node not in nodes:
                continue
            targets = [{"node_id": by_host[p["host"]][0], "host": p["host"],
                        "addr": by_host[p["host"]][1]["probe_addr"]}
                       for p in peers if p.get("host") in by_host]
            if targets:
                self._send(node, Action.PROBE, {"peers": targets, "size": PROBE_BYTES})
                issued += 1
        if not issued:
            log.warning("cannot probe the links behind %s: no two of its hosts report a probe "
                        "service", f.kind)

    def _send(self, node: str, action: str, data: dict[str, Any]) -> str:
        self.counters["directives"] += 1
        directive = self._direct(node, action, data)
        log.info("ordered node %s to %s (%s)", node, action, directive)
        return directive

    def _run_hook(self, host: str, reason: str) -> None:
        cmd = self.config.isolate_hook
        assert cmd
        argv = ["/bin/sh", "-c", f"{cmd} {shlex.quote(host)}"]
        env = {**os.environ, "FTRUN_ISOLATED_HOST": host, "FTRUN_ISOLATE_REASON": reason,
               "FTRUN_RUN_ID": self.run_id}
        try:
            done = subprocess.run(argv, env=env, capture_output=True, text=True,
                                  timeout=HOOK_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            log.error("--isolate-hook for %s did not finish within %.0f s (killed)", host,
                      HOOK_TIMEOUT_S)
            self._record("isolate_hook", None, {"host": host, "exitcode": None,
                                                "error": "timeout"})
            return
        except OSError as e:
            log.error("--isolate-hook for %s could not run: %s", host, e)
            self._record("isolate_hook", None, {"host": host, "exitcode": None,
                                                "error": str(e)})
            return
        level = logging.INFO if done.returncode == 0 else logging.ERROR
        log.log(level, "--isolate-hook for %s exited %d%s", host, done.returncode,
                f": {done.stderr.strip()[-500:]}" if done.stderr.strip() else "")
        self._record("isolate_hook", None, {"host": host, "exitcode": done.returncode,
                                            "stderr": done.stderr[-2000:]})

    # -- the exclude list --------------------------------------------------------------------

    def _load_excluded(self) -> dict[str, dict[str, Any]]:
        hosts = self._load_excluded_file()
        if self._role is not None:
            try:
                kept = self._role.load("excluded") or {}
            except FtrunError as e:
                log.error("cannot read the exclude list kept with the coordinator role (%s); "
                          "using %s only", e, self._excluded_file)
                kept = {}
            for host, entry in kept.items():
                if isinstance(entry, dict) and isinstance(entry.get("reason"), str):
                    hosts.setdefault(host, {"time": None, "evidence": {}, **entry})
        return hosts

    def _load_excluded_file(self) -> dict[str, dict[str, Any]]:
        path = self._excluded_file
        if path is None or not path.exists():
            return {}
        try:
            data = json.loads(path.read_text())
            hosts = data["hosts"]
            if not isinstance(hosts, dict):
                raise TypeError("hosts is not an object")
            for host, entry in hosts.items():
                if not isinstance(entry, dict) or not isinstance(entry.get("reason"), str):
                    raise TypeError(f"the entry of host {host!r} is not an object with a "
                                    "string reason")
                entry.setdefault("time", None)
                entry.setdefault("evidence", {})
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise FtrunError(
                f"the job's exclude list {path} is unreadable ({e}); fix or delete it (it "
                "lists the hosts isolated so far)") from e
        if hosts:
            log.warning("hosts excluded from this job earlier: %s (from %s)",
                        ", ".join(sorted(hosts)), path)
        return dict(hosts)

    def _save_excluded(self) -> None:
        if self._role is not None:
            try:
                if not self._role.save("excluded", self._excluded):
                    log.error("the exclude list was not saved with the coordinator role: "
                              "the role is another launcher's now")
            except FtrunError as e:
                log.error("cannot save the exclude list with the coordinator role (%s)", e)
        path = self._excluded_file
        if path is None:
            return
        try:
            jobs.write_private_json(path, {"hosts": self._excluded})
        except OSError as e:
            log.error("cannot write the exclude list %s: %s (it stays in memory only)", path, e)

    # -- status ------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The ``detection`` section of the status document."""
        with self._lock:
            return {
                "endpoint": self.endpoint,
                "on_hang": self.config.on_hang,
                "on_slow": self.config.on_slow,
                "suspects": _jsonable(self.detector.status()),
                "findings": [dict(f) for f in self._findings[-20:]],
                "excluded": {h: {"reason": i["reason"], "time": i.get("time")}
                             for h, i in sorted(self._excluded.items())},
                "counters": dict(self.counters),
            }

    def excluded_hosts(self) -> list[str]:
        with self._lock:
            return sorted(self._excluded)


def _jsonable(value: Any) -> Any:
    """``value`` with tuples as lists and non-finite floats as None (the event log is JSON)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    return value


def _evidence_age(f: Finding) -> float:
    """How long before the finding its first evidence appeared: the longest wait it names
    (or the longest silence), for the launcher's ``recovery.detect_s``."""
    ev = f.evidence or {}
    ages = [ev.get("longest_wait_s"), ev.get("shortest_wait_s"),
            *(ev.get("silent_s") or {}).values()]
    return round(max((float(a) for a in ages if isinstance(a, (int, float))), default=0.0), 3)
