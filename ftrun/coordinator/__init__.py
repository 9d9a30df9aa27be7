"""The control plane: one coordinator per job, and the clients that talk to it."""
