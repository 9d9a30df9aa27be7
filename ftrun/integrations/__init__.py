"""Snapshots for scripts written with a training framework (Lightning, Hugging Face Trainer,
Accelerate, torchtitan). Each module imports its framework only when used: ftrun itself depends
on none of them."""
