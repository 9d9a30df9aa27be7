"""The store's mirror of the coordinator's commit state for its snapshot epoch.

The store reports every verified shard to the coordinator and learns, from each
``commit_info`` reply, the committed step, the dead steps, the newest durable step and the
persist targets (handed to the persist writer before any claim can see the reply). From that
mirror it answers the ranks' claims without waiting for anyone. A coordinator that lost the
epoch (restarted) is taught it again from the shards verified here. Without a coordinator
this node is the whole job: the coordinator's commit rules (CommitTracker) run in-process.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ftrun.coordinator.commits import FINAL_SETTLE_S, CommitTracker
from ftrun.errors import FtrunError, UnreachableError
from ftrun.protocol.transport import Client
from ftrun.snapshot import segment as shm
from ftrun.store.api import ClaimAnswer, StoreConfig
from ftrun.store.catalog import Catalog, buffer_of, rank_of
from ftrun.store.persist_writer import PersistWriter

log = logging.getLogger("ftrun.store")

COORDINATOR_TIMEOUT_S = 2.0
# After COORDINATOR_QUIET_AFTER requests in a row the coordinator did not answer, the store
# asks it nothing more for COORDINATOR_QUIET_S (within one coordinator term and address):
# each unanswered request holds the store's loop for COORDINATOR_TIMEOUT_S while the ranks'
# claims queue behind it, so a coordinator gone until a failover (or etcd's quorum lost) kept
# the store too busy to answer its ranks or to hear where the coordinator went. (One slow
# answer on a loaded host does not silence it.)
COORDINATOR_QUIET_S = 5.0
MAX_UNREPORTED = 64  # verified reports kept for resending while the coordinator is silent
COORDINATOR_QUIET_AFTER = 2
# How long ranks skip snapshots to keep the newest durable step while replication is behind.
DURABLE_KEEP_S = 60.0


class CommitMirror:
    """The commit state of this store's snapshot epoch, as the coordinator (or the local
    tracker) last told it, and the claims answered from it."""

    def __init__(self, cfg: StoreConfig, coord: Client | None, catalog: Catalog,
                 persister: PersistWriter) -> None:
        self.cfg = cfg
        self._coord = coord
        self.catalog = catalog
        self._persist = persister
        self.epoch = ""
        self.base = -1  # the step the current epoch resumed from
        self.committed = -1
        self.dead: set[int] = set()  # uncommitted steps of the epoch that can never commit
        self._discarded: set[int] = set()  # steps whose replicas disagreed, discarded here
        self._durable: int | None = None  # newest durable step, while replication runs
        self._durable_since = 0.0
        self.source = ""  # where the epoch's ranks restored from
        self._durable_warned = False
        self._durable_silent = False  # said that replies no longer name a durable step
        # --redundancy ec:K+M: durable steps come from this store's erasure coding
        # (ftrun.store.ec_store), not from the coordinator's count of replicas
        self.erasure = False
        self.world_size = 0
        # Without a coordinator this node is the whole job: the same commit and target rules
        # run here (nothing to wait for at the end: every rank reports to this store).
        self._local = CommitTracker(final_settle_s=0.0) if coord is None else None
        self.replication: Any = None  # ftrun.store.replica.Replication, once started
        # The coordinator (term, address) that did not answer, and until when it is not asked.
        self._quiet: tuple[int, str] | None = None
        self._quiet_until = 0.0
        self._unanswered = 0  # requests in a row the coordinator did not answer
        self._unreported: list[dict[str, Any]] = []  # snap_verified bodies not answered yet
        self.answered = True  # whether the last ask() was answered (an error reply too)

    def ask(self, kind: str, body: dict[str, Any]) -> dict[str, Any] | None:
        if self._local is not None:
            reply, _ = self._local.handle(kind, body)
            for t in self._local.new_targets:
                log.info("persist target: step %d (%s%s)", t.step, t.reason,
                         ", final" if t.final else "")
            self._local.new_targets.clear()
            for d in self._local.sdc.found:  # no coordinator to act on it: said, never restored
                log.error("silent data corruption: step %d: the replicas of rank(s) %s differ; "
                          "the step is never restored", d.step, list(d.ranks))
            self._local.sdc.found.clear()
            return reply
        assert self._coord is not None
        self.answered = False
        if self.coordinator_quiet():
            return None  # it did not answer a moment ago: no commit info, as if asked
        try:
            msg = self._coord.request(kind, body, "commit_info", COORDINATOR_TIMEOUT_S)
        except UnreachableError as e:
            log.warning("coordinator: %s", e)
            self.coordinator_unanswered()
            return None
        except FtrunError as e:
            self.coordinator_answered()  # (an error reply is an answer)
            log.warning("coordinator: %s", e)
            return None
        self.coordinator_answered()
        return msg.body

    def coordinator_quiet(self) -> bool:
        """Whether the coordinator left a request unanswered within COORDINATOR_QUIET_S (and
        is still the one asked: a failover moves the store to another)."""
        coord = self._coord
        return coord is not None and self._quiet == (coord.term, coord.address) \
            and time.monotonic() < self._quiet_until

    def coordinator_answered(self) -> None:
        self._unanswered = 0
        self.answered = True

    def coordinator_unanswered(self) -> None:
        """The coordinator did not answer a request: after COORDINATOR_QUIET_AFTER in a row,
        ask it nothing for a while."""
        assert self._coord is not None
        self._unanswered += 1
        if self._unanswered < COORDINATOR_QUIET_AFTER:
            return
        self._unanswered = 0
        self._quiet = (self._coord.term, self._coord.address)
        self._quiet_until = time.monotonic() + COORDINATOR_QUIET_S
        log.warning("coordinator at %s did not answer %d requests in a row: asking it nothing "
                    "for %g s", self._coord.address, COORDINATOR_QUIET_AFTER,
                    COORDINATOR_QUIET_S)

    def epoch_body(self, epoch: str, base_step: int) -> dict[str, Any]:
        body: dict[str, Any] = {"node_id": self.cfg.node_id, "epoch": epoch,
                                "base_step": base_step, "world_size": self.world_size}
        if self.source:
            body["source"] = self.source
        if self.cfg.persist.dir:
            # The coordinator schedules targets with these (every store passes the same).
            body["persist_every"] = self.cfg.persist.every
            body["persist_interval_s"] = float(self.cfg.persist.interval_s)
        return body

    def ask_epoch(self, kind: str, body: dict[str, Any], epoch: str) -> dict[str, Any] | None:
        """``ask`` about the current epoch; a coordinator that lost it (restarted) is taught
        it again, with every shard verified here, and asked once more."""
        info = self.ask(kind, body)
        if info is not None and not info["known"] and epoch == self.epoch:
            self.reteach()
            info = self.ask(kind, body)
        self._note_commit(info, epoch)
        return info

    def reteach(self) -> None:
        if not self.world_size:
            return  # nothing verified here yet: nothing to teach
        self.ask("snap_epoch", {**self.epoch_body(self.epoch, max(self.committed, 0)),
                                "retaught": True})
        held = []
        for name in self.catalog.names():
            seg = self.catalog.open(name)
            if seg is None:
                continue
            h = seg.header()
            if h.state == shm.VERIFIED and h.epoch == self.epoch:
                held.append((h.step, rank_of(name)[0], h.data_len))
        # Oldest first, as they were verified: a rank's newer shard reported before its older
        # one would make the older step look passed over (dead).
        for step, rank, nbytes in sorted(held):
            self.ask("snap_verified", {"node_id": self.cfg.node_id, "epoch": self.epoch,
                                       "rank": rank, "step": step, "nbytes": nbytes})
        if self.replication is not None:
            self.replication.reteach()  # and the replicas of peers' shards held here

    def _note_commit(self, info: dict[str, Any] | None, epoch: str) -> None:
        """Take in a commit_info reply: the committed step, then the persist targets.

        Targets are handled here, before the reply can let any claim through: a rank only
        overwrites a target's buffer after the next step committed, which this very reply
        may be the first to say.
        """
        if not (info and info.get("known") and info["epoch"] == epoch == self.epoch):
            return
        if info["committed"] > self.committed and self.replication is not None:
            self.replication.sender.wake()
        self.committed = max(self.committed, info["committed"])
        self._note_durable(info.get("durable"))
        # Before any claim can see them dead (and overwrite them): no restore may load them.
        self._discard_disagreed(epoch, info.get("disagreed") or ())
        self.dead = set(info.get("dead") or ())
        if info.get("final") is not None:
            self._persist.final = info["final"]
        self._persist.take_targets(sorted(info.get("targets") or ()), self.base)

    def report_verified(self, epoch: str, rank: int, step: int, nbytes: int,
                        replicas: list[dict[str, Any]] | None = None) -> None:
        if not epoch:
            return
        body: dict[str, Any] = {"node_id": self.cfg.node_id, "epoch": epoch, "rank": rank,
                                "step": step, "nbytes": nbytes}
        if replicas:
            body["replicas"] = replicas
        if self._unreported:  # after the older ones, in order
            self._unreported.append(body)
            self.resend_unreported()
        elif self.ask_epoch("snap_verified", body, epoch) is None and not self.answered:
            self._unreported.append(body)

    def resend_unreported(self) -> None:
        """Report again the verified shards whose report the coordinator did not answer,
        oldest first (from the store's loop, every second). A step that the coordinator
        does not hear of from every rank never commits, and every later claim of the job's
        ranks is refused: a report lost to an unanswered request (a coordinator overloaded,
        failing over, or asked nothing for a while) would stop the job's snapshots until its
        next restart. Reports of an epoch that is over are dropped."""
        while self._unreported:
            body = self._unreported[0]
            if body["epoch"] == self.epoch and \
                    self.ask_epoch("snap_verified", body, body["epoch"]) is None \
                    and not self.answered:
                if len(self._unreported) > MAX_UNREPORTED:
                    dropped = self._unreported.pop(0)
                    log.warning("coordinator unanswered: dropped the report of rank %d step %d",
                                dropped["rank"], dropped["step"])
                return
            self._unreported.pop(0)

    def refresh(self) -> None:
        """Ask for the epoch's commit state now (before a restore reads this store)."""
        if self.epoch:
            self.ask_epoch("commit_query", {"epoch": self.epoch}, self.epoch)

    def _discard_disagreed(self, epoch: str, steps: Any) -> None:
        """Mark this node's verified shards of ``steps`` (whose replicated tensors differ
        between replicas: ftrun.coordinator.corruption) empty, so that no restore loads them."""
        for step in sorted(set(steps) - self._discarded):
            self._discarded.add(step)
            ranks = []
            for name in self.catalog.names():
                which = buffer_of(name)  # a rank's own buffer (replicas are of committed steps)
                seg = self.catalog.open(name) if which is not None else None
                if seg is None or which is None:
                    continue
                h = seg.header()
                if h.state == shm.VERIFIED and h.epoch == epoch and h.step == step:
                    seg.set_state(shm.EMPTY)
                    ranks.append(which[0])
            if ranks:
                log.warning("step %d discarded (rank(s) %s here): its replicated tensors "
                            "differ between replicas (silent data corruption)", step,
                            sorted(ranks))

    def _note_durable(self, durable: int | None) -> None:
        """Follow the newest durable step (None: the reply says nothing of it).

        A reply without one never lowers the durable step known for the epoch, whatever the
        reason: the coordinator leaves it out whenever it counts fewer than two stores taking
        replicas, which is also its passing view (a store whose report it has not had for a
        while; a new coordinator after a failover, which first hears of this store alone and
        sends it a replica plan without peers before the others report). The copies of that
        step are kept until a newer step is durable (DURABLE_KEEP_S bounds the wait as ever):
        a host lost meanwhile, the coordinator's host among them, still restores from memory.
        Forgetting it there let a rank overwrite its shard of the durable step whose only
        other copy was on the host being lost. Only a new epoch starts without one."""
        if durable is None:
            if self.erasure:
                return  # the coordinator counts replicas only; parity says what is durable
            if self._durable is not None and self._durable >= 0 and not self._durable_silent:
                self._durable_silent = True
                log.info("the coordinator reports no durable step (replication off, or its "
                         "picture not rebuilt yet): the ranks' snapshots of step %d are kept "
                         "until a newer step is durable (at most %g s)", self._durable,
                         DURABLE_KEEP_S)
            return
        self._durable_silent = False
        if self._durable is None or durable > self._durable:
            self._durable, self._durable_since = durable, time.monotonic()

    def note_parity_durable(self, step: int) -> None:
        """Erasure coding: the whole placement holds step ``step``'s parity (called from the
        erasure-coding thread; a newer step only ever raises it)."""
        if self._durable is None or step > self._durable:
            self._durable, self._durable_since = step, time.monotonic()

    def parity_off(self) -> None:
        """Erasure coding: no parity can be built now (fewer nodes than K + M hold the
        step): the ranks' buffers are no longer kept waiting for it (until a step is durable
        again)."""
        self._durable = None

    def durable_step(self) -> int:
        """The newest durable step this store knows (-1: none, or no replication)."""
        return -1 if self._durable is None else self._durable

    def _durable_kept(self, need: int) -> bool:
        """Whether a rank whose newest shard is step ``need`` may overwrite its older buffer
        without losing the newest durable step: yes once ``need`` is durable itself. While
        replication is behind, the older buffer (the durable step) is kept and the ranks skip
        snapshots, for at most DURABLE_KEEP_S: a host lost meanwhile still restores from
        memory. Past that, replication is too slow to wait for: local snapshots go on (a
        crash restores the newest step; a lost host an older durable one, or the disk)."""
        if self._durable is None or self._durable >= need or need <= self.base:
            return True  # (the step an epoch resumed from is kept as it was)
        behind = time.monotonic() - self._durable_since
        if behind <= DURABLE_KEEP_S:
            return False
        if not self._durable_warned:
            self._durable_warned = True
            peerless = self.replication is not None and not self.replication.sender.peers
            if self.erasure:
                log.warning("erasure coding is %.0f s behind (durable step %d, committed %d): "
                            "snapshots no longer wait for its parity; a lost host restores "
                            "from an older durable step or from disk", behind, self._durable,
                            self.committed)
                return True
            log.warning("replication is %.0f s behind (durable step %d, committed %d): "
                        "snapshots no longer wait for it; a lost host restores from an older "
                        "durable step or from disk. %s", behind, self._durable, self.committed,
                        "No peer node takes this node's replicas now (the others gone, or "
                        "the coordinator has not heard from them)" if peerless else
                        "Raise --replica-rate or lower --snapshot-every")
        return True

    def claim(self, epoch: str, need: int) -> ClaimAnswer | None:
        """Whether a rank whose newest shard is step ``need`` may write its next snapshot:
        "older" (``need`` committed: overwrite the older buffer), "newest" (``need`` is dead:
        overwrite that shard, the older buffer keeps the last committed step) or None."""
        for ask in (False, True):
            if ask:
                self.ask_epoch("commit_query", {"epoch": epoch}, epoch)
            if epoch != self.epoch:
                return None
            if self.committed >= need and self._durable_kept(need):
                return ClaimAnswer.OLDER
            if need in self.dead:
                return ClaimAnswer.NEWEST
        return None

    def request_persist(self, reason: str, final: bool = False) -> dict[str, Any] | None:
        """Ask for a persist target now (every node's store then writes that step)."""
        if not self.epoch:
            log.info("persist (%s): no snapshot epoch yet, nothing committed to write", reason)
            return None
        body = {"node_id": self.cfg.node_id, "epoch": self.epoch, "reason": reason,
                "final": final}
        deadline = time.monotonic() + FINAL_SETTLE_S + 2 * COORDINATOR_TIMEOUT_S
        while True:
            info = self.ask_epoch("persist_request", body, self.epoch)
            if not (info and info.get("settling")) or time.monotonic() > deadline:
                return info
            time.sleep(0.1)

    def begin_epoch(self, epoch: str, base: int, restarted: bool) -> None:
        self.epoch, self.committed, self.base = epoch, base, base
        self._durable, self._durable_warned, self._durable_silent = None, False, False
        if self.erasure:
            # The step resumed from counts as durable: the ranks keep their buffers of each
            # durable step until a newer one's parity is built, from the first on.
            self._durable, self._durable_since = base, time.monotonic()
        self.dead = set()
        self._discarded: set[int] = set()  # steps whose replicas disagreed, discarded here
        self._persist.new_epoch(restarted)

    def follow_epoch(self, epoch: str, base: int) -> None:
        """A rank speaks of an epoch this store never heard begin: the store was restarted
        after the workers' restore (it guessed its epoch from old segments). The ranks' epoch
        is the current one; take it, with the step it resumed from, and teach it onwards."""
        log.info("following the ranks into snapshot epoch %s (resumed from step %d; this store "
                 "had %s)", epoch, base, self.epoch or "none")
        self.begin_epoch(epoch, base, restarted=True)
        self.reteach()
        self.ask_epoch("commit_query", {"epoch": epoch}, epoch)
