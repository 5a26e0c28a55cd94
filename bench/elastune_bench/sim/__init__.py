"""The simulators, beside the benchmarks that run them: ``scheduling/`` (the operator's schedulers on
simulated GPU pools: `elastune simulate`, `elastune calibrate`, `elastune bench scheduler`) and ``routing/``
(the gateway's routing policies over simulated endpoints stepping the engine's real batching core:
``python -m elastune_bench.sim.routing``, `elastune bench route`). They drive the product's pure policy
modules; no product package imports them."""
