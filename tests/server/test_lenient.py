"""Lenient validation as vLLM: null means the default, unknown fields are accepted (and
logged), messages as the openai SDK dumps them, content as a list of text parts."""

from __future__ import annotations

import time

import openai
from openai.types.chat import ChatCompletionMessage
from test_api import post

from conftest import MODEL_NAME, Server


def test_explicit_nulls_mean_defaults(server: Server) -> None:
    body = {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "temperature": None, "top_p": None, "n": None, "stream": None, "stop": None,
        "seed": None, "presence_penalty": None, "logprobs": None, "tools": None,
        "tool_choice": None, "response_format": None, "stream_options": None, "user": None,
    }  # fmt: skip
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1


def test_unknown_fields_are_accepted_and_logged(server: Server) -> None:
    body = {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "store": False, "metadata": {"run": "x"}, "reasoning_effort": "low",
        "service_tier": "auto", "parallel_tool_calls": True, "zz_unknown_field_7": 1,
    }  # fmt: skip
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    deadline = time.monotonic() + 5
    while "zz_unknown_field_7" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    line = next(ln for ln in server.log().splitlines() if "zz_unknown_field_7" in ln)
    assert "ignoring" in line and "store" in line and "service_tier" in line


def test_sdk_message_dump_round_trips(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    message = first.choices[0].message
    assert isinstance(message, ChatCompletionMessage)
    dumped = message.model_dump()  # refusal, tool_calls, audio, function_call: None
    assert "refusal" in dumped and "audio" in dumped
    second = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            {"role": "user", "content": "hi"},
            dumped,
            {
                "role": "user",
                "content": [{"type": "text", "text": "and "}, {"type": "text", "text": "more"}],
            },
        ],
        max_tokens=2,
    )
    assert second.choices[0].message.role == "assistant"


def test_text_parts_equal_plain_content(server: Server) -> None:
    def count(content) -> int:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}]}
        return post(server, "/tokenize", body).json()["count"]

    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    assert count(parts) == count("Hello there")


def test_wrong_values_still_400(server: Server) -> None:
    bad = [
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "x": 1}]}]}, 400),
        ({"messages": [{"role": "user", "content": "hi"}], "n": -1}, 400),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}, 400),
    ]
    for extra, status in bad:
        response = post(server, "/v1/chat/completions", {"model": MODEL_NAME, **extra})
        assert response.status_code == status, (extra, response.text)
