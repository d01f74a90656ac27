"""Bad input answers with OpenAI's error envelope and never disturbs the engine."""

from __future__ import annotations

import httpx
import pytest

from conftest import API_KEY, MAX_MODEL_LEN, MODEL_NAME, Server

AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON_AUTH = {**AUTH, "Content-Type": "application/json"}  # raw bytes bodies say what they are
CHAT = [{"role": "user", "content": "hi"}]


def post(server: Server, path: str, body, headers: dict | None = None) -> httpx.Response:
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    default = JSON_AUTH if isinstance(body, bytes) else AUTH
    return httpx.post(
        f"{server.base_url}{path}",
        headers=headers if headers is not None else default,
        timeout=30,
        **kw,
    )


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def test_prompt_longer_than_context(server: Server) -> None:
    prompt = " ".join(["hello"] * (MAX_MODEL_LEN + 10))
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4}
    error = assert_error(post(server, "/v1/completions", body), 400)
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": MAX_MODEL_LEN}
    error = assert_error(post(server, "/v1/chat/completions", body), 400, "max_tokens")
    assert "maximum context length" in error["message"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"n": 0}, "n"),
        ({"top_p": 0}, "top_p"),
        ({"logit_bias": {"not-a-token": 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 500.0}}, "logit_bias"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools.0.function.name",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"temperature": "hot"}, "temperature"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ],
)
def test_invalid_or_unsupported_parameters(server: Server, extra: dict, param: str) -> None:
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 3, **extra}
    assert_error(post(server, "/v1/chat/completions", body), 400, param)


def test_completion_specific_errors(server: Server) -> None:
    for extra, param in (({"suffix": "x"}, "suffix"), ({"best_of": 3}, "best_of")):
        body = {"model": MODEL_NAME, "prompt": "a", "max_tokens": 2, **extra}
        assert_error(post(server, "/v1/completions", body), 400, param)
    body = {"model": MODEL_NAME, "prompt": [[1, 10**9]], "max_tokens": 2}
    assert_error(post(server, "/v1/completions", body), 400, "prompt")
    assert_error(post(server, "/v1/completions", {"model": MODEL_NAME}), 400, "prompt")


def test_malformed_bodies(server: Server) -> None:
    assert_error(post(server, "/v1/completions", b"{not json"), 400)
    assert_error(post(server, "/v1/completions", b"[1, 2]"), 400)


def test_unknown_model(server: Server) -> None:
    body = {"model": "gpt-17", "messages": CHAT}
    error = assert_error(post(server, "/v1/chat/completions", body), 404, "model")
    assert error["code"] == "model_not_found"


def test_wrong_api_key(server: Server) -> None:
    body = {"model": MODEL_NAME, "messages": CHAT}
    for headers in ({}, {"Authorization": "Bearer nope"}):
        error = assert_error(post(server, "/v1/chat/completions", body, headers), 401)
        assert error["code"] == "invalid_api_key"
    assert httpx.get(f"{server.base_url}/v1/models").status_code == 401
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200


def test_body_too_large(server: Server) -> None:
    body = {"model": MODEL_NAME, "prompt": "x" * (70 << 10)}
    assert_error(post(server, "/v1/completions", body), 413)

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(80):
            yield b" " * 1024

    response = httpx.post(
        f"{server.base_url}/v1/completions", content=chunks(), headers=JSON_AUTH, timeout=30
    )
    assert_error(response, 413)


def test_unknown_route_uses_envelope(server: Server) -> None:
    assert_error(httpx.get(f"{server.base_url}/v1/nothing", headers=AUTH), 404)


def test_engine_unharmed_by_bad_requests(server: Server) -> None:
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 2}
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("value", ["1", "-1", "zero", "", "0.5"])
def test_bad_data_parallel_rank_header(server: Server, value: str) -> None:
    # one engine rank: only 0 pins; anything else is the client's mistake, said as such
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}
    response = post(server, "/v1/completions", body, {**AUTH, "X-data-parallel-rank": value})
    error = assert_error(response, 400, param="X-data-parallel-rank")
    assert "[0, 1)" in error["message"]


def test_data_parallel_rank_header_pins(server: Server) -> None:
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 2}
    response = post(server, "/v1/chat/completions", body, {**AUTH, "X-data-parallel-rank": "0"})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] is not None
