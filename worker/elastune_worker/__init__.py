"""Elastune data plane (torch): prompt-tuning workers. Filled in by the worker runtime (issue 3)."""
