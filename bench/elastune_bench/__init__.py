"""Every benchmark of the project, by subject, under one command (``elastune bench ...``, ``cli.py``).

Above the product: it imports the product packages and the test support (the operator benchmark runs
on the Kubernetes API emulator); no product package imports it (import-linter contracts). The product
CLI finds it through the ``elastune.commands`` entry point, so an install without it says so.

- ``scheduling``: the three schedulers and co-serving in the operator's simulator
- ``control``: the real operator reconciling against the API emulator
- ``serving``: the worker's engine (vs vLLM), multi-LoRA, co-serving, SSJF ordering
- ``tuning``: gradient sync between workers, the Prompt Bank
- ``routing``: the gateway's routing policies, its overhead, tenant isolation
- ``faults``: faults injected into a local stack
- ``device``: the prepared GPU check (``tools/device_check.sh``)
- ``processes`` (real worker and gateway processes) and ``stats`` (percentiles, the machine's load):
  shared by the benchmarks, and the former by the tests
"""
