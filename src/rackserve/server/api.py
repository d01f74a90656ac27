"""The FastAPI app: OpenAI endpoints, SSE streaming, errors, auth, limits, disconnects.

``build_app`` wires one ``AsyncEngineClient`` (started and stopped by the app's lifespan)
into the routes; all state lives on the app, none in module globals. Request bodies are
read and validated here (not by FastAPI), so every failure, including a body over the size
limit and an unknown parameter, answers with OpenAI's error envelope and the right status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import jinja2
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import rackserve
from rackserve.server import serving
from rackserve.server.async_client import AsyncEngineClient, EngineDeadError
from rackserve.server.metrics import CONTENT_TYPE, ServerMetrics
from rackserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ParamError,
    TokenizeRequest,
    error_body,
)
from rackserve.server.serving import ApiError

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


@dataclass(frozen=True)
class ServerSettings:
    served_model_names: tuple[str, ...]
    model_path: str
    api_key: str | None = None
    max_request_body_bytes: int = 32 << 20
    health_timeout_s: float = 10.0
    auto_tool_parser: str | None = None  # --enable-auto-tool-choice --tool-call-parser NAME
    max_logprobs: int = 20
    log_requests: bool = False
    stats_log_interval_s: float | None = None  # None: no periodic stats line

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("served_model_names must name at least one model")
        if self.max_request_body_bytes < 1024:
            raise ValueError("--max-request-body-bytes must be at least 1024")


class FrontDoor:
    """ASGI middleware: X-Request-Id (honoured and echoed), API key, Content-Length limit.

    Pure ASGI rather than ``BaseHTTPMiddleware``, which would buffer streamed responses and
    hide client disconnects from the endpoints."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

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

        error = self._check(scope["path"], headers)
        if error is not None:
            await error.response()(scope, receive, send_with_id)
            return
        await self.app(scope, receive, send_with_id)

    def _check(self, path: str, headers: Headers) -> ApiError | None:
        if self.api_key is not None and path not in OPEN_PATHS:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(
                token.strip().encode(), self.api_key.encode()
            ):
                return ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return _too_large(self.max_body_bytes)
        return None


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"Request body is larger than the limit of {limit} bytes.")


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON, enforcing ``limit`` also for bodies sent without Content-Length."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    try:
        return msgspec.json.decode(b"".join(chunks))
    except msgspec.DecodeError as e:
        raise ApiError(400, f"Request body is not valid JSON: {e}") from None


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
        if error["type"] == "extra_forbidden":
            message = f"Unsupported parameter: '{param}' is not supported by this server."
        elif error["type"] == "missing":
            message = f"Missing required parameter: '{param}'."
        else:
            message = f"Invalid value for '{param}': {error['msg']}."
        raise ApiError(400, message, param=param) from None


async def until_disconnect(request: Request) -> None:
    """Returns when the client has gone (the body is already read, so only
    ``http.disconnect`` can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(
    client: AsyncEngineClient, tokenizer: Any, metrics: ServerMetrics, settings: ServerSettings
) -> FastAPI:
    """The API app; its lifespan starts the engine client and shuts it down."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await client.start()
        stats_task = None
        if settings.stats_log_interval_s is not None:
            stats_task = asyncio.create_task(_log_stats(metrics, settings.stats_log_interval_s))
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            await client.shutdown()

    app = FastAPI(title="rackserve", version=rackserve.__version__, lifespan=lifespan)
    app.add_middleware(
        FrontDoor, api_key=settings.api_key, max_body_bytes=settings.max_request_body_bytes
    )
    handler = serving.OpenAIServing(
        client,
        tokenizer,
        settings.served_model_names,
        auto_tool_parser=settings.auto_tool_parser,
        max_logprobs=settings.max_logprobs,
    )

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail)).response()

    async def parse(request: Request, model: type) -> Any:
        parsed = validate(model, await read_json(request, settings.max_request_body_bytes))
        ignored = parsed.ignored_fields()
        if ignored:  # accepted as vLLM does, but never silently
            logger.warning(
                "request %s: ignoring fields this server does not use: %s",
                request.state.request_id,
                ", ".join(ignored),
            )
        name = getattr(parsed, "model", None)
        if name is not None and name not in settings.served_model_names:
            raise ApiError(
                404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
            )
        try:
            check = getattr(parsed, "check_supported", None)
            if check is not None:
                check()
        except ParamError as e:
            raise ApiError(400, str(e), param=e.param) from None
        return parsed

    async def run(
        request: Request,
        body: Any,
        prepare: Callable[[Any, str], serving.Prepared],
    ) -> Response:
        if client.is_dead:
            raise ApiError(503, f"The engine is not running: {client.dead_reason}")
        try:
            prepared = prepare(body, request.state.request_id)
        except ParamError as e:
            raise ApiError(400, str(e), param=e.param) from None
        except jinja2.TemplateError as e:
            raise ApiError(400, f"Chat template error: {e}", param="messages") from None
        for _ in prepared.prompts:
            metrics.record_request_params(prepared.params.n, prepared.params.max_tokens)
        if settings.log_requests:
            logger.info(
                "Received request %s: prompt tokens %s, params: %s",
                prepared.response_id,
                [len(ids) for _, ids in prepared.prompts],
                prepared.params,
            )
        if body.stream:
            return StreamingResponse(
                _with_disconnect(request, prepared, handler.stream(prepared)),
                media_type="text/event-stream",
            )
        return JSONResponse(await _until_done(request, prepared, handler.collect(prepared)))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse(request, CompletionRequest)
        return await run(request, body, handler.prepare_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse(request, ChatCompletionRequest)
        return await run(request, body, handler.prepare_chat)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> JSONResponse:
        return JSONResponse(handler.models(settings.model_path, client.max_model_len))

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str) -> JSONResponse:
        for card in handler.models(settings.model_path, client.max_model_len)["data"]:
            if card["id"] == model_id:
                return JSONResponse(card)
        raise ApiError(
            404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found"
        )

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await parse(request, TokenizeRequest)
        try:
            return JSONResponse(handler.tokenize(body, client.max_model_len))
        except ParamError as e:
            raise ApiError(400, str(e), param=e.param) from None
        except jinja2.TemplateError as e:
            raise ApiError(400, f"Chat template error: {e}", param="messages") from None

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = await parse(request, DetokenizeRequest)
        try:
            return JSONResponse({"prompt": handler.detokenize(body.tokens)})
        except ParamError as e:
            raise ApiError(400, str(e), param=e.param) from None

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        try:
            await client.check_health(settings.health_timeout_s)
        except EngineDeadError as e:
            return ApiError(503, str(e)).response()
        return Response(status_code=200)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.api_route("/version", methods=["GET", "HEAD"])
    async def version() -> JSONResponse:
        return JSONResponse({"version": rackserve.__version__})

    @app.api_route("/ping", methods=["GET", "HEAD", "POST"])
    async def ping() -> Response:
        """SageMaker's health route, as vLLM serves it: /health's answer."""
        return await health()

    return app


async def _log_stats(metrics: ServerMetrics, interval_s: float) -> None:
    """vLLM's periodic stats line (``--disable-log-stats`` turns it off)."""
    while True:
        await asyncio.sleep(interval_s)
        line = metrics.stats_log.line()
        if line is not None:
            logger.info("Engine 000: %s", line)


async def _until_done(request: Request, prepared: serving.Prepared, work: Awaitable[dict]) -> dict:
    """Await a non-streaming result, aborting the engine requests if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # closes the generators, which abort their engine requests
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        raise ApiError(499, "Client disconnected.")
    error = task.exception()
    if error is not None:
        raise serving.as_api_error(error)
    return task.result()


async def _with_disconnect(
    request: Request, prepared: serving.Prepared, chunks: AsyncIterator[str]
) -> AsyncIterator[str]:
    """Forward SSE chunks; a disconnect aborts the engine requests (freeing their KV)."""

    async def watch() -> None:
        await until_disconnect(request)
        prepared.abort_all()

    watcher = asyncio.ensure_future(watch())
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as e:  # after the first byte the status is sent: report in-band
        error = serving.as_api_error(e)
        yield serving.sse(error_body(error.message, error.type, error.param, error.code))
        yield serving.SSE_DONE
    finally:
        watcher.cancel()
        prepared.abort_all()
