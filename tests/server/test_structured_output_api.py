"""Structured output through the real server: OpenAI's ``response_format``, vLLM's
``structured_outputs`` and its legacy ``guided_*`` fields, streamed and not, on chat and
completions; clear 400s for what cannot be compiled. The model is the tiny random one:
only the grammar makes its output valid."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from conftest import API_KEY, MODEL_NAME, Server, run_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tags"],
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", headers=AUTH, json=body, timeout=120)


def test_chat_json_schema_not_streamed(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        response_format=RESPONSE_FORMAT,
        temperature=1.0,
        max_tokens=300,
        n=4,
        seed=5,
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_chat_json_schema_streamed(client: openai.OpenAI) -> None:
    for seed in range(3):
        stream = client.chat.completions.create(
            model=MODEL_NAME,
            messages=CHAT,
            response_format=RESPONSE_FORMAT,
            temperature=1.0,
            max_tokens=300,
            seed=seed,
            stream=True,
        )
        text, finish = "", None
        for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        assert finish == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object(server: Server, tiny_model: Path) -> None:
    # keys and strings are unbounded: push the random model to close them
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    push = {str(tokenizer.encode(t, add_special_tokens=False)[0]): 6 for t in ('"', "}")}
    body = {
        "model": MODEL_NAME, "messages": CHAT, "response_format": {"type": "json_object"},
        "temperature": 1.0, "max_tokens": 300, "logit_bias": push, "n": 3, "seed": 1,
    }  # fmt: skip
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        assert isinstance(json.loads(choice["message"]["content"]), dict)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, r"red|green|blue"),
        ({"structured_outputs": {"regex": r"[0-9]{2}:[0-9]{2}"}}, r"[0-9]{2}:[0-9]{2}"),
        ({"guided_choice": ["left", "right"]}, r"left|right"),
        ({"guided_regex": r"id-[a-f0-9]{4}"}, r"id-[a-f0-9]{4}"),
        ({"structured_outputs": {"grammar": 'root ::= "x" [0-9]'}}, r"x[0-9]"),
    ],
)
def test_completions_choice_regex_grammar(
    client: openai.OpenAI, fields: dict, pattern: str, stream: bool
) -> None:
    kwargs = {"model": MODEL_NAME, "prompt": "Answer:", "max_tokens": 40, "temperature": 1.0}
    for seed in range(3):
        if stream:
            chunks = client.completions.create(**kwargs, seed=seed, stream=True, extra_body=fields)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
        else:
            text = client.completions.create(**kwargs, seed=seed, extra_body=fields).choices[0].text
        assert re.fullmatch(pattern, text), (fields, text)


def test_completions_legacy_guided_json_and_response_format(client: openai.OpenAI) -> None:
    for extra in ({"guided_json": SCHEMA}, {"response_format": RESPONSE_FORMAT}):
        response = client.completions.create(
            model=MODEL_NAME, prompt="JSON:", max_tokens=300, temperature=1.0, seed=2,
            extra_body=extra,
        )  # fmt: skip
        jsonschema.validate(json.loads(response.choices[0].text), SCHEMA)


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format", "needs json_schema.schema"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
         "response_format", "invalid JSON schema"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "invalid regex"),
        ({"guided_regex": "[z-a]"}, "guided_regex", "invalid regex"),
        ({"guided_grammar": "root ::= nothing"}, "guided_grammar", "invalid grammar"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs",
         "exactly one"),
        ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice",
         "only one"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs",
         "not supported"),
        ({"response_format": {"type": "xml"}}, "response_format", "must be text"),
    ],
)  # fmt: skip
def test_clear_400s(server: Server, fields: dict, param: str, message: str) -> None:
    for path, body in (
        ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 4}),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 4}),
    ):
        response = post(server, path, {**body, **fields})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and message in error["message"], error
        assert ".cc:" not in error["message"]


def test_text_response_format_is_unconstrained(server: Server) -> None:
    body = {
        "model": MODEL_NAME, "messages": CHAT, "max_tokens": 5, "temperature": 0,
        "response_format": {"type": "text"}, "ignore_eos": True,
    }  # fmt: skip
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5


# ~18 s (a server); tests/runner/test_grammar_wait.py covers the deadline in process
@pytest.mark.slow
def test_grammar_compile_past_the_deadline_is_a_400(tiny_model: Path, tmp_path: Path) -> None:
    # 1 ms: the first compile (which loads the vocabulary) cannot make it
    with run_server(tiny_model, tmp_path, "--structured-output-timeout-s", "0.001") as server:
        body = {"model": MODEL_NAME, "messages": CHAT, "response_format": RESPONSE_FORMAT}
        response = post(server, "/v1/chat/completions", {**body, "max_tokens": 20})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "did not compile within 0.001 s" in error["message"], error
        assert error["type"] == "invalid_request_error"
        plain = post(server, "/v1/chat/completions", {**body, "response_format": None})
        assert plain.status_code == 200, plain.text  # the engine is unharmed
