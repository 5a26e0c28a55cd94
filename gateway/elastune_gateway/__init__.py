"""The gateway: the request path of Elastune's serving (docs/design.md §1). No GPU, no torch.

``routing/`` holds the routing policies (pure: one interface, a factory, one module per paper);
``sim/`` a trace-driven simulator that drives the same policy objects at scale. The HTTP front (the
OpenAI-compatible API, the waiting room while a pool scales from zero, endpoint state from the registry
and the workers' metrics) comes with the rest of issue 12.
"""
