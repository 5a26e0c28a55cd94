"""Serving on a warm worker: the engine and its OpenAI-compatible API, in the shape of nano-vllm.

A request goes api/ → frontend/ → core/ → runner/ and its outputs come back the same way:

- ``core/``: the engine (``add_request`` / ``step`` / ``abort``) and its pure policies — scheduler,
  paged KV block manager, sequences, waiting-queue orders — plus the detokenizer its stop strings need
  and the start-up cost profile it measures;
- ``runner/``: what runs the model (torch): the model runner, the sampler, paged attention, the models,
  multi-LoRA and soft prompts, and which CPUs the runner's threads take;
- ``frontend/``: the engine loop on its own thread or process, the typed messages across that boundary,
  the per-request streams and the ``EngineClient`` the API calls;
- ``api/``: the HTTP API (FastAPI), which knows the engine only through ``EngineClient``;
- ``coserve/``: a tuning job co-served in the engine's iterations (FlexLLM): planner, job, task.

Here at the top stay the types every folder shares — ``config`` (the engine's settings), ``sampling``
(a request's sampling parameters), ``outputs`` (what a request gets back), ``adapter_ref`` (the typed
reference of the LoRA or soft prompt a request is served with, resolved once at the API) — as vLLM
keeps its config, sampling params and outputs at its top, so a folder never imports a sibling for its
vocabulary; and the
standalone server, ``server`` (``python -m elastune_worker.serving``), which wires all of them together.
"""
