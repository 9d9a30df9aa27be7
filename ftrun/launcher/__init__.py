"""The node launcher: torchrun's elastic agent, extended."""
