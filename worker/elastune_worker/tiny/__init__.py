"""Tiny, self-made models and tasks for tests and benchmarks (no hub downloads; DESIGN.md §6)."""
