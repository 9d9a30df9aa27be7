"""What runs inside the ranks: progress reports (and, later, the snapshot client)."""
