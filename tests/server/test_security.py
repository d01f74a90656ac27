"""What issue 9 found, against the shared live server: values the engine cannot hold,
request-supplied templates, deep JSON, browser requests, per-request limits. Each is a
4xx with the error envelope, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from conftest import API_KEY, MODEL_NAME, Server

AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON_AUTH = {**AUTH, "Content-Type": "application/json"}
CHAT = [{"role": "user", "content": "hi"}]


def post(server: Server, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=AUTH, timeout=60)


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def rejected(server: Server, reason: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    key = f'rackserve:request_rejected_total{{model_name="{MODEL_NAME}",reason="{reason}"}}'
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(key)]
    return values[0] if values else 0.0


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"top_k": 2**63, "temperature": 1.0}, "top_k"),
        ({"top_k": 2**64 - 1, "temperature": 1.0}, "top_k"),
        ({"top_k": 10**6, "temperature": 1.0}, "top_k"),  # above the vocabulary
        ({"seed": 2**64 - 1}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"priority": 2**70}, "priority"),
        ({"n": 129}, "n"),
    ],
)
def test_values_the_engine_cannot_hold(server: Server, extra: dict, param: str) -> None:
    body = {"model": MODEL_NAME, "prompt": "a", "max_tokens": 2, **extra}
    assert_error(post(server, body), 400, param)


def test_n_with_a_seed_at_the_top_of_the_range(server: Server) -> None:
    body = {"model": MODEL_NAME, "prompt": "a", "max_tokens": 1, "n": 128,
            "seed": 2**63 - 1, "temperature": 1.0}  # fmt: skip
    response = post(server, body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 128
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_chat_template_kwargs(server: Server) -> None:
    path = "/v1/chat/completions"
    for key in ("tokenize", "conversation", "add_generation_prompt", "continue_final_message"):
        body = {"model": MODEL_NAME, "messages": CHAT, "chat_template_kwargs": {key: True}}
        assert_error(post(server, body, path), 400, "chat_template_kwargs")
    body = {"model": MODEL_NAME, "messages": CHAT,
            "chat_template_kwargs": {"chat_template": "{{ 'x' * 5000 }}"}}  # fmt: skip
    error = assert_error(post(server, body, path), 400, "chat_template_kwargs")
    assert "--trust-request-chat-template" in error["message"]


def test_deep_json_is_a_400_envelope(server: Server) -> None:
    for depth in (100, 1000, 30_000):  # the shared server takes bodies up to 64 K
        body = b'{"model": "tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
        response = httpx.post(
            f"{server.base_url}/v1/completions", content=body, headers=JSON_AUTH, timeout=30
        )
        error = assert_error(response, 400)
        assert "deeper than" in error["message"]


def test_browser_requests(server: Server) -> None:
    url = f"{server.base_url}/v1/completions"
    body = b'{"model": "tiny", "prompt": "a", "max_tokens": 1}'
    for content_type in (None, "text/plain", "application/x-www-form-urlencoded"):
        headers = dict(AUTH) if content_type is None else {**AUTH, "Content-Type": content_type}
        before = rejected(server, "unsupported_media_type")
        assert_error(httpx.post(url, content=body, headers=headers, timeout=30), 415)
        assert rejected(server, "unsupported_media_type") == before + 1
    evil = {**JSON_AUTH, "Origin": "https://evil.example"}
    error = assert_error(httpx.post(url, content=body, headers=evil, timeout=30), 403)
    assert error["code"] == "origin_not_allowed"
    assert httpx.post(url, content=body, headers=JSON_AUTH, timeout=30).status_code == 200


def test_prompts_times_n_limit(server: Server) -> None:
    before = rejected(server, "too_many_sequences")
    body = {"model": MODEL_NAME, "prompt": ["a", "b", "c"], "n": 128, "max_tokens": 1}
    error = assert_error(post(server, body), 400, "n")
    assert error["code"] == "too_many_sequences" and "384 sequences" in error["message"]
    assert rejected(server, "too_many_sequences") == before + 1


def test_long_prompts_rejected_by_length_bounds(server: Server) -> None:
    # 60 K characters (the shared server's body limit is 64 K) of one-token words: over
    # the 512-token context, found from a prefix without tokenizing the whole text.
    prompt = "hello " * 10_000
    error = assert_error(post(server, {"model": MODEL_NAME, "prompt": prompt}), 400, "prompt")
    assert "at least" in error["message"]
    messages = [{"role": "user", "content": prompt}]
    body = {"model": MODEL_NAME, "messages": messages}
    assert_error(post(server, body, "/v1/chat/completions"), 400, "messages")
    body = {"model": MODEL_NAME, "prompt": prompt, "truncate_prompt_tokens": 8, "max_tokens": 1}
    response = post(server, body)  # truncation keeps only a tail: no length error
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == 8


def test_empty_messages_on_tokenize(server: Server) -> None:
    response = post(server, {"model": MODEL_NAME, "messages": []}, "/tokenize")
    assert_error(response, 400, "messages")


def test_openapi_describes_request_bodies(server: Server) -> None:
    spec = httpx.get(f"{server.base_url}/openapi.json", headers=AUTH, timeout=10).json()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        name = body["schema"]["$ref"].rsplit("/", 1)[1]
        assert "properties" in spec["components"]["schemas"][name]
    seed = spec["components"]["schemas"]["CompletionRequest"]["properties"]["seed"]
    assert {"maximum": 2**63 - 1, "minimum": -(2**63), "type": "integer"}.items() <= (
        seed["anyOf"][0].items()
    )
