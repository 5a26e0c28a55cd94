"""Worker-side benchmarks that print measured figures (``python -m elastune_worker.bench.sync``)."""
