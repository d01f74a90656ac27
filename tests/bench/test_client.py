"""The streaming client against the fake server: payloads, timelines, usage, errors."""

from __future__ import annotations

import asyncio
import socket

import pytest

from rackserve.bench.client import (
    EndpointConfig,
    GenerationRequest,
    RequestTimeline,
    api_root,
    build_payload,
    fetch_model_id,
    open_client,
)
from rackserve.config import ConfigError

MESSAGES = ({"role": "system", "content": "be brief"}, {"role": "user", "content": "the cache"})


def generate(endpoint: EndpointConfig, *requests: GenerationRequest) -> list[RequestTimeline]:
    async def main() -> list[RequestTimeline]:
        async with open_client(endpoint) as client:
            return [await client.generate(request) for request in requests]

    return asyncio.run(main())


def test_api_root_and_payloads() -> None:
    assert api_root("http://h:1/") == api_root("http://h:1/v1") == "http://h:1/v1"
    chat = EndpointConfig("http://h:1", "m")
    payload = build_payload(chat, GenerationRequest(MESSAGES, 7))
    assert payload["stream"] and payload["stream_options"] == {"include_usage": True}
    assert payload["messages"][1] == {"role": "user", "content": "the cache"}
    assert (payload["max_tokens"], payload["min_tokens"], payload["ignore_eos"]) == (7, 7, True)
    plain = EndpointConfig("http://h:1", "m", endpoint="completions", fixed_output=False)
    payload = build_payload(plain, GenerationRequest(MESSAGES, 7))
    assert "messages" not in payload and payload["prompt"].startswith("System: be brief")
    assert "ignore_eos" not in payload and "min_tokens" not in payload
    with pytest.raises(ConfigError, match="endpoint"):
        EndpointConfig("http://h:1", "m", endpoint="embeddings")


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_timelines_record_chunks_usage_and_cache_hits(fake_server, kind: str) -> None:
    endpoint = EndpointConfig(fake_server.base_url, "fake-model", endpoint=kind)
    first, second = generate(endpoint, *[GenerationRequest(MESSAGES, 5)] * 2)
    assert first.success and first.completion_tokens == 5 and len(first.chunk_times) == 5
    assert first.text == " w0 w1 w2 w3 w4"
    assert first.send_time < first.chunk_times[0] <= first.chunk_times[-1] <= first.end_time
    assert first.cached_tokens == 0 and first.usage_reported
    # The same prompt again: all of it is in the fake server's prefix cache.
    assert second.cached_tokens == second.prompt_tokens > 0
    assert fake_server.state.payloads[0]["model"] == "fake-model"


def test_missing_usage_falls_back_to_counting(fake_server_factory) -> None:
    server = fake_server_factory(report_usage=False)
    (timeline,) = generate(EndpointConfig(server.base_url, "m"), GenerationRequest(MESSAGES, 4))
    assert timeline.success and not timeline.usage_reported
    assert timeline.completion_tokens == 4 and timeline.cached_tokens is None
    assert timeline.prompt_tokens > 0


def test_http_errors_and_refused_connections_become_failed_timelines(fake_server_factory) -> None:
    server = fake_server_factory(fail_every=1)
    (timeline,) = generate(EndpointConfig(server.base_url, "m"), GenerationRequest(MESSAGES, 4))
    assert not timeline.success and timeline.error.startswith("HTTP 500")
    with socket.socket() as s:  # a port that nobody listens on any more
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = EndpointConfig(f"http://127.0.0.1:{port}", "m", request_timeout_s=5)
    (timeline,) = generate(endpoint, GenerationRequest(MESSAGES, 4))
    assert not timeline.success and "Connect" in timeline.error


def test_fetch_model_id(fake_server) -> None:
    assert asyncio.run(fetch_model_id(fake_server.base_url)) == "fake-model"
