"""The library that runs inside the ranks: ``Snapshotter`` (ftrun.rank.snapshotter), which hands
each step's state to the node's store, ``progress()`` (ftrun.rank.progress), which tells the
launcher that a rank is still moving, and ``ResumableDistributedSampler`` (ftrun.rank.data),
a data position that carries over to another world size.

Nothing here runs in the launcher or the store; they import the shared formats
(ftrun.snapshot.segment, ftrun.snapshot.manifest) and the wire protocol, never this package.
"""
