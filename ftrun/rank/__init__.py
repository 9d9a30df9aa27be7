"""The library that runs inside the ranks: ``Snapshotter`` (ftrun.rank.snapshotter), which hands
each step's state to the node's store, and ``progress()`` (ftrun.rank.progress), which tells the
launcher that a rank is still moving.

Nothing here runs in the launcher or the store; they import the shared formats
(ftrun.snapshot.segment, ftrun.snapshot.manifest) and the wire protocol, never this package.
"""
