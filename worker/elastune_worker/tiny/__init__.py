"""Tiny, self-made models and tasks for tests and benchmarks (no hub downloads; docs/design.md §6)."""
