"""Request-body schemas in /openapi.json.

The routes read and validate their bodies themselves (so every failure answers with
OpenAI's error envelope), which hides the pydantic models from FastAPI's generated schema.
This puts them back, so clients and the fuzzer in tests/reliability can generate requests
from /openapi.json.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF_TEMPLATE = "#/components/schemas/{model}"


def install_request_schemas(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Make ``app.openapi()`` describe the JSON body of each ``POST path`` in ``bodies``."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            body_schema = model.model_json_schema(ref_template=REF_TEMPLATE)
            components.update(body_schema.pop("$defs", {}))
            components[model.__name__] = body_schema
            operation = schema["paths"][path]["post"]
            operation["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {"$ref": REF_TEMPLATE.format(model=model.__name__)}
                    }
                },
            }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
