"""The continuous-batching core of Elastune's serving engine, pure (no torch, no I/O): the scheduler
(chunked prefill, preemption by recompute, the three batching modes), the paged KV block manager with
prefix caching, the sequences it schedules, the waiting-queue policies, and the request vocabulary they
carry (sampling parameters, adapter references).

The worker's engine (``elastune_worker.serving.core.engine``) steps it around the model runner; the
gateway's routing simulator (``elastune_gateway.sim``) steps the same objects around a cost model, so
the simulated endpoints schedule exactly as the engine does. It imports nothing of the project's other
packages (an import-linter contract in pyproject.toml).
"""
