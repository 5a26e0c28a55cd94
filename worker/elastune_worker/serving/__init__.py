"""Serving on a warm worker: the engine and its OpenAI-compatible API."""
