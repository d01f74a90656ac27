"""Passing a request to an engine and its response back to the client (``Relay``, a base of
``router/app.py``'s ``Router``).

``_proxy`` picks an engine of a pool (or takes the one given), sends the body and relays the
answer: whole, streamed through, or (first-token path, router/first_token.py) appended to a
response whose first chunks went out already. An engine that cannot be reached or answers a
retryable status before anything was returned is marked down and the request goes to
another; once bytes have been sent, a failure ends the stream with an error event. Also the
response headers that name the engine, the first-byte latency metric, and ``error_response``
(the server's error envelope).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from prometheus_client import Counter, Histogram

from rackserve.router.engines import Choice, EnginePool
from rackserve.router.first_token import DecodeFilter
from rackserve.router.prefill_step import JSON_HEADERS, RETRY_STATUSES, NotStarted, json_bytes
from rackserve.server.responses import error_body

if TYPE_CHECKING:
    from rackserve.router.app import RouterSettings

# When the router received the request (rackserve_router_first_byte_seconds). aiohttp 3.14
# added typed request keys and warns (NotAppKeyWarning) on a str one; older ones have neither.
RECEIVED_AT: web.RequestKey[float] | str = (
    web.RequestKey("received_at", float) if hasattr(web, "RequestKey") else "received_at"
)


def error_response(
    status: int, message: str, type_: str = "ServiceUnavailableError"
) -> web.Response:
    return web.json_response(error_body(message, type_, None, status), status=status)


class Relay:
    """The forwarding half of :class:`rackserve.router.app.Router`, which sets these fields."""

    engines: EnginePool | None
    settings: RouterSettings
    session: aiohttp.ClientSession | None
    requests: Counter
    retries: Counter
    failures: Counter
    prompt_units: Counter
    hit_units: Counter
    first_byte_seconds: Histogram

    async def _end_with_error(
        self, response: web.StreamResponse, message: str
    ) -> web.StreamResponse:
        """A started stream's end after a failure: an error event (no retry can take back
        what the client has)."""
        error = error_body(message, "InternalServerError")
        await response.write(f"data: {json.dumps(error)}\n\n".encode())
        await response.write_eof()
        self.failures.inc()
        return response

    @staticmethod
    def _routed_headers(choice: Choice, source: str | None) -> dict[str, str]:
        headers = {"X-Routed-To": choice.engine.url}
        if source is not None:
            headers["X-KV-Source"] = source
        if choice.engine.rank is not None:
            headers["X-Routed-Rank"] = str(choice.engine.rank)
        return headers

    async def _proxy(
        self,
        request: web.Request,
        pool: EnginePool,
        path: str,
        body: dict[str, Any],
        session: str | None,
        headers: dict[str, str],
        extra_headers: dict[str, str],
        first: Choice | None = None,
        started: tuple[web.StreamResponse, DecodeFilter] | None = None,
    ) -> web.StreamResponse:
        """Send ``body`` to an engine of ``pool`` (``first``, if given, before the policy's
        picks) and pass its response through; retried on another engine while nothing has
        been returned. ``started``: the client's response, begun already, and the filter
        for what the engine streams (router/first_token.py)."""
        assert self.session is not None
        tried: set[int] = set()
        last_error = "no healthy engine"
        for _ in range(self.settings.max_retries + 1):
            try:
                choice = first if first is not None else pool.choose(body, session, tried)
            except ValueError as e:
                last_error = str(e)
                break
            first = None
            tried.add(choice.index)
            pool.start(choice, session)
            self.requests.labels(choice.engine.label, pool.role).inc()
            self.prompt_units.inc(choice.units)
            self.hit_units.inc(choice.hit_units)
            try:
                return await self._relay(
                    request, choice, path, body, headers, extra_headers, started
                )
            except NotStarted as e:
                last_error = f"{choice.engine.label}: {e}"
                pool.mark_down(choice.index, str(e))
                self.retries.inc()
            finally:
                pool.finish(choice)
        message = f"no engine could take the request ({last_error})"
        if started is not None:
            return await self._end_with_error(started[0], message)
        self.failures.inc()
        return error_response(503, message)

    def _first_byte(self, request: web.Request) -> None:
        received_at = request.get(RECEIVED_AT)
        if received_at is not None:
            role = "engine" if self.engines is not None else "decode"
            self.first_byte_seconds.labels(role).observe(time.perf_counter() - received_at)

    async def _relay(
        self,
        request: web.Request,
        choice: Choice,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        extra_headers: dict[str, str],
        started: tuple[web.StreamResponse, DecodeFilter] | None = None,
    ) -> web.StreamResponse:
        assert self.session is not None
        url = f"{choice.engine.url}{path}"
        try:
            send_headers = {**headers, **choice.engine.headers, **JSON_HEADERS}
            upstream_cm = self.session.post(url, data=json_bytes(body), headers=send_headers)
            upstream = await upstream_cm.__aenter__()
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise NotStarted(str(e) or type(e).__name__) from None
        try:
            if upstream.status in RETRY_STATUSES:
                raise NotStarted(f"HTTP {upstream.status}")
            if started is not None:
                return await self._relay_rest(upstream, *started)
            response_headers = {**self._routed_headers(choice, None), **extra_headers}
            if not body.get("stream"):
                try:
                    data = await upstream.read()
                except (TimeoutError, aiohttp.ClientError, OSError) as e:
                    raise NotStarted(f"lost before the response: {e}") from None
                self._first_byte(request)
                return web.Response(
                    body=data,
                    status=upstream.status,
                    content_type=upstream.content_type,
                    headers=response_headers,
                )
            response = web.StreamResponse(status=upstream.status, headers=response_headers)
            response.content_type = upstream.content_type
            await response.prepare(request)
            first = True
            try:
                async for data in upstream.content.iter_any():
                    await response.write(data)
                    if first:
                        self._first_byte(request)
                        first = False
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                # Started: the client has tokens already, so no retry; an error event ends it.
                error = error_body(f"the engine failed mid-stream: {e}", "InternalServerError")
                await response.write(f"data: {json.dumps(error)}\n\n".encode())
                self.failures.inc()
            await response.write_eof()
            return response
        finally:
            await upstream_cm.__aexit__(None, None, None)

    async def _relay_rest(
        self, upstream: aiohttp.ClientResponse, response: web.StreamResponse, keep: DecodeFilter
    ) -> web.StreamResponse:
        """The decode engine's stream into a response that has its first chunks already."""
        if upstream.status != 200:  # refused what the prefill side took: too late for a status
            detail = (await upstream.read()).decode(errors="replace")[:500]
            message = f"the decode engine refused the request (HTTP {upstream.status}): {detail}"
            return await self._end_with_error(response, message)
        try:
            async for data in upstream.content.iter_any():
                out = keep.feed(data)
                if out:
                    await response.write(out)
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            return await self._end_with_error(response, f"the engine failed mid-stream: {e}")
        await response.write_eof()
        return response
