"""Scoring requests (lm-eval's loglikelihood path): ``/v1/completions`` with echo + logprobs,
including ``max_tokens`` 0, in the OpenAI completions shape."""

from __future__ import annotations

import math

import openai
import pytest
from test_api import post, sse_events

from conftest import MODEL_NAME, Server


def tokens_of(server: Server, text: str) -> list[int]:
    body = {"model": MODEL_NAME, "prompt": text}
    return post(server, "/tokenize", body).json()["tokens"]


def check_shape(logprobs: dict, num_tokens: int) -> None:
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert len(logprobs[key]) == num_tokens, key
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(lp <= 0 for lp in logprobs["token_logprobs"][1:])
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_echo_logprobs_scores_prompt_then_generated(server: Server) -> None:
    ids = tokens_of(server, "The harbour was quiet that morning")
    body = {
        "model": MODEL_NAME,
        "prompt": [ids],
        "max_tokens": 1,
        "logprobs": 1,
        "echo": True,
        "temperature": 0,
        "seed": 1234,
    }  # fmt: skip  (lm-eval's local-completions loglikelihood body)
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    logprobs = choice["logprobs"]
    check_shape(logprobs, len(ids) + 1)
    # logprobs=1: the scored token plus the best alternative (the same token when greedy)
    for token, lp, top in zip(
        logprobs["tokens"][1:],
        logprobs["token_logprobs"][1:],
        logprobs["top_logprobs"][1:],
        strict=True,
    ):
        assert token in top and top[token] == lp and 1 <= len(top) <= 2
        assert max(top.values()) >= lp
    generated_top = logprobs["top_logprobs"][-1]
    assert max(generated_top.values()) == logprobs["token_logprobs"][-1]  # greedy
    assert choice["text"].startswith(post(server, "/detokenize", {"tokens": ids}).json()["prompt"])
    assert "prompt_logprobs" not in choice


def test_max_tokens_zero_scores_prompt_only(server: Server, client: openai.OpenAI) -> None:
    prompt = "Once upon a time there was a harbour"
    ids = tokens_of(server, prompt)
    completion = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=3
    )
    (choice,) = completion.choices
    assert choice.text == prompt
    check_shape(choice.logprobs.model_dump(), len(ids))
    assert all(len(top) >= 3 for top in choice.logprobs.top_logprobs[1:])
    assert completion.usage.completion_tokens == 0
    assert completion.usage.prompt_tokens == len(ids)


def test_score_matches_generation_logprob(server: Server) -> None:
    """The logprob a scoring request gives a token equals the one sampling reported."""
    ids = tokens_of(server, "A quiet harbour in the")
    body = {"model": MODEL_NAME, "prompt": [ids], "max_tokens": 1, "temperature": 0}
    generated = post(server, "/v1/completions", {**body, "logprobs": 0}).json()["choices"][0]
    lp_generated = generated["logprobs"]["token_logprobs"][0]
    next_id = tokens_of(server, generated["logprobs"]["tokens"][0])[1:]  # drop BOS
    if len(next_id) != 1:
        pytest.skip("the generated token does not re-encode to one token")
    scored = post(
        server,
        "/v1/completions",
        {**body, "prompt": [ids + next_id], "max_tokens": 0, "echo": True, "logprobs": 0},
    ).json()["choices"][0]["logprobs"]
    assert math.isclose(scored["token_logprobs"][-1], lp_generated, abs_tol=1e-3)


def test_repeated_scoring_is_identical(server: Server) -> None:
    """A repeat hits the prefix cache; its prompt logprobs must still be complete and equal."""
    ids = tokens_of(server, " ".join(f"tide{i}" for i in range(40)))
    body = {"model": MODEL_NAME, "prompt": [ids], "max_tokens": 0, "echo": True, "logprobs": 2}
    first = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    second = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    check_shape(first, len(ids))
    assert first["tokens"] == second["tokens"]
    for a, b in zip(first["token_logprobs"][1:], second["token_logprobs"][1:], strict=True):
        assert math.isclose(a, b, abs_tol=1e-4)


def test_batched_prompts_keep_order(server: Server) -> None:
    prompts = [tokens_of(server, text) for text in ("short one", "a somewhat longer prompt here")]
    body = {"model": MODEL_NAME, "prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 1}
    choices = post(server, "/v1/completions", body).json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for choice, ids in zip(choices, prompts, strict=True):
        check_shape(choice["logprobs"], len(ids))


def test_streamed_echo_logprobs(server: Server) -> None:
    ids = tokens_of(server, "Streaming a scored prompt")
    body = {
        "model": MODEL_NAME, "prompt": [ids], "max_tokens": 3, "logprobs": 1, "echo": True,
        "temperature": 0, "stream": True,
    }  # fmt: skip
    with __import__("httpx").stream(
        "POST", f"{server.base_url}/v1/completions", json=body,
        headers={"Authorization": "Bearer test-key"}, timeout=60,
    ) as response:  # fmt: skip
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    tokens: list[str] = []
    values: list = []
    for event in events[:-1]:
        logprobs = event["choices"][0]["logprobs"]
        if logprobs is not None:
            tokens += logprobs["tokens"]
            values += logprobs["token_logprobs"]
    assert len(tokens) == len(ids) + 3 and values[0] is None
    first = events[0]["choices"][0]
    assert len(first["logprobs"]["tokens"]) >= len(ids)
