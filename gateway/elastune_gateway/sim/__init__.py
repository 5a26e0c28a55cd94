"""The gateway's trace-driven routing simulator: the policy objects of ``elastune_gateway.routing`` over
simulated continuous-batching endpoints (``engine.py``) with prefix caches (``prefix_cache.py``) and
adapter tiers, on Preble-style, multi-turn and CaraServe-style workloads (``workloads.py``).
Run it with ``python -m elastune_gateway.sim``.
"""
