"""Serving on a warm worker: the engine and its OpenAI-compatible API, in the shape of nano-vllm.

A request goes api/ → frontend/ → core/ → runner/ and its outputs come back the same way:

- ``core/``: the engine (``add_request`` / ``step`` / ``abort``), which steps the pure continuous-batching
  core of the top-level ``elastune_batching`` package (scheduler, paged KV block manager, sequences,
  waiting-queue orders; the gateway's simulator steps the same objects), plus the detokenizer its stop
  strings need and the start-up cost profile it measures;
- ``runner/``: what runs the model (torch): the model runner, the sampler, paged attention, the models,
  multi-LoRA and soft prompts, and which CPUs the runner's threads take;
- ``frontend/``: the engine loop on its own thread or process, the typed messages across that boundary,
  the per-request streams and the ``EngineClient`` the API calls;
- ``api/``: the HTTP API (FastAPI), which knows the engine only through ``EngineClient``;
- ``coserve/``: a tuning job co-served in the engine's iterations (FlexLLM): planner, job, task.

Here at the top stay the types every folder shares — ``config`` (the engine's settings), ``outputs``
(what a request gets back) — as vLLM keeps its config and outputs at its top, so a folder never imports
a sibling for its vocabulary; a request's sampling parameters and the typed reference of its adapter
(resolved once at the API) are ``elastune_batching.sampling`` and ``elastune_batching.adapter_ref``,
since its sequence carries them. And the standalone server, ``server``
(``python -m elastune_worker.serving``), which wires all of them together.
"""
