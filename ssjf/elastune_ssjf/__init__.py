"""SSJF (speculative shortest-job-first, "Efficient Interactive LLM Serving with Proxy Model-based
Sequence Length Prediction"): the output-length predictor that the gateway asks for a request's expected
length, which the engine's ``sjf`` queue policy orders by.

- ``predictor.py``: the proxy model (frozen all-MiniLM-L6-v2 + regression head), ``LengthPredictor``
- ``build.py``: train it offline on ShareGPT and cache it (``python -m elastune_ssjf.build``)
- ``service.py``: the HTTP service the torch-free gateway calls (``python -m elastune_ssjf``)
"""
