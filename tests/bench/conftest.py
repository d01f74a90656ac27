"""A fake OpenAI-compatible streaming server on 127.0.0.1 (free port), for the bench tests.

It "tokenizes" by whitespace (chat messages add a ``<role>`` token each, plus ``<assistant>``
as the generation prompt), streams ``max_tokens`` one-word chunks with a fixed per-token
delay, and reports ``usage.prompt_tokens_details.cached_tokens`` from an infinite prefix
cache: every prompt plus its reply is remembered as chained prefix hashes, and a request's
cached tokens are its longest remembered prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web


@dataclass
class FakeServerOptions:
    token_delay_s: float = 0.001
    ttft_delay_s: float = 0.0
    fail_every: int = 0  # every n-th generation request answers HTTP 500 (0: never)
    report_cached_tokens: bool = True
    report_usage: bool = True


@dataclass
class FakeServerState:
    options: FakeServerOptions
    payloads: list[dict[str, Any]] = field(default_factory=list)
    prefix_hashes: set[int] = field(default_factory=set)
    in_flight: int = 0
    max_in_flight: int = 0

    def tokenize(self, payload: dict[str, Any]) -> list[str]:
        if "messages" in payload:
            tokens = []
            for message in payload["messages"]:
                tokens += [f"<{message['role']}>", *message["content"].split()]
            return [*tokens, "<assistant>"]
        return payload["prompt"].split()

    def cached_tokens(self, tokens: list[str]) -> int:
        parent, cached = 0, 0
        for i, token in enumerate(tokens):
            parent = hash((parent, token))
            if parent not in self.prefix_hashes:
                break
            cached = i + 1
        return cached

    def remember(self, tokens: list[str]) -> None:
        parent = 0
        for token in tokens:
            parent = hash((parent, token))
            self.prefix_hashes.add(parent)


def _sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data)
    return f"data: {text}\n\n".encode()


def make_app(state: FakeServerState) -> web.Application:
    options = state.options

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def generate(request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        state.payloads.append(payload)
        if options.fail_every and len(state.payloads) % options.fail_every == 0:
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        prompt = state.tokenize(payload)
        cached = state.cached_tokens(prompt)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
            # A reset is the client cancelling at the end of a window: treat it as an abort.
            with contextlib.suppress(ConnectionResetError):
                await response.prepare(request)
                await _stream(response, payload, prompt, cached)
        finally:
            state.in_flight -= 1
        return response

    async def _stream(
        response: web.StreamResponse, payload: dict[str, Any], prompt: list[str], cached: int
    ) -> None:
        chat = "messages" in payload
        if chat:  # OpenAI streams open with a role-only delta that carries no text.
            await response.write(_sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
        await asyncio.sleep(options.ttft_delay_s)
        output = [f"w{i % 7}" for i in range(payload["max_tokens"])]
        for i, word in enumerate(output):
            if i:
                await asyncio.sleep(options.token_delay_s)
            piece = {"delta": {"content": f" {word}"}} if chat else {"text": f" {word}"}
            await response.write(_sse({"choices": [{"index": 0, **piece}]}))
        state.remember(prompt + output)
        if options.report_usage:
            details = {"cached_tokens": cached} if options.report_cached_tokens else None
            usage = {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(output),
                "total_tokens": len(prompt) + len(output),
                "prompt_tokens_details": details,
            }
            await response.write(_sse({"choices": [], "usage": usage}))
        await response.write(_sse("[DONE]"))

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/v1/completions", generate)
    return app


class FakeServer:
    """The app on its own event loop in a daemon thread; ``base_url`` once started."""

    def __init__(self, options: FakeServerOptions) -> None:
        self.state = FakeServerState(options)
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(make_app(self.state))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.base_url = ""

    def start(self) -> FakeServer:
        self.thread.start()

        async def setup() -> str:
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)  # port 0: the OS picks a free one
            await site.start()
            host, port = self.runner.addresses[0][:2]
            return f"http://{host}:{port}"

        self.base_url = asyncio.run_coroutine_threadsafe(setup(), self.loop).result(timeout=10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture
def fake_server_factory() -> Iterator[Callable[..., FakeServer]]:
    """``factory(**FakeServerOptions fields)`` -> a started server, stopped after the test."""
    servers: list[FakeServer] = []

    def factory(**options: Any) -> FakeServer:
        server = FakeServer(FakeServerOptions(**options)).start()
        servers.append(server)
        return server

    yield factory
    for server in servers:
        server.stop()


@pytest.fixture
def fake_server(fake_server_factory: Callable[..., FakeServer]) -> FakeServer:
    return fake_server_factory()
