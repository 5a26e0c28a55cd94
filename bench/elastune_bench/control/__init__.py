"""The real operator (kopf) against the Kubernetes API emulator: reconcile latency (``reconcile``)."""
