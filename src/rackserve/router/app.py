"""`rackserve router`: an OpenAI-compatible proxy over engines (aiohttp).

Plain mode (``--engines``): each request goes to one aggregated engine picked by the policy.
P/D mode (``--prefill`` + ``--decode``), the two steps of vLLM's disaggregated proxy::

    client --> router --(max_tokens 1, kv_transfer_params {do_remote_decode})--> prefill
                      <--(response with kv_transfer_params {do_remote_prefill, where})--
               router --(the request + those kv_transfer_params, streamed)--> decode
    client <-- the decode side's response, streamed through (X-KV-Source says where the
               prompt's KV came from)

Step 1 is router/prefill_step.py's.

A streamed request that ``first_token.eligible`` accepts (one prompt, n = 1, no stop strings,
no tools, no echo or prompt logprobs) gets its first token from the prefill engine
(router/first_token.py; ``--no-first-token-from-prefill`` turns it off). Step 1 is then
streamed itself (``prefill_body(..., stream=True)``). The role chunk and the first token's
chunk go to the client as soon as they arrive, with finish_reason and stop_reason cleared
(``PrefillStream``). Step 2's stream follows without them (``DecodeFilter``).

With ``--overlap-transfer`` the two steps start together once the router knows the prefill
candidate's KV address (learned from its earlier answers): the decode side's streaming pull
then receives each block while the prefill computes the next chunks (disagg/streaming.py)
and learns the prefill side's hit at the end of the pull.

``usage.prompt_tokens_details.cached_tokens`` of a P/D request is the rule one aggregated
engine that served the same requests would follow: prompt tokens found in a prefix cache,
i.e. ``max(prefill side's hit on prompt[:N-1], decode side's local hit)`` (the prefill side
sends its hit in ``kv_transfer_params.num_cached_tokens``; the decode side takes the max when
it admits the request). The aggregated engine's cache holds what the two together hold (the
prompts' blocks, and the outputs' finish checkpoints that only the decode side has). Tokens
pulled from the prefill side are not counted: they were computed for this request (vLLM's
decode side counts them, which makes every P/D request look cached to a client billing by
it). A request the decode side recomputes (prefill down, failed transfer) reports its own hit.
tests/router/test_pd_e2e.py checks equality over agent turns, repeats, extensions and n=2.

Data parallelism: an engine of DP size N is N candidates (router/engines.py); a request sent
to rank r carries ``X-data-parallel-rank: r`` and its response ``X-Routed-Rank: r``.

Fault tolerance: an engine that cannot be reached (or answers 503) before a response has
started is marked down and the request is retried on another; a prefill side that is all
down leaves the decode side to compute the prompt. Once bytes have been streamed, a
failure ends the stream with an error event. Errors use the server's envelope.

Module layout: this module holds the settings, the app (routes, health, metrics) and the
choice of path for each request; router/relay.py sends a request to an engine and relays
its response (retries, streaming, error events).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from rackserve.router.engines import EnginePool
from rackserve.router.first_token import DecodeFilter, eligible
from rackserve.router.prefill_step import FirstTokenSent, PrefillStep
from rackserve.router.relay import RECEIVED_AT, Relay, error_response

__all__ = ["Router", "RouterSettings", "error_response"]

logger = logging.getLogger(__name__)
LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class RouterSettings:
    health_interval_s: float = 1.0
    # above an engine's own /health budget (its loop answers a ping between steps, within
    # 10 s): an engine in a long step (a kernel compile, a long prefill chunk) is busy, not
    # down. A dead one is found at once (connection refused) or by its own 503.
    health_timeout_s: float = 15.0
    request_timeout_s: float = 600.0
    max_retries: int = 3
    overlap_transfer: bool = False  # send the decode request with the prefill one
    # a streamed request's first token from the prefill engine's answer (router/first_token.py)
    first_token_from_prefill: bool = True


class Router(Relay):
    def __init__(
        self,
        engines: EnginePool | None = None,
        prefill: EnginePool | None = None,
        decode: EnginePool | None = None,
        settings: RouterSettings | None = None,
    ) -> None:
        if engines is None and (prefill is None or decode is None):
            raise ValueError("give --engines, or both --prefill and --decode")
        self.engines, self.prefill, self.decode = engines, prefill, decode
        self.settings = settings or RouterSettings()
        self.pools = [p for p in (engines, prefill, decode) if p is not None]
        self.session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None
        registry = self.registry = CollectorRegistry()
        self.requests = Counter(
            "rackserve_router_requests", "Requests sent, by engine.", ["engine", "role"],
            registry=registry,
        )  # fmt: skip
        self.retries = Counter("rackserve_router_retries", "Requests retried.", registry=registry)
        self.failures = Counter(
            "rackserve_router_failures", "Requests failed after all retries.", registry=registry
        )
        self.kv_sources = Counter(
            "rackserve_router_kv_source", "Where each P/D request's KV came from.", ["source"],
            registry=registry,
        )  # fmt: skip
        self.early_first_tokens = Counter(
            "rackserve_router_first_tokens_from_prefill",
            "Streamed P/D requests whose first token went to the client from the prefill "
            "engine's answer.", registry=registry,
        )  # fmt: skip
        self.hit_units = Counter(
            "rackserve_router_expected_hit_units", "Prompt units expected cached.",
            registry=registry,
        )  # fmt: skip
        self.prompt_units = Counter(
            "rackserve_router_prompt_units", "Prompt units routed.", registry=registry
        )
        self.up = Gauge(
            "rackserve_router_engine_up", "1 when the engine is healthy.", ["engine", "role"],
            registry=registry,
        )  # fmt: skip
        # where a P/D request's TTFT goes outside the engines (pd_serving_bench reads both)
        self.prefill_seconds = Histogram(
            "rackserve_router_prefill_seconds",
            "P/D step 1: the prefill request sent to its answer parsed.",
            buckets=LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.first_byte_seconds = Histogram(
            "rackserve_router_first_byte_seconds",
            "The request received to the first byte of the engine's response sent on.",
            ["role"], buckets=LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.prefill_step = (
            None
            if prefill is None
            else PrefillStep(prefill, self.requests, self.retries, self.prefill_seconds)
        )

    # ---- app ------------------------------------------------------------------------------
    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=self.settings.request_timeout_s, sock_connect=5)
        self.session = aiohttp.ClientSession(timeout=timeout)
        self._health_task = asyncio.create_task(self._health_loop())

    async def _stop(self, app: web.Application) -> None:
        if self.prefill_step is not None:
            await self.prefill_step.close()
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.session is not None:
            await self.session.close()

    async def _health_loop(self) -> None:
        assert self.session is not None
        while True:
            for pool in self.pools:
                await pool.check_health(self.session, self.settings.health_timeout_s)
                for engine in pool.engines:
                    self.up.labels(engine.label, pool.role).set(1 if engine.up else 0)
            await asyncio.sleep(self.settings.health_interval_s)

    async def health(self, request: web.Request) -> web.Response:
        down = [p.role for p in self.pools if not p.any_up]
        if down:
            return error_response(503, f"no healthy {' / '.join(down)} engine")
        return web.json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")

    async def models(self, request: web.Request) -> web.StreamResponse:
        pool = self.engines or self.decode
        assert pool is not None and self.session is not None
        for engine in pool.engines:
            if engine.up:
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with self.session.get(f"{engine.url}/v1/models") as upstream:
                        return web.json_response(await upstream.json(), status=upstream.status)
        return error_response(503, "no healthy engine")

    # ---- requests -------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        request[RECEIVED_AT] = time.perf_counter()
        try:  # msgspec, as serve parses it (json's own is 2-3x slower on a long prompt)
            body = msgspec.json.decode(await request.read())
        except (msgspec.DecodeError, RecursionError):
            return error_response(400, "the request body is not valid JSON", "BadRequestError")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object", "BadRequestError")
        path = request.path
        session = request.headers.get("X-Session-Id") or body.get("user")
        session = session if isinstance(session, str) else None
        headers = _forward_headers(request)
        if self.engines is not None:
            return await self._proxy(request, self.engines, path, body, session, headers, {})
        assert self.prefill_step is not None and self.decode is not None
        assert self.session is not None
        step = self.prefill_step
        started = None
        if self.settings.overlap_transfer:
            started = step.start_overlapped(self.session, path, body, session, headers)
        chat = path.endswith("/chat/completions")
        if started is None and self.settings.first_token_from_prefill and eligible(body, chat):
            return await self._first_token_from_prefill(request, path, body, session, headers)
        if started is None:
            started = await step.run(self.session, path, body, session, headers)
        source, body = started
        self.kv_sources.labels(source).inc()
        extra = {"X-KV-Source": source}
        return await self._proxy(request, self.decode, path, body, session, headers, extra)

    async def _first_token_from_prefill(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        session: str | None,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        """A streamed P/D request whose first chunks come from the prefill engine's answer
        (router/first_token.py): the client's response starts when they arrive; the decode
        engine's stream follows without them. Both engines get one X-Request-Id, so the
        chunks carry one id."""
        assert self.prefill_step is not None and self.decode is not None
        assert self.session is not None
        headers = {"X-Request-Id": uuid.uuid4().hex, **headers}
        try:  # the decode engine now, so the response's headers can name it
            decode_choice = self.decode.choose(body, session, set())
        except ValueError as e:
            self.failures.inc()
            return error_response(503, f"no engine could take the request ({e})")
        response: web.StreamResponse | None = None

        async def send_first(chunks: bytes, label: str) -> None:
            nonlocal response
            response = web.StreamResponse(
                status=200, headers=self._routed_headers(decode_choice, f"prefill={label}")
            )
            response.content_type = "text/event-stream"
            await response.prepare(request)
            await response.write(chunks)
            self._first_byte(request)
            self.early_first_tokens.inc()

        try:
            source, body = await self.prefill_step.run(
                self.session, path, body, session, headers, on_first=send_first
            )
        except FirstTokenSent as e:
            assert response is not None
            return await self._end_with_error(response, str(e))
        self.kv_sources.labels(source).inc()
        extra = {"X-KV-Source": source}
        if response is None:  # no chunk to send early: the decode side's stream, whole
            return await self._proxy(
                request, self.decode, path, body, session, headers, extra, first=decode_choice
            )
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict) or not params.get("first_token_ids"):
            message = "the prefill engine streamed a first token it did not hand over"
            return await self._end_with_error(response, message)
        return await self._proxy(
            request, self.decode, path, body, session, headers, extra, first=decode_choice,
            started=(response, DecodeFilter(path.endswith("/chat/completions"))),
        )  # fmt: skip


def _forward_headers(request: web.Request) -> dict[str, str]:
    keep = ("Authorization", "X-Request-Id", "X-Session-Id")
    return {k: v for k, v in request.headers.items() if k in keep}
