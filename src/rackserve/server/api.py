"""The FastAPI app: OpenAI endpoints, SSE streaming, errors, auth, limits, disconnects.

``build_app`` wires one ``AsyncEngineClient`` (started and stopped by the app's lifespan)
into the routes; all state lives on the app, none in module globals. Request bodies are
read and validated here (not by FastAPI; the checks are in ``middleware.py``), so every
failure, including a body over the size limit, answers with OpenAI's error envelope and the
right status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import rackserve
from rackserve.server import serving
from rackserve.server.async_client import AsyncEngineClient, EngineDeadError
from rackserve.server.errors import ApiError, as_api_error
from rackserve.server.limits import RequestLimits
from rackserve.server.metrics import CONTENT_TYPE, ServerMetrics
from rackserve.server.middleware import FrontDoor, read_json, validate
from rackserve.server.openapi import install_request_schemas
from rackserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ParamError,
    TokenizeRequest,
)
from rackserve.server.responder import Responder
from rackserve.server.responses import SSE_DONE, error_body, sse
from rackserve.server.tokenization import TokenizerPool

logger = logging.getLogger(__name__)

# request_rejected{reason} for errors that carry no code of their own
REJECTION_REASONS = {
    400: "invalid_request", 401: "invalid_api_key", 403: "forbidden", 404: "not_found",
    405: "method_not_allowed", 413: "body_too_large", 415: "unsupported_media_type",
}  # fmt: skip


@dataclass(frozen=True)
class ServerSettings:
    served_model_names: tuple[str, ...]
    model_path: str
    api_key: str | None = None
    max_request_body_bytes: int = 32 << 20
    health_timeout_s: float = 10.0
    # Browser origins allowed to call the API (CORS); none by default, so a web page cannot
    # drive generations from a visitor's browser. "*" allows every origin.
    allowed_origins: tuple[str, ...] = ()
    limits: RequestLimits = field(default_factory=RequestLimits)
    auto_tool_parser: str | None = None  # --enable-auto-tool-choice --tool-call-parser NAME
    max_logprobs: int = 20
    log_requests: bool = False
    stats_log_interval_s: float | None = None  # None: no periodic stats line

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("served_model_names must name at least one model")
        if self.max_request_body_bytes < 1024:
            raise ValueError("--max-request-body-bytes must be at least 1024")


def param_error(error: ParamError) -> ApiError:
    return ApiError(400, str(error), param=error.param, code=error.code)


DATA_PARALLEL_RANK_HEADER = "X-data-parallel-rank"


def data_parallel_rank(request: Request, data_parallel_size: int) -> int | None:
    """The DP rank the ``X-data-parallel-rank`` header pins the request to (vLLM's header;
    ``bench replay`` sends it), None without the header; 400 for a bad value."""
    value = request.headers.get(DATA_PARALLEL_RANK_HEADER)
    if value is None:
        return None
    try:
        rank = int(value.strip())
    except ValueError:
        rank = None
    if rank is None or not 0 <= rank < data_parallel_size:
        raise ApiError(
            400,
            f"Invalid {DATA_PARALLEL_RANK_HEADER} header {value!r}: "
            f"a data-parallel rank in [0, {data_parallel_size})",
            param=DATA_PARALLEL_RANK_HEADER,
        )
    return rank


async def until_disconnect(request: Request) -> None:
    """Returns when the client has gone (the body is already read, so only
    ``http.disconnect`` can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(
    client: AsyncEngineClient, tokenizer: Any, metrics: ServerMetrics, settings: ServerSettings
) -> FastAPI:
    """The API app; its lifespan starts the engine client and shuts it down."""

    pool = TokenizerPool()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if client.ready is None:  # `serve` starts it first, to report failures in one line
            await client.start()
        stats_task = None
        if settings.stats_log_interval_s is not None:
            stats_task = asyncio.create_task(_log_stats(metrics, settings.stats_log_interval_s))
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            pool.shutdown()
            await client.shutdown()

    app = FastAPI(title="rackserve", version=rackserve.__version__, lifespan=lifespan)

    def count_rejection(error: ApiError) -> None:
        if 400 <= error.status < 500 and error.status != 499:
            metrics.record_rejected(error.code or REJECTION_REASONS.get(error.status, "invalid"))

    if settings.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
        )
    app.add_middleware(
        FrontDoor,
        api_key=settings.api_key,
        max_body_bytes=settings.max_request_body_bytes,
        allowed_origins=settings.allowed_origins,
        on_reject=count_rejection,
    )
    handler = serving.OpenAIServing(
        client,
        tokenizer,
        settings.served_model_names,
        settings.limits,
        auto_tool_parser=settings.auto_tool_parser,
        max_logprobs=settings.max_logprobs,
    )
    responder = Responder(client, tokenizer)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        count_rejection(exc)
        return exc.response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        # Never a plain-text 500, and never internal text (a traceback line) to clients.
        logger.error("unhandled error in %s", request.url.path, exc_info=exc)
        return ApiError(500, "Internal server error.").response()

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
            raise param_error(e) from None
        return parsed

    async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the tokenizer pool; bad input becomes a 400."""
        try:
            return await pool.run(fn, *args)
        except ParamError as e:
            raise param_error(e) from None
        except jinja2.TemplateError as e:
            raise ApiError(400, f"Chat template error: {e}", param="messages") from None

    async def run(
        request: Request,
        body: Any,
        prepare: Callable[[Any, str], serving.Prepared],
    ) -> Response:
        if client.is_dead:
            raise ApiError(503, "The engine is not running.")
        rank = data_parallel_rank(request, client.data_parallel_size)
        # Off the event loop: a long prompt or template must not stall other clients.
        prepared = await off_loop(prepare, body, request.state.request_id)
        prepared.data_parallel_rank = rank
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
                _with_disconnect(request, prepared, responder.stream(prepared)),
                media_type="text/event-stream",
            )
        return JSONResponse(await _until_done(request, prepared, responder.collect(prepared)))

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
        return JSONResponse(await off_loop(handler.tokenize, body, client.max_model_len))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = await parse(request, DetokenizeRequest)
        try:
            return JSONResponse({"prompt": handler.detokenize(body.tokens)})
        except ParamError as e:
            raise param_error(e) from None

    install_request_schemas(
        app,
        {
            "/v1/completions": CompletionRequest,
            "/v1/chat/completions": ChatCompletionRequest,
            "/tokenize": TokenizeRequest,
            "/detokenize": DetokenizeRequest,
        },
    )

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

    @app.api_route("/server_info", methods=["GET", "HEAD"])
    async def server_info() -> JSONResponse:
        """What a router needs to know: ``X-data-parallel-rank`` takes 0 .. size - 1."""
        return JSONResponse({"data_parallel_size": client.data_parallel_size})

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
        raise as_api_error(error)
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
        error = as_api_error(e)
        yield sse(error_body(error.message, error.type, error.param, error.code))
        yield SSE_DONE
    finally:
        watcher.cancel()
        prepared.abort_all()
