"""The states the control plane reports, as documented ``str`` Enums.

Launchers send them in heartbeats, the coordinator folds them into the status document, and
``ftrun status`` renders them. On the wire and in JSON they are their plain string values
(the Enums subclass ``str``), so consumers of ``ftrun status --json`` see ``"healthy"``,
``"suspect"`` and so on. docs/operations.md ("The status document") documents each value.
"""

from __future__ import annotations

from typing import Any, Protocol

from ftrun._enum import StrEnum


class JobHealth(StrEnum):
    """The job's health in the status document; ``ftrun status`` exits with its code."""

    STARTING = "starting"  # no node reported yet, or fewer than the minimum joined
    HEALTHY = "healthy"  # every node runs its workers, no rank is suspect
    DEGRADED = "degraded"  # runs, but a node is lost or isolated, workers restart, or a rank
    # is suspect (by its launcher, or by the collective analysis)
    FAILED = "failed"  # a node failed, or failed workers have no restarts left
    FINISHED = "finished"  # every node succeeded (or left with exit code 0)


class NodeState(StrEnum):
    """What a launcher reports as its node's ``state``."""

    INIT = "init"  # started, not in a rendezvous yet
    RENDEZVOUS = "rendezvous"  # in a rendezvous round
    HEALTHY = "healthy"  # its workers run and are being watched
    RESTARTING = "restarting"  # a worker failed or was killed; the group restarts
    FAILED = "failed"  # workers failed with no restarts left
    SUCCEEDED = "succeeded"  # every worker exited with 0
    STOPPED = "stopped"  # the launcher was stopped by a signal (final state, with ``bye``)
    # The coordinator isolated the node's host (final state, with ``bye`` and exit code 8,
    # ftrun.exit_codes.ISOLATED): its workers were stopped and the job goes on without it.
    ISOLATED = "isolated"


class RankHealth(StrEnum):
    """A running rank's health as its launcher judges it (see ftrun.launcher.suspect)."""

    OK = "ok"  # not stopped, and progress (if it reports any) within its limit
    SUSPECT = "suspect"  # stopped, or silent for longer than its progress limit


class SuspectCause(StrEnum):
    """Why a rank is suspect."""

    STOPPED = "stopped"  # state T or t in /proc: SIGSTOP, a job-control stop, or a tracer
    NO_PROGRESS = "no_progress"  # no ftrun.progress() call for longer than its limit


class FindingKind(StrEnum):
    """What the collective analysis found (ftrun.coordinator.detect; docs/detection.md)."""

    HANG = "hang"  # a rank never entered a collective the others wait in (or went silent)
    COMM_HANG = "comm_hang"  # every rank entered, none finished: the network, probed
    SLOW_RANK = "slow_rank"  # one rank consistently enters last
    SLOW_COMM = "slow_comm"  # durations inflated while arrivals are aligned: probed
    SLOW_HOST = "slow_host"  # probes: a host's row and column are slow
    SLOW_LINK = "slow_link"  # probes: one link is slow


class Action(StrEnum):
    """One vocabulary for what the coordinator does about a finding (``--on-hang``,
    ``--on-slow``: :data:`RESPONSES`) and for the directives it sends launchers (their
    ``data`` in brackets)."""

    WARN = "warn"  # record and log only; never sent as a directive
    RESTART = "restart"  # SIGKILL these local workers {"ranks": [global ranks], "reason"}
    ISOLATE = "isolate"  # stop every worker, leave the job, exit ISOLATED {"reason", "evidence"}
    PROBE = "probe"  # probe these peers, send probe_result {"peers": [...], "size": bytes}
    # A node is lost: take it out of the rendezvous round now rather than when its c10d
    # keep-alives expire {"node", "rdzv_node", "reason", "silent_s"}
    DROP_NODE = "drop_node"
    # Not an order but a request, in a reply to a keep-alive whose workers the coordinator
    # does not hold: send a full heartbeat. The reporter handles it; never handed on or acked.
    REPORT = "report"
    # Not an order either: whom the launcher reports its heartbeats through from now on
    # {"plan", "via", "addr", "group"} (ftrun.coordinator.aggregation). Never acked: a
    # launcher's reports name the plan they follow, and the coordinator sends it again
    # until they name this one.
    AGGREGATE = "aggregate"


# The actions a user may choose for a finding (--on-hang, --on-slow).
RESPONSES = (Action.WARN, Action.RESTART, Action.ISOLATE)


class CoordinatorRole(Protocol):
    """The role a coordinator that fails over holds (``--rdzv-backend etcd``:
    :class:`ftrun.launcher.etcd.CoordinatorElection`): its term, whether its lease still
    holds, and the job's state that must outlive its host (the exclude list, the event log's
    position), kept where the role is.

    ``acting`` is checked before every decision (a commit, a directive, an isolation): False
    once the lease may have run out, even before the renewing thread noticed (a process
    resumed after SIGSTOP). ``save`` writes only while the role is still this holder's
    (False otherwise); both ``load`` and ``save`` are bounded by the store's timeout and
    raise :class:`~ftrun.errors.UnreachableError` when it does not answer.
    """

    term: int

    def acting(self) -> bool: ...

    def load(self, name: str) -> Any: ...

    def save(self, name: str, value: Any) -> bool: ...
