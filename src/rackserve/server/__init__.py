"""The OpenAI-compatible API server: ``rackserve serve`` (see docs/serving.md).

protocol.py      request models (pydantic)
responses.py     response shapes (plain dicts)
serving.py       tokenization, length checks, responses and SSE chunks
api.py           the FastAPI app (``build_app``): routes, errors, auth, limits
errors.py        ``ApiError`` (OpenAI's error envelope) and the status of each failure
async_client.py  the API process's client of the engine-core process
metrics.py       Prometheus metrics with vLLM's names under ``rackserve:``
cli.py           ``rackserve serve``
"""
