"""OpenAI's wire format as Elastune's HTTP services speak it (the worker's serving API and the gateway):
request bodies with readable validation, response shapes for the OpenAPI documents, and the error shape.

The FastAPI error handlers (``handlers.py``) import FastAPI, which only the services install.
"""
