"""The gateway's trace-driven routing simulator: the policy objects of ``elastune_gateway.routing`` over
simulated endpoints (``engine.py``: the engine's own scheduler and KV block manager from
``elastune_worker.engine.core``, prefix caching included, stepped by a cost model) with adapter tiers, on
Preble-style, multi-turn and CaraServe-style workloads (``workloads.py``).
Run it with ``python -m elastune_bench.sim.routing``.
"""
