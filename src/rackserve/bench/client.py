"""Streaming load client for any OpenAI-compatible server; records one timeline per request.

Each request is sent with ``stream: true`` and ``stream_options.include_usage`` so the final
chunk carries ``usage`` (prompt, completion and, where the server reports them,
``prompt_tokens_details.cached_tokens``). Times are ``time.perf_counter()`` seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp

from rackserve.bench.workloads import TokenCounter, WordCounter
from rackserve.config import ConfigError

ENDPOINTS = ("chat", "completions")


def api_root(base_url: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` -> ``http://host:port/v1``."""
    root = base_url.rstrip("/")
    return root if root.endswith("/v1") else root + "/v1"


@dataclass(frozen=True)
class EndpointConfig:
    """Where and how to send requests.

    ``fixed_output`` adds ``ignore_eos`` and ``min_tokens`` (vLLM / SGLang extensions) so
    every reply has exactly ``max_tokens`` tokens; turn it off for servers that reject them.
    """

    base_url: str
    model: str
    endpoint: str = "chat"
    fixed_output: bool = True
    temperature: float = 0.0
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ConfigError(f"endpoint must be one of {ENDPOINTS} (got {self.endpoint!r})")
        if self.request_timeout_s <= 0:
            raise ConfigError("request_timeout_s must be > 0")

    @property
    def url(self) -> str:
        path = "chat/completions" if self.endpoint == "chat" else "completions"
        return f"{api_root(self.base_url)}/{path}"


@dataclass(frozen=True)
class GenerationRequest:
    """One request: chat ``messages`` (rendered to a prompt for the completions endpoint)."""

    messages: tuple[Mapping[str, str], ...]
    max_tokens: int
    tag: str = ""


@dataclass(frozen=True)
class RequestTimeline:
    """What the client saw of one request.

    ``chunk_times`` holds the arrival time of every streamed chunk that carried output text;
    a chunk may hold several tokens (speculative decoding), so inter-token latencies are
    measured between chunks, as ``vllm bench serve`` does.
    """

    tag: str
    send_time: float
    end_time: float
    chunk_times: tuple[float, ...] = ()
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # None: the server did not report it
    usage_reported: bool = False
    text: str = ""
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.send_time

    @property
    def e2el(self) -> float:
        return self.end_time - self.send_time


def render_prompt(messages: Sequence[Mapping[str, str]]) -> str:
    """A plain-text transcript for ``/v1/completions``; prefix-stable as messages are appended."""
    parts = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(parts) + "\n\nAssistant:"


def build_payload(endpoint: EndpointConfig, request: GenerationRequest) -> dict[str, Any]:
    """The JSON body of one streaming request."""
    payload: dict[str, Any] = {
        "model": endpoint.model,
        "max_tokens": request.max_tokens,
        "temperature": endpoint.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint.endpoint == "chat":
        payload["messages"] = [dict(m) for m in request.messages]
    else:
        payload["prompt"] = render_prompt(request.messages)
    if endpoint.fixed_output:
        payload["ignore_eos"] = True
        payload["min_tokens"] = request.max_tokens
    return payload


def _chunk_text(chunk: Mapping[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    delta = choice.get("delta")
    if delta is not None:
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choice.get("text") or ""


async def _sse_data(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """Yield the payload of every ``data:`` line; buffers so long lines are never split."""
    buffer = b""
    async for piece in response.content.iter_any():
        buffer += piece
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            line = line.strip()
            if line.startswith(b"data:"):
                yield line[5:].strip().decode()
    if buffer.strip().startswith(b"data:"):
        yield buffer.strip()[5:].strip().decode()


class StreamingClient:
    """Sends :class:`GenerationRequest` objects and returns :class:`RequestTimeline` objects.

    Token counts come from ``usage``; ``counter`` estimates them only if a server sends none.
    """

    def __init__(
        self,
        endpoint: EndpointConfig,
        session: aiohttp.ClientSession,
        counter: TokenCounter | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.session = session
        self.counter: TokenCounter = counter or WordCounter()

    async def generate(
        self, request: GenerationRequest, headers: Mapping[str, str] | None = None
    ) -> RequestTimeline:
        """``headers``: extra HTTP headers of this request (e.g. a DP rank hint)."""
        payload = build_payload(self.endpoint, request)
        send_time = time.perf_counter()
        chunk_times: list[float] = []
        texts: list[str] = []
        usage: Mapping[str, Any] | None = None
        error: str | None = None
        try:
            async with self.session.post(
                self.endpoint.url, json=payload, headers=headers
            ) as response:
                if response.status != 200:
                    body = (await response.text())[:300]
                    error = f"HTTP {response.status}: {body}"
                else:
                    async for data in _sse_data(response):
                        if data == "[DONE]":
                            break
                        now = time.perf_counter()
                        chunk = json.loads(data)
                        if "error" in chunk:
                            error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                            break
                        text = _chunk_text(chunk)
                        if text:
                            chunk_times.append(now)
                            texts.append(text)
                        usage = chunk.get("usage") or usage
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as e:
            error = f"{type(e).__name__}: {e}"
        end_time = time.perf_counter()
        if error is None and not chunk_times:
            error = "no output tokens received"
        return self._timeline(
            request, send_time, end_time, chunk_times, "".join(texts), usage, error
        )

    def _timeline(
        self,
        request: GenerationRequest,
        send_time: float,
        end_time: float,
        chunk_times: list[float],
        text: str,
        usage: Mapping[str, Any] | None,
        error: str | None,
    ) -> RequestTimeline:
        if usage is None:
            prompt = render_prompt(request.messages)
            prompt_tokens, completion_tokens = self.counter.count(prompt), self.counter.count(text)
            cached = None
        else:
            prompt_tokens = int(usage.get("prompt_tokens") or 0)
            completion_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens")
            cached = None if cached is None else int(cached)
        return RequestTimeline(
            tag=request.tag,
            send_time=send_time,
            end_time=end_time,
            chunk_times=tuple(chunk_times),
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=cached,
            usage_reported=usage is not None,
            text=text,
            error=error,
        )


def auth_headers() -> dict[str, str]:
    """``Authorization`` from ``OPENAI_API_KEY``, as the openai client and vLLM's benchmarks do."""
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


@asynccontextmanager
async def open_client(
    endpoint: EndpointConfig, counter: TokenCounter | None = None
) -> AsyncIterator[StreamingClient]:
    """A client over one connection pool with no connection cap (concurrency is ours)."""
    timeout = aiohttp.ClientTimeout(total=endpoint.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=connector, headers=auth_headers()
    ) as session:
        yield StreamingClient(endpoint, session, counter)


async def fetch_model_id(base_url: str, timeout_s: float = 30.0) -> str:
    """The first model the server lists at ``/v1/models`` (used when ``--model`` is absent)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with (
        aiohttp.ClientSession(timeout=timeout, headers=auth_headers()) as session,
        session.get(f"{api_root(base_url)}/models") as response,
    ):
        if response.status != 200:
            raise ConfigError(f"GET /v1/models returned HTTP {response.status}; pass --model")
        models = (await response.json()).get("data") or []
    if not models:
        raise ConfigError(f"{base_url} lists no models; pass --model")
    return str(models[0]["id"])


def resolve_endpoint(
    base_url: str,
    model: str | None,
    endpoint: str,
    fixed_output: bool,
    request_timeout_s: float,
) -> EndpointConfig:
    """A run's endpoint; asks the server for its model id when none is given (blocking)."""
    return EndpointConfig(
        base_url=base_url,
        model=model or asyncio.run(fetch_model_id(base_url)),
        endpoint=endpoint,
        fixed_output=fixed_output,
        request_timeout_s=request_timeout_s,
    )


def resolve_model(base_url: str, model: str | None) -> str:
    """``model`` if given, else the server's first model (a blocking helper for the CLI)."""
    return model or asyncio.run(fetch_model_id(base_url))
