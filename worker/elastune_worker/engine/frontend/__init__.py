"""The engine's front end: the engine loop (engine_loop) run on a thread (async_engine) or in its own
process (engine_process), the typed messages across that boundary (messages), each request's stream on
the caller's side (streams), and the engine as the API's ``EngineClient`` (serving_client)."""
