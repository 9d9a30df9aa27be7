"""The exit barrier (a mixin of :class:`ftrun.launcher.agent.FtrunAgent`): a node that
finished waits for the others of its round, but not for one the coordinator declared lost."""

from __future__ import annotations

import logging
import time

from ftrun import _torch

log = logging.getLogger("ftrun.launcher.agent")

# The exit barrier's keys, in the round's own store (every node of a job runs ftrun's).
EXIT_KEY = "ftrun/exit"
# How often a node in the exit barrier looks whether the others finished or are lost.
EXIT_POLL_S = 0.5


class ExitBarrier:
    """torch's exit barrier, replaced: a mixin over the agent's state."""

    def exit_barrier(self) -> None:
        """torch's exit barrier (each node waits, up to its exit-barrier timeout, until
        every node of the round has finished, so that the rendezvous store outlives them),
        except that a node the coordinator declared lost and a survivor took out of the
        rendezvous (:meth:`drop_lost_node`) is not waited for: a host that dies after its
        workers finished kept the others idle for the whole timeout (300 s by default).
        The wait looks every :data:`EXIT_POLL_S` instead of one blocking ``wait`` on the
        store client that the keep-alives and the drop share (they would queue behind it)."""
        store, world = self.rendezvous_store(), self.get_worker_group().group_world_size
        me = _torch.rendezvous_node(self.get_worker_group().spec.rdzv_handler) or "?"
        members = self._round[1] if self._round is not None else frozenset()
        timeout_s = self.exit_barrier_timeout()
        log.info("workers finished; waiting up to %.0f s for the other nodes of the round to "
                 "finish (not for a node declared lost)", timeout_s)
        self.mark_exit_barrier(True)
        started = time.monotonic()
        try:
            store.set(f"{EXIT_KEY}/done/{me}", "1")
            if store.add(f"{EXIT_KEY}/count", 1) >= world:
                store.set(f"{EXIT_KEY}/all", "1")
            while not store.check([f"{EXIT_KEY}/all"]):
                # A lost node that finished before it was lost is counted already.
                lost = sorted(n for n in members & self._lost_nodes
                              if not store.check([f"{EXIT_KEY}/done/{n}"]))
                finished = int(store.get(f"{EXIT_KEY}/count")) if lost else 0
                if lost and finished + len(lost) >= world:
                    log.warning("every node of the round finished but %s, which the "
                                "coordinator declared lost: not waiting for it",
                                ", ".join(lost))
                    self._ctx.sink.event("exit_barrier_left", lost=lost, finished=finished,
                                         nodes=world)
                    return
                if time.monotonic() - started >= timeout_s:
                    finished = int(store.get(f"{EXIT_KEY}/count"))
                    log.warning("exit barrier: %d of %d nodes finished within %.0f s "
                                "(torch's exit-barrier timeout); exiting without the others",
                                finished, world, timeout_s)
                    return
                time.sleep(EXIT_POLL_S)
            log.info("every node finished (%.1f s in the exit barrier)",
                     time.monotonic() - started)
        except (RuntimeError, OSError) as e:  # the store's host is gone: nothing to keep
            log.warning("exit barrier: the rendezvous store failed (%s: %s); exiting",
                        type(e).__name__, e)
        finally:
            self.mark_exit_barrier(False)
