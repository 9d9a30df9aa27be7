"""Global snapshot commits, and which committed steps go to disk.

**Commits.** Step S is committed once every rank's shard of S is verified. Commits are counted
per *epoch*. Every (re)start of the workers begins a new epoch at ``restore()``, where all
ranks agree on one epoch id and the step they resumed from (its ``base_step``, committed by
definition). Counting per epoch keeps shards verified by a previous incarnation of the workers
from completing a step that the current one has not written yet.

**Persist targets.** With several nodes, every node's store must write the *same* step, or no
step on disk is ever complete. So the step is chosen here, in one place, at the moment it
commits: when step S commits and is due (``--persist-every``, ``--persist-interval``), S
becomes a *target*. A signal (SIGUSR1) makes the current committed step a target; the end of
the job (or SIGTERM) fixes one *final* target per epoch, after which nothing else is scheduled.

Every commit reply carries the epoch's recent targets. That is what makes the scheme safe: a
rank overwrites the buffer holding target S only after S+1 committed, and its store learns
that S+1 committed from a reply that already lists S, so the store always still holds S when
it copies it out.

A scheduled target is not made while some node's store is still writing the previous one
(the disk is behind): the step is skipped on every node alike, and the next commit after the
write finished is due instead. Stores say what they are writing in their reports.

**Dead steps.** Ranks never wait for the store: a rank whose buffer was not released in time
skips that snapshot, and the others may not have. A step that one rank skipped can never
commit, and its shards would hold the other ranks' buffers forever (a rank overwrites its
older buffer only once its newest step committed). So a step is *dead* once a rank verified a
later step without it (ranks stage steps in order), or a rank's shard of it failed
verification. Replies list the epoch's dead steps; a store then lets a rank whose newest shard
is dead overwrite that shard instead, and its older buffer, the last committed step, stays.

**Durable steps.** With replicas (``--replicas m``), a committed step is also *durable* once
every rank's shard of it has ``m - 1`` verified replicas on other nodes (their stores report
each one, ftrun.store.replica). Durable steps are a subset of committed ones, and
``durable`` never passes ``committed``. With fewer live nodes taking replicas than m, only
``nodes - 1`` replicas can exist: that many count. With one such node (a one-node job) there
is no peer at all: nothing can become durable, and the summary says so (``durable_off``)
instead of waiting for it. The summary also says how far durable lags committed, in steps
and in seconds between their commits, and which nodes hold a verified replica of each rank's
shard of the durable step and of newer ones.

**Commits, for the event log.** One event per commit would flood the log (a step every few
milliseconds), so commits are batched (:class:`CommitBatch`): the coordinator records one
``snapshots_committed`` event with the ``[step, unix time]`` of each commit since the last one,
at most every ``COMMITS_EVENT_EVERY_S``, and at once before a failure, a recovery and the
job's end, so that the report's timeline misses none that came before them.

Everything here can be rebuilt from the stores: they report again after a coordinator
restart. The same tracker runs inside a store that has no coordinator (a one-node job).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ftrun.coordinator.corruption import ReplicaCheck
from ftrun.snapshot.api import PersistConfig

MAX_PENDING_STEPS = 64  # steps tracked per epoch; older incomplete ones are dropped
MAX_TARGETS = 8  # targets listed in a reply: far more than can pass between two replies
NO_PEER = "one node: no peer node to hold replicas"
# The final target waits this long for a step that some ranks have verified and others not
# yet (the end of a job: nodes stop a moment apart). A step that never completes (workers
# killed mid-step) only delays the decision by this much.
FINAL_SETTLE_S = 5.0
# Persist requests by signal within this long of the last one make no new target: SIGUSR1
# reaches every node's store at about the same time, and one write is meant.
SIGNAL_COALESCE_S = 5.0
# One snapshots_committed event at most this often (sooner before a failure or the end).
COMMITS_EVENT_EVERY_S = 30.0
# Commits one such event lists at most; more are thinned evenly (CommitBatch).
MAX_COMMITS_PER_EVENT = 256


@dataclass
class Epoch:
    epoch: str
    base_step: int
    world_size: int
    created_at: float
    committed: int
    committed_at: float
    verified: dict[int, set[int]] = field(default_factory=dict)
    nbytes: dict[int, int] = field(default_factory=dict)  # rank -> bytes of its last shard
    targets: list[int] = field(default_factory=list)  # persist targets, oldest first
    final: int | None = None  # the final target, once fixed
    commits: int = 0  # steps committed in this epoch
    final_asked_mono: float | None = None  # when the first store asked for it
    newest: dict[int, int] = field(default_factory=dict)  # rank -> newest step it verified
    newest_any: int = -1  # max(newest.values())
    dead: set[int] = field(default_factory=set)  # uncommitted steps that can never commit
    # step -> rank -> nodes holding a verified replica of that shard (origins excluded)
    replicated: dict[int, dict[int, set[str]]] = field(default_factory=dict)
    durable: int = -1  # newest committed step with m - 1 verified replicas of every shard
    durable_at: float = 0.0
    source: str = ""  # where its ranks restored base_step from (memory, disk, none)
    commit_times: dict[int, float] = field(default_factory=dict)  # step -> when it committed
    disagreed: set[int] = field(default_factory=set)  # dead: the replicas differ (corruption)

    def pending(self) -> dict[int, int]:
        """step -> verified ranks, for steps newer than the committed one that can still
        commit."""
        return {s: len(r) for s, r in self.verified.items()
                if s > self.committed and r and s not in self.dead}

    def live_dead(self) -> list[int]:
        """The dead steps newer than the committed one, oldest first."""
        return sorted(s for s in self.dead if s > self.committed)

    def mark_dead(self, step: int) -> None:
        if step > self.committed:
            self.dead.add(step)
            self.verified.pop(step, None)
            while len(self.dead) > MAX_PENDING_STEPS:
                self.dead.discard(min(self.dead))

    def note_verified(self, rank: int, step: int) -> None:
        """Steps that ``rank`` passed over on its way to ``step`` are dead, and so is
        ``step`` if another rank already went past it without it."""
        before = self.newest.get(rank, self.base_step)
        for s in [s for s in self.verified if before < s < step and rank not in self.verified[s]]:
            self.mark_dead(s)
        if step < self.newest_any and any(
                n > step and r != rank and r not in self.verified.get(step, ())
                for r, n in self.newest.items()):
            self.mark_dead(step)
        if step > before:
            self.newest[rank] = step
            self.newest_any = max(self.newest_any, step)


@dataclass(frozen=True)
class TargetEvent:
    """A new persist target, for the event log."""

    epoch: str
    step: int
    reason: str
    final: bool


@dataclass
class StoreState:
    """What a node's store last reported about its writes."""

    persist: bool  # it writes to disk at all
    epoch: str | None  # the epoch of target_done
    target_done: int  # newest target of that epoch it is done with (written or given up)
    writing: int | None  # the target being written now


class CommitBatch:
    """The commits since the last ``snapshots_committed`` event, as ``[step, unix time]``.

    At most ``limit`` are kept: once more come, every other one kept is dropped and from then
    on only every 2nd (4th, ...) commit is kept, so that what is kept stays spread evenly over
    the batch's time; the first and the newest commit are always listed, and the event says
    how many were left out. Not thread-safe: its owner's lock covers it.
    """

    def __init__(self, limit: int = MAX_COMMITS_PER_EVENT,
                 every_s: float = COMMITS_EVENT_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if limit < 2:
            raise ValueError(f"a commit batch keeps at least 2 commits, got limit={limit}")
        self._limit = limit
        self._every_s = every_s
        self._clock = clock
        self._last_drain = clock()
        self._reset()

    def _reset(self) -> None:
        self._kept: list[list[float | int]] = []
        self._stride = 1
        self._seen = 0
        self._newest: list[float | int] | None = None

    def add(self, step: int, at: float) -> None:
        self._newest = [step, round(at, 3)]
        if self._seen % self._stride == 0:
            self._kept.append(self._newest)
            if len(self._kept) >= self._limit:  # room for the newest kept apart
                self._kept = self._kept[::2]
                self._stride *= 2
        self._seen += 1

    def drain(self, force: bool = False) -> dict[str, Any] | None:
        """The ``snapshots_committed`` event's data, and a new batch; None when no commit
        came, or (unless ``force``) the last event is less than ``every_s`` old."""
        now = self._clock()
        if not self._seen or (not force and now - self._last_drain < self._every_s):
            return None
        commits = list(self._kept)
        if self._newest is not None and commits[-1] is not self._newest:
            commits.append(self._newest)
        out = {"commits": commits, "count": self._seen, "dropped": self._seen - len(commits)}
        self._last_drain = now
        self._reset()
        return out


class CommitTracker:
    def __init__(self, max_epochs: int = 16, clock: Callable[[], float] = time.monotonic,
                 final_settle_s: float = FINAL_SETTLE_S,
                 node_gone: Callable[[str], bool] = lambda _node: False) -> None:
        self._final_settle_s = final_settle_s
        self._node_gone = node_gone
        self.stores: dict[str, StoreState] = {}
        self._skip_logged: tuple[str, int] | None = None
        self._epochs: dict[str, Epoch] = {}
        self._order: list[str] = []
        self._max_epochs = max_epochs
        self._clock = clock
        self.persisted: dict[str, int | None] = {}  # node -> newest persisted step
        self.policy = PersistConfig()
        self._last_target_step = -1  # across epochs: a restart does not reset the schedule
        self._last_target_mono: float | None = None
        self._last_signal_mono: float | None = None
        self.new_targets: list[TargetEvent] = []  # drained by whoever logs events
        self.skipped: list[tuple[int, list[str]]] = []  # (step, nodes still writing): drained
        self.replicas = 1  # m, as the stores report it (1: no replication, nothing durable)
        self.replica_nodes: int | None = None  # live nodes taking replicas (None: not known)
        self.sdc = ReplicaCheck()  # replicas' digests compared before a step commits
        self.commit_batch = CommitBatch(clock=clock)  # drained by whoever logs events

    def begin(self, epoch: str, base_step: int, world_size: int) -> Epoch:
        ep = self._epochs.get(epoch)
        if ep is None:
            now = time.time()
            ep = Epoch(epoch, base_step, world_size, now, base_step, now)
            self._epochs[epoch] = ep
            self._order.append(epoch)
            while len(self._order) > self._max_epochs:
                self._epochs.pop(self._order.pop(0), None)
            if self._last_target_mono is None:
                self._last_target_mono = self._clock()
        return ep

    def verified(self, epoch: str, rank: int, step: int, nbytes: int) -> Epoch | None:
        """Record a verified shard; returns the epoch (None if unknown)."""
        ep = self._epochs.get(epoch)
        if ep is None:
            return None
        ep.nbytes[rank] = nbytes
        if step <= ep.committed:
            return ep
        ep.note_verified(rank, step)
        if step in ep.dead:
            return ep
        ranks = ep.verified.setdefault(step, set())
        ranks.add(rank)
        if len(ranks) >= ep.world_size and not self.sdc.agree(epoch, step):
            ep.disagreed = {s for s in ep.disagreed if s > ep.committed} | {step}
            ep.mark_dead(step)  # never committed, never restored
        elif len(ranks) >= ep.world_size:
            ep.committed, ep.committed_at = step, time.time()
            ep.commits += 1
            ep.commit_times[step] = ep.committed_at
            self.commit_batch.add(step, ep.committed_at)
            while len(ep.commit_times) > MAX_PENDING_STEPS:
                del ep.commit_times[min(ep.commit_times)]
            for old in [s for s in ep.verified if s <= step]:
                del ep.verified[old]
            ep.dead = {s for s in ep.dead if s > step}
            self._on_commit(ep, step)
            self._check_durable(ep, step)
        while len(ep.verified) > MAX_PENDING_STEPS:
            del ep.verified[min(ep.verified)]
        return ep

    def failed(self, epoch: str, rank: int, step: int) -> Epoch | None:
        """A rank's shard of ``step`` failed verification: the step can never commit."""
        ep = self._epochs.get(epoch)
        if ep is not None:
            ep.note_verified(rank, step)
            ep.mark_dead(step)
        return ep

    # -- durable steps ---------------------------------------------------------------------
    def replica_verified(self, epoch: str, holder: str, origin: str, rank: int,
                         step: int) -> Epoch | None:
        """``holder`` verified a replica of ``origin``'s shard of ``rank`` at ``step``."""
        ep = self._epochs.get(epoch)
        if ep is None or holder == origin or step <= ep.durable:
            return ep
        ep.replicated.setdefault(step, {}).setdefault(rank, set()).add(holder)
        while len(ep.replicated) > MAX_PENDING_STEPS:
            del ep.replicated[min(ep.replicated)]
        self._check_durable(ep, step)
        return ep

    def replica_dropped(self, epoch: str, holder: str, rank: int, step: int) -> None:
        """``holder`` no longer holds its replica of ``rank``'s shard at ``step`` (overwritten
        by a newer one): a step not yet durable does not count it any more."""
        ep = self._epochs.get(epoch)
        if ep is None or step <= ep.durable:
            return
        ep.replicated.get(step, {}).get(rank, set()).discard(holder)

    def needed(self) -> int:
        """Verified replicas every shard needs for durable: m - 1, or fewer when fewer nodes
        take replicas (0: none possible, nothing is ever durable)."""
        if self.replicas <= 1:
            return 0
        if self.replica_nodes is None:
            return self.replicas - 1
        return max(0, min(self.replicas, self.replica_nodes) - 1)

    def durable_off(self) -> str | None:
        """Why no step can become durable now (None: replicas are on and possible)."""
        if self.replicas <= 1:
            return "replication off (--replicas 1)"
        if self.needed() <= 0:
            return NO_PEER
        return None

    def set_replica_nodes(self, n: int) -> None:
        """The live nodes that take replicas; a step already fully replicated for the new
        count becomes durable now."""
        if n == self.replica_nodes:
            return
        self.replica_nodes = n
        ep = self.latest()
        if ep is not None:
            for step in sorted(ep.replicated, reverse=True):
                self._check_durable(ep, step)

    def _check_durable(self, ep: Epoch, step: int) -> None:
        need = self.needed()
        if need <= 0 or step > ep.committed or step <= ep.durable:
            return
        ranks = ep.replicated.get(step, {})
        if all(len(ranks.get(r, ())) >= need for r in range(ep.world_size)):
            ep.durable, ep.durable_at = step, time.time()
            for old in [s for s in ep.replicated if s < step]:
                del ep.replicated[old]

    def covered(self, ranks: list[int]) -> int | None:
        """The newest step of the latest epoch whose shards of ``ranks`` all have ``m - 1``
        verified replicas (a node's replica coverage), or None."""
        ep = self.latest()
        need = self.needed()
        if ep is None or need <= 0 or not ranks:
            return None
        best = ep.durable if ep.durable > 0 else None
        for step, held in ep.replicated.items():
            if (best is None or step > best) and all(
                    len(held.get(r, ())) >= need for r in ranks):
                best = step
        return best

    def holders(self, ep: Epoch) -> dict[str, dict[str, list[str]]]:
        """step -> rank -> nodes holding a verified replica of that rank's shard, for the
        durable step and the newest committed step any replica of which is verified."""
        steps = {ep.durable} | {max((s for s in ep.replicated if s <= ep.committed),
                                    default=-1)}
        return {str(step): {str(r): sorted(nodes) for r, nodes in sorted(ep.replicated[step].items())}
                for step in sorted(steps) if step > 0 and step in ep.replicated}

    def _durable_fields(self, ep: Epoch) -> dict[str, Any]:
        off = self.durable_off()
        durable = ep.durable if ep.durable > 0 and off is None else None
        lag_steps = lag_s = None
        if off is None and ep.committed > 0:
            # How far durable trails committed: in steps, and in the time between the two
            # steps' commits (unknown when the durable step committed before this
            # coordinator started: then since the epoch began here).
            base = ep.durable if durable is not None else ep.base_step
            lag_steps = ep.committed - max(base, 0)
            since = ep.commit_times.get(base, ep.created_at) if durable is not None \
                else ep.created_at
            lag_s = round(max(0.0, ep.committed_at - since), 3) if lag_steps else 0.0
        return {
            "replicas": self.replicas,
            "replica_nodes": self.replica_nodes,
            "durable_off": off if self.replicas > 1 else None,
            "durable_step": durable,
            "durable_age_s": round(time.time() - ep.durable_at, 3) if durable else None,
            "durable_lag_steps": lag_steps,
            "durable_lag_s": lag_s,
            "replica_holders": self.holders(ep) if off is None else {},
        }

    def _on_commit(self, ep: Epoch, step: int) -> None:
        if ep.final is not None or not (self.policy.every or self.policy.interval_s):
            return
        last = max(self._last_target_step, ep.base_step)
        since = self._clock() - (self._last_target_mono or 0.0)
        reason = self.policy.due(step, last, since)
        if reason is None:
            return
        writing = self.writing(ep)
        if writing:
            if self._skip_logged != (ep.epoch, ep.targets[-1]):
                self._skip_logged = (ep.epoch, ep.targets[-1])
                self.skipped.append((step, writing))
            return
        self._add_target(ep, step, reason, final=False)

    def writing(self, ep: Epoch) -> list[str]:
        """Nodes of the epoch whose store is not done with its newest target yet (a store
        that reports no part in the epoch, such as a spare node's, holds nothing up)."""
        if not ep.targets:
            return []
        last = ep.targets[-1]
        return sorted(
            node for node, st in self.stores.items()
            if st.persist and st.epoch == ep.epoch and not self._node_gone(node)
            and (st.writing is not None or st.target_done < last)
        )

    def _add_target(self, ep: Epoch, step: int, reason: str, *, final: bool) -> None:
        if step not in ep.targets:
            ep.targets.append(step)
            del ep.targets[:-MAX_TARGETS]
        if final:
            ep.final = step
        self._last_target_step = max(self._last_target_step, step)
        self._last_target_mono = self._clock()
        self.new_targets.append(TargetEvent(ep.epoch, step, reason, final))

    def request(self, epoch: str, reason: str, *, final: bool) -> tuple[Epoch | None, bool]:
        """A store asks for a target now: (the epoch or None if unknown, settling).

        ``final`` (end of job, SIGTERM): the first request fixes the epoch's final target,
        the committed step, after waiting up to ``final_settle_s`` for a step some ranks have
        verified already (``settling`` is True meanwhile: ask again). Later requests get the
        same one. Otherwise (a signal): the committed step becomes a target, unless one was
        made by a signal less than SIGNAL_COALESCE_S ago.
        """
        ep = self._epochs.get(epoch)
        if ep is None:
            return None, False
        now = self._clock()
        if final:
            if ep.final is None:
                if ep.final_asked_mono is None:
                    ep.final_asked_mono = now
                if ep.pending() and now - ep.final_asked_mono < self._final_settle_s:
                    return ep, True
                self._add_target(ep, ep.committed, reason, final=True)
            return ep, False
        if ep.final is None and (self._last_signal_mono is None
                                 or now - self._last_signal_mono >= SIGNAL_COALESCE_S):
            self._last_signal_mono = now
            self._add_target(ep, ep.committed, reason, final=False)
        return ep, False

    def get(self, epoch: str) -> Epoch | None:
        return self._epochs.get(epoch)

    def latest(self) -> Epoch | None:
        return self._epochs[self._order[-1]] if self._order else None

    def summary(self) -> dict[str, object] | None:
        ep = self.latest()
        if ep is None:
            return None
        persisted = [s for s in self.persisted.values() if s is not None]
        return {
            "epoch": ep.epoch,
            "world_size": ep.world_size,
            "base_step": ep.base_step,
            "restored_from": ep.source or None,
            "committed_step": ep.committed if ep.committed > 0 else None,
            "committed_age_s": round(time.time() - ep.committed_at, 3) if ep.committed > 0 else None,
            "pending_steps": sorted(ep.verified),
            "dead_steps": ep.live_dead(),
            "bytes_per_rank": {str(r): b for r, b in sorted(ep.nbytes.items())},
            "persisted_step": min(persisted) if persisted else None,
            **self._durable_fields(ep),
            # Steps per committed snapshot in this epoch: the interval, plus what skips cost.
            "effective_every": (round((ep.committed - ep.base_step) / ep.commits, 1)
                                if ep.commits else None),
        }

    # -- the store <-> coordinator messages, answered here so that a store without a
    # coordinator runs exactly the same rules ------------------------------------------------
    def handle(self, kind: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Answer snap_epoch/snap_verified/commit_query/persist_request with a commit_info
        body; the second value is a ``restore`` event's data when an epoch began."""
        began = None
        settling = False
        if kind == "snap_epoch":
            if body.get("persist_every") is not None or body.get("persist_interval_s") is not None:
                self.policy = PersistConfig(int(body.get("persist_every") or 0),
                                            float(body.get("persist_interval_s") or 0.0))
            known = self._epochs.get(body["epoch"]) is not None
            ep: Epoch | None = self.begin(body["epoch"], body["base_step"], body["world_size"])
            if ep is not None and body.get("source") and not ep.source:
                ep.source = body["source"]
            if not known and ep is not None:
                began = {"epoch": ep.epoch, "step": ep.base_step, "world_size": ep.world_size,
                         "source": ep.source}
                if body.get("retaught"):
                    began["retaught"] = True
        elif kind == "snap_verified" and not body.get("ok", True):
            ep = self.failed(body["epoch"], body["rank"], body["step"])
        elif kind == "snap_verified":
            self.sdc.note(body)
            ep = self.verified(body["epoch"], body["rank"], body["step"], body["nbytes"])
        elif kind == "persist_request":
            ep, settling = self.request(body["epoch"], body["reason"], final=body["final"])
        else:
            ep = self.get(body["epoch"])
        if ep is None:
            return {"epoch": body["epoch"], "committed": -1, "known": False}, began
        reply: dict[str, Any] = {"epoch": ep.epoch, "committed": ep.committed, "known": True,
                                 "targets": list(ep.targets), "final": ep.final}
        dead = ep.live_dead()
        if dead:
            reply["dead"] = dead
        disagreed = sorted(s for s in ep.disagreed if s > ep.committed)
        if disagreed:
            reply["disagreed"] = disagreed
        if settling:
            reply["settling"] = True
        return reply, began
