"""A rank's restore: find the newest step complete across the job (this node's memory,
peers' stores and replicas, resharded when the world size changed), load and verify it,
and fall back to the persisted DCP checkpoint when memory holds no complete step."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from ftrun import knobs
from ftrun.errors import FtrunError, IntegrityError, UnreachableError
from ftrun.rank import shards
from ftrun.rank.context import STORE_TIMEOUT_S, RankContext
from ftrun.rank.state import TrainingState
from ftrun.snapshot import segment as shm
from ftrun.snapshot import verify
from ftrun.snapshot.manifest import parse_manifest, tensor_view, unflatten

log = logging.getLogger("ftrun.rank.snapshotter")

MODEL_KEY = "/model/"
# A rank waits this long at most for its store's survey of the job's stores (each store has
# ftrun.store.survey.SURVEY_TIMEOUT_S to answer), asking again every SURVEY_POLL_S. Under
# erasure coding a survey also rebuilds a lost node's shards, or waits for the store that
# does (ftrun.store.ec_store.REBUILD_WAIT_S), hence the margin.
SURVEY_WAIT_S = 90.0
SURVEY_POLL_S = 0.05


def survey_key() -> str:
    """What names this restore on every rank of a node: the world it restores into (the
    rendezvous round's MASTER_ADDR:MASTER_PORT, the restart count, the world size)."""
    env = os.environ
    return (f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}/"
            f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/{env.get('WORLD_SIZE', '1')}")


class Restorer:
    """Restores one rank's state from the newest step the job holds complete."""

    def __init__(self, ctx: RankContext, state: TrainingState) -> None:
        self._ctx = ctx
        self._state = state
        # What this node's store knows: (newest committed step, newest durable step, whether
        # it replicates), -1 for none.
        self._store_steps: tuple[int, int, bool] = (-1, -1, False)

    def restore(self) -> tuple[int, str]:
        """Load the newest snapshot complete on every rank (collective); returns its step
        (0: none) and where it came from, and starts the new snapshot epoch."""
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        assert self._ctx.chan is not None
        try:
            self._ctx.chan.request("snap_flush", {"rank": self._ctx.rank}, "ack",
                                   STORE_TIMEOUT_S, attempts=6)
        except UnreachableError as e:
            log.warning("snapshot store did not answer (%s); using what memory holds", e)
        local = self._local_steps()
        held = self._job_holdings(local)
        found = shards.complete(held)
        by_key = {c.key: c for c in found}
        if held and not found and self._ctx.rank == 0:
            log.warning("no step is held in full by the job's live stores: %s",
                        shards.describe_gaps(held))
        restored, source = 0, "none"
        for key in self._agree_candidates(list(by_key), distributed):
            cand = by_key[key]
            tree, how, own = self._load_candidate(cand, local)
            if self._all(tree is not None, distributed):
                assert tree is not None
                self._state.apply(tree)
                if own is not None:  # its own buffer holds the step: the next save keeps it
                    self._ctx.newest = (own, cand.step)
                restored, source = cand.step, how
                break
            log.warning("step %d (%d ranks) could not be loaded on some rank; trying an older "
                        "one", cand.step, cand.world_size)
        if restored == 0:
            restored, source = self._restore_persisted(distributed)
            if restored and self._ctx.rank == 0:
                log.warning("no step is complete and verified in the job's memory (%s); "
                            "restored step %d from %s", "none held in full by the live "
                            "stores" if not by_key else "none loaded", restored, source)
            if restored == 0:
                self._refuse_lost_progress(held, bool(by_key), distributed)
        self._ctx.start_epoch(restored, distributed, source)
        return restored, source

    def _local_steps(self) -> dict[int, int]:
        """step -> buffer, for this rank's VERIFIED shards, as its node's store lists them
        (the store owns the segments: it says which are this rank's, and in what state)."""
        assert self._ctx.chan is not None
        try:
            reply = self._ctx.chan.request("catalog_request", {"rank": self._ctx.rank},
                                           "catalog_reply", STORE_TIMEOUT_S, attempts=3)
        except (UnreachableError, FtrunError) as e:
            log.warning("the snapshot store did not list this rank's snapshots (%s); memory "
                        "is not used for this restore", e)
            return {}
        body = reply.body
        self._store_steps = (int(body.get("committed", -1)), int(body.get("durable", -1)),
                             bool(body.get("replicating", False)))
        out: dict[int, int] = {}
        for rec in reply.body["records"]:
            buffer, name = int(rec["buffer"]), str(rec["segment"])
            if rec["rank"] != self._ctx.rank or buffer not in (0, 1):
                continue
            try:
                seg = shm.Segment.open(name)
            except FileNotFoundError:
                continue
            except (IntegrityError, OSError, ValueError) as e:
                log.warning("ignoring segment %s: %s", name, e)
                continue
            self._ctx.segments[buffer] = seg
            h = seg.header()
            if h.state == shm.VERIFIED:
                out[h.step] = buffer
            elif h.state in (shm.WRITING, shm.STAGED):
                log.warning("buffer %d holds step %d %s: torn or unverified, not loaded",
                            buffer, h.step, h.state_name)
        return out

    def _job_holdings(self, local: dict[int, int]) -> list[shards.Holding]:
        """Every verified shard the job's live stores hold (this node's included), as this
        node's store surveyed them for this restore (once for all its ranks:
        ftrun.store.survey); this rank's own buffers at least."""
        node = knobs.NODE_ID.get()
        held: list[shards.Holding] = []
        try:
            records, lost = self._survey()
            held = [shards.holding(r) for r in records]
        except (UnreachableError, FtrunError, KeyError, TypeError, ValueError) as e:
            log.warning("the snapshot store did not survey the job's stores (%s); only this "
                        "rank's own snapshots are used", e)
            lost = []
        if lost:
            log.warning("rank %d: the store(s) of %s did not answer; their shards are read "
                        "from replicas, where there are any", self._ctx.rank, ", ".join(lost))
        seen = {(h.node, h.segment) for h in held}
        for step, buffer in local.items():  # this rank's own, should its store not list them
            seg = self._ctx.segments[buffer]
            if seg is None or (node, seg.name) in seen:
                continue
            try:
                h = seg.header()
                world = int(parse_manifest(seg.manifest_bytes(h))["world_size"])
            except (FtrunError, KeyError, TypeError, ValueError):
                continue  # _load_memory refuses it with its reason
            held.append(shards.Holding(node, "", seg.name, node, self._ctx.rank, step, h.epoch,
                                       world, h.data_len, h.chunk_size))
        return held

    def _survey(self) -> tuple[list[dict[str, Any]], list[str]]:
        """Ask this node's store for the job's holdings (all pages), waiting while its survey
        runs; (records, stores that did not answer)."""
        assert self._ctx.chan is not None
        key = survey_key()
        deadline = time.monotonic() + SURVEY_WAIT_S
        records: list[dict[str, Any]] = []
        lost: list[str] = []
        offset: int | None = 0
        while offset is not None:
            reply = self._ctx.chan.request("survey_request", {"key": key, "offset": offset},
                                           "survey_reply", STORE_TIMEOUT_S, attempts=2)
            body = reply.body
            if not body["ready"]:
                if time.monotonic() > deadline:
                    raise UnreachableError(f"the store's survey of the job's stores took over "
                                           f"{SURVEY_WAIT_S:g} s")
                time.sleep(SURVEY_POLL_S)
                continue
            records += body.get("records") or []
            lost = list(body.get("lost") or [])
            offset = body.get("next")
        return records, lost

    def _agree_candidates(self, mine: list[tuple[int, str, int]],
                          distributed: bool) -> list[tuple[int, str, int]]:
        """The (step, epoch, world size) every rank found complete, newest first."""
        if not distributed:
            return sorted(mine, key=lambda k: (-k[0], k[1], k[2]))
        import torch.distributed as dist

        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        common = set(mine)
        for theirs in everyone:
            common &= set(theirs or [])
        return sorted(common, key=lambda k: (-k[0], k[1], k[2]))

    def _load_candidate(self, cand: shards.Candidate, local: dict[int, int]) -> tuple[
            dict[str, Any] | None, str, int | None]:
        """This rank's state from a step held in full across the job: (tree or None, where
        from, its own buffer when that is what was loaded). Its own buffer when it holds it;
        else the shard of the same rank from whichever node holds it; else, taken by another
        number of ranks, resharded from theirs."""
        from ftrun.rank import memload

        node = knobs.NODE_ID.get()
        buffer = local.get(cand.step)
        seg = self._ctx.segments[buffer] if buffer is not None else None
        if cand.world_size == self._ctx.world_size and seg is not None:
            try:
                own = seg.header().epoch == cand.epoch
            except IntegrityError:
                own = False
            if own:
                tree = self._load_memory(buffer, cand.step)  # type: ignore[arg-type]
                if tree is not None:
                    return tree, "memory", buffer
        ctx = self._ctx
        old_ranks = [ctx.rank] if cand.world_size == ctx.world_size else list(cand.holders)
        readers = {old: shards.ShardReader(cand.holders[old], node, ctx.secret, ctx.run_id,
                                           f"rank:{ctx.rank}") for old in old_ranks}
        try:
            if cand.world_size == self._ctx.world_size:
                tree = memload.load_whole(readers[self._ctx.rank])
                how = "memory"
            else:
                tree, nbytes = memload.reshard(readers, rank=self._ctx.rank,
                                               world_size=self._ctx.world_size,
                                               live_state=self._state.state_dicts)
                how = f"memory, resharded from {cand.world_size} ranks"
                log.info("rank %d: read %.1f MB of step %d's %d-rank snapshot to reshard it",
                         self._ctx.rank, nbytes / 1e6, cand.step, cand.world_size)
        except Exception as e:  # noqa: BLE001 - any failure: the ranks try an older step
            log.error("rank %d: step %d (%d ranks) held in memory could not be loaded: %s",
                      self._ctx.rank, cand.step, cand.world_size, e)
            return None, "", None
        finally:
            for r in readers.values():
                r.close()
        sources = sorted({n for r in readers.values() for n in r.sources})
        if sources and sources != [node]:
            how += f" (from node(s) {', '.join(sources)})"
        return tree, how, None

    def _all(self, ok: bool, distributed: bool) -> bool:
        if not distributed:
            return ok
        import torch.distributed as dist

        flags: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(flags, bool(ok))
        return all(flags)

    def _load_memory(self, buffer: int, step: int) -> dict[str, Any] | None:
        seg = self._ctx.segments[buffer]
        if seg is None:
            return None
        ok, reason = verify.check(seg, self._ctx.hasher)
        if not ok:
            log.error("rank %d: snapshot of step %d in buffer %d is not loadable (%s); it will "
                      "not be used", self._ctx.rank, step, buffer, reason)
            return None
        h = seg.header()
        doc = parse_manifest(seg.manifest_bytes(h))
        if doc["world_size"] != self._ctx.world_size or doc["step"] != step:
            return None
        data = seg.data(h)
        # The model's tensors are copied into its parameters and buffers by
        # set_model_state_dict: views into the buffer are enough (no clone of them, whose
        # fresh pages would cost more than the copy). Everything else is cloned: the optimizer
        # and Stateful objects keep what they are given, and must not alias the buffer.
        return unflatten(doc, lambda _i, entry: tensor_view(data, entry)
                         if entry.key.startswith(MODEL_KEY) else tensor_view(data, entry).clone())

    def _refuse_lost_progress(self, held: list[shards.Holding], any_complete: bool,
                              distributed: bool) -> None:
        """Nothing to resume from, after the job had committed steps: raise RestoreError (on
        every rank) when a step was promised to survive, rather than go on from step 0 and
        lose it. Promised: the newest durable step where stores replicate (a committed step
        newer than it can be lost with a host, and is, with a warning); the newest committed
        step where they do not. ``--start-fresh`` (FTRUN_START_FRESH=1) goes on from step 0."""
        steps = [self._store_steps]
        if distributed:
            import torch.distributed as dist

            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, self._store_steps)
            steps = everyone
        committed = max(int(c) for c, _, _ in steps)
        durable = max(int(d) for _, d, _ in steps)
        replicating = any(bool(r) for _, _, r in steps)
        if committed <= 0:
            return  # nothing was committed: step 0 is where the job is
        promised = durable if replicating else committed
        memory = ("no step held in full by the job's live stores ("
                  + (shards.describe_gaps(held) if held else "they hold no verified shard")
                  + ")") if not any_complete else \
            "the steps held in full could not be loaded and verified on every rank"
        persist = knobs.PERSIST_DIR.get()
        disk = (f"and nothing restorable in --persist-dir {persist}" if persist
                else "and no --persist-dir to fall back on")
        if promised <= 0 or knobs.START_FRESH.enabled():
            if self._ctx.rank == 0:
                why = (f"{knobs.START_FRESH.name} is set" if promised > 0 else
                       "no step was durable yet (every shard replicated on another host): "
                       "the lost host's shards of the committed steps had no copy")
                log.warning("the job had committed step %d, but this restore found %s, %s; "
                            "%s: training goes on from step 0 (%d committed steps lost)",
                            committed, memory, disk, why, committed)
            return
        from ftrun.errors import RestoreError
        from ftrun.rank.fallback import record_for_launcher

        kept = (f"durable step {durable} (replicated on another host)" if replicating
                else f"committed step {committed}")
        error = RestoreError(
            f"the job had {kept}, but this restore found {memory}, {disk}. Nothing was "
            f"loaded, so training does not go on from step 0 (that would lose {promised} "
            f"steps without a word). The hosts whose memory held the missing shards were lost "
            f"or are unreachable: bring them back, or relaunch with --persist-dir at a "
            f"directory holding a persisted step; to train from step 0 anyway, relaunch with "
            f"--start-fresh (or set {knobs.START_FRESH.name}=1).")
        record_for_launcher(error)
        raise error

    def _restore_persisted(self, distributed: bool) -> tuple[int, str]:
        """The newest persisted step that is complete and verifies on every rank (collective;
        ftrun.rank.fallback). Raises RestoreError when steps exist but none is usable."""
        root = knobs.PERSIST_DIR.get()
        if not root:
            return 0, "none"
        from ftrun.errors import RestoreError
        from ftrun.rank.fallback import gather_all, record_for_launcher, restore_from_disk

        try:
            found = restore_from_disk(root, rank=self._ctx.rank, world_size=self._ctx.world_size,
                                      gather=gather_all(distributed),
                                      live_state=self._state.state_dicts)
        except RestoreError as e:
            record_for_launcher(e)
            raise
        if found.step == 0:
            return 0, "none"
        self._state.apply(found.tree)
        return found.step, f"disk ({root})"
