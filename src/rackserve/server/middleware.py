"""The API's front door: checks every request passes before a route sees it.

``FrontDoor`` (pure ASGI middleware) sets X-Request-Id and refuses a disallowed Origin, a
POST that is not ``application/json``, a missing or wrong API key and a declared body over
the limit. ``read_json`` enforces the limit on the bytes actually sent and the JSON depth;
``validate`` turns a pydantic error into a 400 naming the parameter. Every refusal is an
``ApiError``, so it answers with OpenAI's error envelope.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

import msgspec
from fastapi import Request
from pydantic import ValidationError
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rackserve.server.errors import ApiError

OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping", "/server_info"})
# Deeper JSON is refused before validation: recursive decoders and validators would
# otherwise fail with RecursionError (OpenAI request bodies nest a few levels; tool and
# response-format schemas a few dozen).
MAX_JSON_DEPTH = 64
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


class FrontDoor:
    """ASGI middleware: X-Request-Id (honoured and echoed), Origin, API key, Content-Type
    and Content-Length checks.

    Pure ASGI rather than ``BaseHTTPMiddleware``, which would buffer streamed responses and
    hide client disconnects from the endpoints."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body_bytes: int,
        allowed_origins: tuple[str, ...] = (),
        on_reject: Callable[[ApiError], None] | None = None,
    ) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        self.allowed_origins = frozenset(allowed_origins)
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        request_id = headers.get("x-request-id") or secrets.token_hex(16)
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
            await send(message)

        error = self._check_browser(scope["method"], headers) or self._check(
            scope["path"], headers, scope["method"]
        )
        if error is not None:
            if self.on_reject is not None:
                self.on_reject(error)
            await error.response()(scope, receive, send_with_id)
            return
        await self.app(scope, receive, send_with_id)

    def _check_browser(self, method: str, headers: Headers) -> ApiError | None:
        """Requests a web page could make from a visitor's browser: an Origin that is not
        allowed is refused outright (a CORS preflight of an allowed one passes on to the
        CORS middleware), and a POST must be ``application/json``, which a page cannot
        send cross-origin without a preflight."""
        origin = headers.get("origin")
        if origin is not None and not ({origin, "*"} & self.allowed_origins):
            return ApiError(403, f"Origin {origin!r} is not allowed.", code="origin_not_allowed")
        if method == "POST":
            media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
            if media_type != "application/json":
                return ApiError(
                    415,
                    "Content-Type must be application/json.",
                    code="unsupported_media_type",
                )
        return None

    def _check(self, path: str, headers: Headers, method: str = "GET") -> ApiError | None:
        # A CORS preflight carries no credentials; the CORS middleware answers it.
        preflight = method == "OPTIONS" and "origin" in headers
        if self.api_key is not None and path not in OPEN_PATHS and not preflight:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(
                token.strip().encode(), self.api_key.encode()
            ):
                return ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return too_large(self.max_body_bytes)
        return None


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"Request body is larger than the limit of {limit} bytes.")


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON, enforcing ``limit`` also for bodies sent without Content-Length."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    body = b"".join(chunks)
    try:
        parsed = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise ApiError(400, f"Request body is not valid JSON: {e}") from None
    except RecursionError:
        parsed = None  # nested deeper than msgspec goes: answered just below
    # Depth needs at least that many brackets: most bodies skip the walk.
    if parsed is None or body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH:
        check_depth(parsed, body)
    return parsed


def check_depth(value: Any, body: bytes) -> None:
    """ApiError 400 when JSON nests deeper than MAX_JSON_DEPTH (iterative: no recursion)."""
    too_deep = value is None and body.lstrip()[:1] in (b"[", b"{")
    stack = [(value, 1)]
    while stack and not too_deep:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > MAX_JSON_DEPTH:
                too_deep = True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    if too_deep:
        raise ApiError(400, f"Request body nests JSON deeper than {MAX_JSON_DEPTH} levels.")


def validate(model: type, body: Any) -> Any:
    """Parse a request model; the first problem becomes a 400 naming the parameter."""
    if not isinstance(body, dict):
        raise ApiError(400, "Request body must be a JSON object.")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        error = e.errors()[0]
        parts = [
            str(p)
            for p in error["loc"]
            if isinstance(p, int) or (p.isidentifier() and p.lower() not in _TYPE_NAMES)
        ]
        param = ".".join(parts) or None
        if error["type"] == "missing":
            message = f"Missing required parameter: '{param}'."
        else:
            message = f"Invalid value for '{param}': {error['msg']}."
        raise ApiError(400, message, param=param) from None
