"""The OpenAI-compatible API server: ``rackserve serve`` (see docs/serving.md).

protocol.py      request models (pydantic)
responses.py     response shapes (plain dicts) and their SSE framing
serving.py       tokenization, limits and length checks: a request ``Prepared``
responder.py     a prepared request run on the engine: the response or its SSE chunks
api.py           the FastAPI app (``build_app``): routes, errors, auth, limits
errors.py        ``ApiError`` (OpenAI's error envelope) and the status of each failure
async_client.py  the API process's client of the engine-core process
metrics.py       Prometheus metrics with vLLM's names under ``rackserve:``
cli.py           ``rackserve serve``: its flags and the command
options.py       its options: defaults, YAML config, the EngineConfig, preflight checks
"""
