"""ftrun: a fault-tolerant drop-in for torchrun.

What a training script uses is re-exported here. Heavy modules (torch) load on first use, so
``import ftrun`` stays cheap for the launcher's helper processes.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["RankAborted", "ResumableDistributedSampler", "Snapshotter", "monitor_collectives",
           "progress", "resilient", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "progress":
        from ftrun.rank.progress import progress

        return progress
    if name == "Snapshotter":
        from ftrun.rank.snapshotter import Snapshotter

        return Snapshotter
    if name == "monitor_collectives":
        from ftrun.rank.collectives import monitor_collectives

        return monitor_collectives
    if name in ("resilient", "RankAborted"):
        from ftrun.rank import resilient as module

        return getattr(module, name)
    if name == "ResumableDistributedSampler":
        from ftrun.rank.data import ResumableDistributedSampler

        return ResumableDistributedSampler
    raise AttributeError(f"module 'ftrun' has no attribute {name!r}")
