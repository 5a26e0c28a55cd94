"""The gateway's HTTP service: an OpenAI-compatible proxy in front of the warm worker pods.

``settings`` (typed settings), ``prompt_key`` (what prefix routing matches on), ``directory`` (the
endpoints of each model from the Redis registry), ``ledger`` (requests in flight per endpoint),
``views`` (EndpointView from both, for the routing policies), ``length_predictor`` (SSJF's client),
``forward`` (one request to one worker, streamed or whole), ``app`` (the FastAPI routes, waiting room,
metrics) and ``__main__`` (``elastune gateway``).
"""
