"""The plumbing every Elastune process shares, beside the contract: the Redis client of the bus protocol
(``bus``), launchers of real Redis/Memcached servers for local mode, benchmarks and tests (``servers``),
the ASGI response-status hook of both HTTP servers (``asgi``) and URL redaction for logs (``redact``).

It imports the contract and third-party libraries only, never a product package (an import-linter
contract holds that); the contract itself stays models, key layout and vocabulary.
"""
