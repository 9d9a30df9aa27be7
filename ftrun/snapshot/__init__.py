"""In-memory snapshots: shared-memory segments, the rank-side client, the node's store."""
