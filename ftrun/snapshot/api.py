"""The snapshot format's public types: a buffer's state, and when and where steps persist."""

from __future__ import annotations

from dataclasses import dataclass

from ftrun._enum import StrEnum
from ftrun.errors import ConfigError


class SegmentState(StrEnum):
    """A snapshot buffer's state, as the segment header holds it (by its code, see
    ftrun.snapshot.segment) and as the store's catalog, ``inspect`` and ``status`` name it."""

    EMPTY = "empty"  # never written
    WRITING = "writing"  # the rank is copying into it (found so at start-up: torn)
    STAGED = "staged"  # copy complete, manifest and chunk hashes written
    VERIFIED = "verified"  # the store checked the hash table and told the coordinator


@dataclass(frozen=True)
class PersistConfig:
    """When and where committed steps go to disk: the launcher's ``--persist-*`` options, the
    store's settings, and the coordinator's schedule of persist targets (one type for all)."""

    every: int = 0  # steps; 0: off
    interval_s: float = 0.0  # seconds since the last target; 0: off
    dir: str | None = None  # None: nothing persists (the coordinator never knows it)
    keep: int = 3  # complete steps kept on disk

    def __post_init__(self) -> None:
        if self.every < 0 or self.interval_s < 0 or self.keep < 1:
            raise ConfigError(
                f"--persist-every ({self.every}) and --persist-interval "
                f"({self.interval_s}) must be >= 0 and --persist-keep "
                f"({self.keep}) >= 1"
            )

    def due(self, step: int, last_step: int, since_last_s: float) -> str | None:
        """Why ``step`` is due (None: it is not); ``last_step`` is the previous target."""
        if self.every > 0 and step // self.every > max(last_step, 0) // self.every:
            return f"every {self.every} steps"
        if self.interval_s > 0 and since_last_s >= self.interval_s:
            return f"interval {self.interval_s:g} s"
        return None
