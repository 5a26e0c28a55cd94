"""The worker's OpenAI-compatible HTTP API (FastAPI) over an ``EngineClient`` (engine/client.py)."""
