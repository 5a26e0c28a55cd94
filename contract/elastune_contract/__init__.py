"""The shared contract of Elastune's control plane, data plane and gateway.

The API models (and the CRDs generated from them), the Redis bus protocol between control plane and
workers, the status vocabulary, and URL redaction. The operator, the worker and the gateway import
this package; it imports none of them (an import-linter contract in pyproject.toml).
"""
