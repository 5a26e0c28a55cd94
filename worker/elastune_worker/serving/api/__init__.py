"""The worker's OpenAI-compatible HTTP API (FastAPI) over an ``EngineClient`` (see api/client.py)."""
