"""The agent's watch over its running ranks (a mixin of :class:`ftrun.launcher.agent.FtrunAgent`):
per-rank verdicts (:mod:`ftrun.launcher.suspect`), stack dumps of suspect ranks, the
--hang-timeout and stopped-rank kills (a rank blocked in a collective is a victim, spared
until 2 x the timeout), and torch's failure reports turned into events."""

from __future__ import annotations

import logging
import math
import os
import signal
import time

from torch.distributed.elastic.agent.server.api import (
    RunResult,
    WorkerGroup,
)

from ftrun.coordinator.api import NodeState, SuspectCause
from ftrun.launcher.inplace import proc_state, signal_name
from ftrun.launcher.suspect import NOT_WATCHED, RankWatch, Verdict
from ftrun.rank.progress import (
    Progress,
    create_progress_file,
    read_progress,
    read_stacks,
    request_stacks,
)

log = logging.getLogger("ftrun.launcher.agent")

# A rank frozen by SIGSTOP blocks every collective; with --hang-timeout off it is still
# killed after this long.
STOPPED_LIMIT_S = 10.0
# --hang-timeout: a rank blocked in a collective (its monitor says since when) is a victim
# waiting for a peer; it is killed only once its wait passes this many hang timeouts.
VICTIM_FACTOR = 2.0
STACKS_WAIT_S = 0.5  # from asking a suspect rank for its stacks to logging them


class WorkerWatch:
    """Hang and failure watch: a mixin over the agent's state."""

    def _report_failures(self, worker_group: WorkerGroup, result: RunResult) -> None:
        by_global = {w.global_rank: w for w in worker_group.workers}
        first: tuple[float, str] | None = None
        for rank, failure in result.failures.items():
            worker = by_global.get(rank)
            local_rank = worker.local_rank if worker else failure.local_rank
            self._exitcodes[local_rank] = failure.exitcode
            message = failure.message if isinstance(failure.message, str) else str(failure.message)
            sig = signal_name(failure.exitcode)
            summary = f"rank {rank} exited with {sig or f'code {failure.exitcode}'}"
            if failure.error_file_data:
                summary += f": {message}"
            if first is None or failure.timestamp < first[0]:
                first = (failure.timestamp, summary)
            self._ctx.sink.event(
                "worker_failure",
                rank=rank,
                local_rank=local_rank,
                pid=failure.pid,
                exitcode=failure.exitcode,
                signal=sig,
                message=message[:4096],
                timestamp=failure.timestamp,
                step=self._current_step(local_rank),
                step_s=self.step_time_s(local_rank),
            )
        if first is not None:
            self._last_error = first[1][:1024]
            # torch's failure record carries the first failure's time (its error file's, or
            # when torch saw the exit): the first evidence, for recovery.detect_s.
            age = time.time() - first[0] if first[0] else 0.0
            self._note_restart(first[1][:300], age if 0 <= age < 3600 else 0.0)
        self._phase = NodeState.FAILED if self.remaining_restarts() == 0 else NodeState.RESTARTING

    def _current_step(self, local_rank: int) -> int | None:
        """The step a rank was in, from its progress file (None: it never reported one)."""
        p = read_progress(str(self._ctx.node_dir / f"progress-{local_rank}"))
        return p.current_step if p is not None else None

    def step_time_s(self, local_rank: int | None = None) -> float | None:
        """A rank's step time (the median of its recent step intervals), or with no rank the
        median of this node's ranks'; None before enough steps."""
        watches = ([self._watches[local_rank]] if local_rank in self._watches
                   else [] if local_rank is not None else list(self._watches.values()))
        times = [t for t in (w.median_interval_s() for w in watches) if t is not None]
        if not times:
            return None
        times.sort()
        return round(times[len(times) // 2], 4)

    def _watch_workers(self, worker_group: WorkerGroup) -> None:
        """Judge every running rank (suspect or not) and kill the hung ones."""
        timeout_s = self._ctx.hang_timeout_s
        stopped_limit_s = max(1.0, timeout_s / 3) if timeout_s > 0 else STOPPED_LIMIT_S
        now_ns = time.monotonic_ns()
        self._log_stacks(now_ns / 1e9)
        pids = self.worker_pids()
        verdicts: dict[int, Verdict] = {}
        for w in worker_group.workers:
            pid = pids.get(w.local_rank)
            if pid is None:
                continue
            path = str(self._ctx.node_dir / f"progress-{w.local_rank}")
            state = proc_state(pid)
            p = read_progress(path)
            watch = self._watches.setdefault(w.local_rank, RankWatch(self._rule))
            verdict = watch.observe(p, state, now_ns)
            self._note_verdict(w.global_rank, w.local_rank, pid, verdict, p, path)
            verdicts[w.local_rank] = verdict
            reason = None
            if verdict.stopped_s is not None:
                # A stopped rank is certainly the culprit, while ranks waiting for it in a
                # collective merely stall: catch it well before their stall looks like a hang.
                if verdict.stopped_s >= stopped_limit_s:
                    reason = f"stopped (SIGSTOP) for {verdict.stopped_s:.1f} s"
            elif (timeout_s > 0 and p is not None and p.reported and not p.done
                    and p.age_s() >= timeout_s):
                waited = p.collective_wait_s(now_ns)
                if waited is not None and waited < VICTIM_FACTOR * timeout_s:
                    # Blocked in a collective: it waits for a peer (the culprit, which
                    # stopped outside any collective, here or on another node, is killed
                    # and the restart releases this one). Only a wait that outlasts the
                    # culprit's limit too (a hang inside the collective) is its own.
                    continue
                reason = f"no progress for {p.age_s():.1f} s after step {p.step}"
                if waited is not None:
                    reason += f", blocked in a collective for {waited:.1f} s"
                create_progress_file(path)
            if reason is None:
                continue
            log.error(
                "rank %d (local %d, pid %d) is hung: %s (--hang-timeout %.1f s); "
                "killing it and restarting the workers",
                w.global_rank, w.local_rank, pid, reason, timeout_s,
            )
            self._last_error = f"rank {w.global_rank} hung: {reason}"
            age = p.age_s(now_ns) if p is not None and p.reported else 0.0
            self._hung_killed[w.local_rank] = (reason, time.time() - age)
            self._ctx.sink.event(
                "hang_detected", rank=w.global_rank, local_rank=w.local_rank, pid=pid,
                reason=reason, hang_timeout_s=timeout_s,
            )
            self._log_stacks(math.inf)  # whatever the dump holds, before the process goes
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._verdicts = verdicts

    def _log_stacks(self, now: float) -> None:
        """Log, as one block each, the stack dumps asked for at least STACKS_WAIT_S ago."""
        for local_rank, (due, path, offset, rank, pid) in list(self._stacks_due.items()):
            if now < due:
                continue
            del self._stacks_due[local_rank]
            text = read_stacks(path, offset).rstrip()
            if text:
                log.warning("rank %d (local %d, pid %d): its threads' Python stacks:\n%s", rank,
                            local_rank, pid, text)
            else:
                log.warning("rank %d (local %d, pid %d) wrote no stacks (its process may be "
                            "stuck in a system call that blocks signals)", rank, local_rank, pid)

    def _note_verdict(self, rank: int, local_rank: int, pid: int, verdict: Verdict,
                      progress: Progress | None = None, path: str = "") -> None:
        """Log and record a rank turning suspect, changing cause, or recovering. A rank that
        stopped progressing writes its threads' stacks, logged a moment later: where it
        hangs."""
        before = self._verdicts.get(local_rank, NOT_WATCHED)
        if verdict.cause == before.cause:
            return
        if verdict.suspect:
            offset = (request_stacks(pid, path, progress)
                      if verdict.cause is SuspectCause.NO_PROGRESS and path else None)
            if offset is not None:
                self._stacks_due[local_rank] = (time.monotonic() + STACKS_WAIT_S, path, offset,
                                                rank, pid)
            log.warning("rank %d (local %d, pid %d) is suspect: %s%s", rank, local_rank, pid,
                        verdict.reason,
                        "; its threads' Python stacks follow" if offset is not None else "")
            self._ctx.sink.event(
                "rank_suspect", rank=rank, local_rank=local_rank, pid=pid,
                cause=str(verdict.cause), reason=verdict.reason, step=verdict.step,
                progress_age_s=verdict.fields()["progress_age_s"],
                progress_limit_s=verdict.fields()["progress_limit_s"],
            )
        else:
            log.info("rank %d (local %d, pid %d) is no longer suspect (was: %s)", rank,
                     local_rank, pid, before.reason)
            self._ctx.sink.event("rank_cleared", rank=rank, local_rank=local_rank, pid=pid,
                                 cause=str(before.cause), step=verdict.step)
