"""Elastune control plane: API models, PromptTuner scheduling, simulator, operator (no torch here)."""

__version__ = "0.1.0"
