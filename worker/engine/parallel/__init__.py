"""Tensor parallelism: rank 0 (the engine's process) and the ranks it spawns (docs/tensor-parallel.md)."""
