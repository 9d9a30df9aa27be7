"""The snapshot format's public types: a buffer's state, and when and where steps persist."""

from __future__ import annotations

from ftrun._enum import StrEnum


class SegmentState(StrEnum):
    """A snapshot buffer's state, as the segment header holds it (by its code, see
    ftrun.snapshot.segment) and as the store's catalog, ``inspect`` and ``status`` name it."""

    EMPTY = "empty"  # never written
    WRITING = "writing"  # the rank is copying into it (found so at start-up: torn)
    STAGED = "staged"  # copy complete, manifest and chunk hashes written
    VERIFIED = "verified"  # the store checked the hash table and told the coordinator
