"""The node's snapshot store process: catalog, commit bookkeeping, persist writer, replicas, shard service."""
