"""What a rank's save and restore share: its identity, its channel to the node's store, its
two snapshot buffers, and the snapshot epoch (agreed across ranks, announced to the store)."""

from __future__ import annotations

import logging
import os
import uuid
from concurrent.futures import ThreadPoolExecutor

from ftrun import knobs, protocol
from ftrun.errors import UnreachableError
from ftrun.protocol.transport import Client
from ftrun.snapshot import segment as shm

log = logging.getLogger("ftrun.rank.snapshotter")

HASH_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))
STORE_TIMEOUT_S = 5.0
STORE_HINT = ("is this node's snapshot store running? (the launcher starts it and restarts it "
              "when it dies; see the launcher's log)")


class RankContext:
    """One rank's snapshot state shared by ``Saver`` and ``Restorer``."""

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.run_id = knobs.RUN_ID.get()
        self.secret = b""
        self.store_url = knobs.STORE.get()
        self.enabled = bool(self.store_url and self.run_id)
        # The rank creates and writes its own two buffers, named by the format
        # (ftrun.snapshot.segment.segment_name); the store's catalog names everything else.
        self.segments: list[shm.Segment | None] = [None, None]
        self.newest: tuple[int, int] | None = None  # (buffer, step) of the newest good snapshot
        self.epoch = ""
        self.epoch_base = 0  # the step the current epoch resumed from
        self.hasher = ThreadPoolExecutor(max_workers=HASH_THREADS,
                                         thread_name_prefix="ftrun-hash")
        self.committed = -1
        self.chan: Client | None = None
        self.owner = 0

    def connect(self) -> None:
        """Open the channel to this node's store (only when ``enabled``)."""
        secret = self.secret = knobs.SECRET.get().encode()
        self.chan = Client(self.store_url, secret, self.run_id, f"rank:{self.rank}",
                           peer="snapshot store", hint=STORE_HINT,
                           on_reply=self._on_store_message)
        self.owner = int(os.environ.get("FTRUN_LAUNCHER_PID", os.getppid()))

    def _on_store_message(self, msg: protocol.Message) -> None:
        if msg.kind == "snap_done":
            self.committed = max(self.committed, msg.body["committed"])
            if not msg.body["ok"]:
                log.error("the store could not verify step %d: %s", msg.body["step"],
                          msg.body.get("reason", "?"))

    def start_epoch(self, base_step: int, distributed: bool, source: str = "none") -> None:
        """Agree on a new epoch id and announce it; commits are counted per epoch."""
        assert self.chan is not None
        self.epoch = self._agree_epoch(distributed)
        self.epoch_base = base_step
        try:
            self.chan.request("snap_restored", {"rank": self.rank, "epoch": self.epoch,
                                                "step": base_step,
                                                "world_size": self.world_size,
                                                "source": source},
                              "ack", STORE_TIMEOUT_S, attempts=3)
        except UnreachableError as e:
            log.warning("could not tell the store about the new epoch: %s", e)
        self.committed = base_step

    def _agree_epoch(self, distributed: bool) -> str:
        epoch = [uuid.uuid4().hex[:16]]
        if distributed:
            import torch.distributed as dist

            dist.broadcast_object_list(epoch, src=0)
        return epoch[0]

    def close(self) -> None:
        for seg in self.segments:
            if seg is not None:
                seg.close()
        if self.chan is not None:
            self.chan.close()
