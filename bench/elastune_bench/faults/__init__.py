"""Faults injected into a local stack, held or lost (``chaos``)."""
