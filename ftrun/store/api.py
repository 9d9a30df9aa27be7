"""The store's public types: its configuration (what the launcher starts it with) and states."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ftrun._enum import StrEnum
from ftrun.snapshot.api import PersistConfig


@dataclass(frozen=True)
class StoreConfig:
    run_id: str
    url: str  # ipc:// endpoint the ranks connect to
    coordinator: str | None
    node_id: str
    owner_pid: int
    persist: PersistConfig = PersistConfig()
    threads: int = 0  # hashing threads (0: default_threads())
    # Replicas on peer nodes (ftrun.store.replica): m copies of every shard (1: off), the
    # interface the receiver listens on, and the sender's cap in MB/s (0: none).
    replicas: int = 1
    replica_host: str = "127.0.0.1"
    replica_rate_mb_s: float = 0.0
    # Erasure coding instead (--redundancy ec:K+M; 0: off): K data nodes and M parity
    # fragments per stripe (ftrun.store.ec_store).
    ec_k: int = 0
    ec_m: int = 0
    # The coordinator's term (--rdzv-backend etcd; 0: none): its messages are bound to it.
    # A failover moves the store to another coordinator (``coordinator_moved``).
    coordinator_term: int = 0

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> StoreConfig:
        """The config from ``dataclasses.asdict`` of one, as the launcher passes it (JSON)."""
        return cls(**{**doc, "persist": PersistConfig(**doc.get("persist", {}))})


class ClaimAnswer(StrEnum):
    """Which buffer a rank may overwrite with its next snapshot (the store's answer to a claim)."""

    OLDER = "older"  # its newest shard's step committed: overwrite the older buffer
    NEWEST = "newest"  # its newest shard's step is dead: overwrite that one; the older buffer
    # keeps the last committed step
