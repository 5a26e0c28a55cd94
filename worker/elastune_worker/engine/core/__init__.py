"""The engine's pure core (no torch, no I/O; an import-linter contract keeps it so): the
continuous-batching scheduler (chunked prefill, preemption by recompute, the three batching modes), the
paged KV block manager with prefix caching, the sequences it schedules, the waiting-queue policies, and
the types the rest of the engine shares (settings, sampling parameters, adapter references, request
outputs). ``LLMEngine`` steps it around the model runner; the benchmarks' routing simulator
(``elastune_bench.sim.routing``) steps the same objects around a cost model, so simulated endpoints
schedule exactly as the engine does."""
