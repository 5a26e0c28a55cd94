"""Elastune's serving engine, in one package shaped like nano-vllm's ``engine/`` and vLLM v1's
``core``/``engine``/``worker``. A request goes api/ → frontend/ → llm_engine → model_runner/ and its
outputs come back the same way:

- ``core/``: pure and torch-free (an import-linter contract): the continuous-batching scheduler, the paged
  KV block manager with prefix caching, the sequences, the waiting-queue policies, and the vocabulary
  every other part shares (settings: ``config``, ``scheduler_config``; a request's ``sampling``
  parameters, its ``adapter_ref``; what it gets back: ``outputs``). The benchmarks' simulators step the
  same objects without torch;
- ``llm_engine``: ``LLMEngine`` (``add_request`` / ``step`` / ``abort``) around the scheduler and the
  model runner, with the ``detokenizer`` its stop strings need and the start-up cost ``profile``;
- ``hooks``: the ``StepHook`` through which other work rides the engine's iterations (co-serving,
  ``elastune_worker.coserve``, which the engine never imports);
- ``model_runner/``: what runs the model (torch): the runner, the sampler, paged attention, the models,
  multi-LoRA, soft prompts, kernels, and which CPUs the runner's threads take;
- ``frontend/``: the engine loop on its own thread or process, the typed messages across that boundary,
  the per-request streams, and the concrete ``EngineClient``;
- ``client``: the one ``EngineClient`` protocol the HTTP API, the front end and the worker's server share;
- ``api/``: the OpenAI-compatible HTTP API (FastAPI), which knows the engine only through ``client``;
- ``server``: the standalone server (``python -m elastune_worker.engine``), which wires them together.

Importing this package imports no torch (the simulators import ``core`` through it).
"""
