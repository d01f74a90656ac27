"""The OpenAI API of a real server (tiny random model), via the `openai` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from conftest import API_KEY, MAX_MODEL_LEN, MODEL_NAME, Server

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG_PROMPT = " ".join(f"word{i}" for i in range(120))
MEDIUM_PROMPT = " ".join(f"word{i}" for i in range(30))


def post(server: Server, path: str, body: dict, **kw) -> httpx.Response:
    headers = {**AUTH, **kw.pop("headers", {})}
    kw.setdefault("timeout", 60)
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, **kw)


def sse_events(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metric(server: Server, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f"rackserve:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not found")


def chat(content: str = "Hello!") -> list[dict]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]


# ---- basics ------------------------------------------------------------------------------


def test_models_health_version_metrics(server: Server, client: openai.OpenAI) -> None:
    (model,) = client.models.list().data
    assert model.id == MODEL_NAME
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/version").json()["version"]
    # open like /version (the router reads it without the key); DP 1 here
    assert httpx.get(f"{server.base_url}/server_info").json() == {"data_parallel_size": 1}
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in (
        "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
        "prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total",
        "generation_tokens_total", "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
        "request_queue_time_seconds_bucket", "num_preemptions_total",
    ):  # fmt: skip
        assert f"rackserve:{name}{{" in text, name
    assert f'rackserve:num_requests_running{{model_name="{MODEL_NAME}"}}' in text


def test_chat_completion(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=chat(), max_tokens=8, temperature=0
    )
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    (choice,) = response.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("length", "stop")
    usage = response.usage
    assert usage.completion_tokens <= 8 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_echo_and_token_prompt(server: Server, client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL_NAME, prompt="Once upon", max_tokens=4, temperature=0, echo=True
    )
    assert response.object == "text_completion" and response.choices[0].text.startswith("Once upon")
    ids = post(server, "/tokenize", {"prompt": "Once upon"}).json()["tokens"]
    batch = client.completions.create(
        model=MODEL_NAME, prompt=[ids, ids[:2]], max_tokens=3, temperature=0, n=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert batch.usage.completion_tokens == 12
    assert batch.usage.prompt_tokens == len(ids) + 2


def test_tokenize_detokenize(server: Server) -> None:
    tokens = post(server, "/tokenize", {"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    text = post(server, "/detokenize", {"tokens": tokens["tokens"][1:]}).json()["prompt"]
    assert text == "Hello world"
    chat_tokens = post(server, "/tokenize", {"messages": chat()}).json()
    assert chat_tokens["count"] > tokens["count"]


# ---- streaming ---------------------------------------------------------------------------


def test_streaming_chat_chunk_invariants(server: Server, client: openai.OpenAI) -> None:
    body = {"model": MODEL_NAME, "messages": chat("Tell me a story."), "max_tokens": 12}
    full = post(server, "/v1/chat/completions", {**body, "temperature": 0}).json()
    stream_body = {
        **body, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}
    }  # fmt: skip
    with httpx.stream(
        "POST", f"{server.base_url}/v1/chat/completions", json=stream_body, headers=AUTH, timeout=60
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["usage"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"]]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    text = "".join(ch["delta"].get("content", "") for c in chunks for ch in c["choices"])
    assert text == full["choices"][0]["message"]["content"]


def test_streaming_completion_openai_client(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL_NAME, prompt="The", max_tokens=6, stream=True,
        stream_options={"include_usage": True}, temperature=0,
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices
    assert chunks[-2].choices[0].finish_reason == "length"


def test_n_greater_than_one_streaming(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=chat(), max_tokens=5, n=3, stream=True, seed=1,
        stream_options={"include_usage": True},
    )  # fmt: skip
    texts: dict[int, str] = {}
    finished = set()
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2} and usage.completion_tokens == 15


def test_cached_tokens_on_repeated_prompt(client: openai.OpenAI) -> None:
    messages = chat(LONG_PROMPT)
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)
    second = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens > 100
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_logprobs(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=chat(), max_tokens=4, logprobs=True, top_logprobs=3
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    assert all(len(item.top_logprobs) == 3 and item.logprob <= 0 for item in content)
    completion = client.completions.create(model=MODEL_NAME, prompt="A", max_tokens=3, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == 3
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)


def test_stop_strings(server: Server, client: openai.OpenAI) -> None:
    kw = {"model": MODEL_NAME, "prompt": "Hello", "temperature": 0, "max_tokens": 24}
    text = client.completions.create(**kw).choices[0].text
    stop = text[8:11]
    assert len(stop) == 3, text
    expected = text[: text.index(stop)]
    stopped = client.completions.create(**kw, stop=[stop]).choices[0]
    assert stopped.text == expected and stopped.finish_reason == "stop"
    included = client.completions.create(
        **kw, stop=stop, extra_body={"include_stop_str_in_output": True}
    )
    assert included.choices[0].text == expected + stop
    streamed = client.completions.create(**kw, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected


def test_seeds(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        response = client.completions.create(
            model=MODEL_NAME, prompt="Seed", max_tokens=12, temperature=1.0, seed=seed
        )
        return response.choices[0].text

    assert sample(3) == sample(3)
    assert sample(3) != sample(4)


def test_vllm_extra_sampling_params(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL_NAME, prompt="x", max_tokens=6,
        extra_body={
            "top_k": 5, "min_p": 0.05, "min_tokens": 6, "ignore_eos": True,
            "repetition_penalty": 1.1, "stop_token_ids": [1], "skip_special_tokens": True,
        },
    )  # fmt: skip
    assert response.usage.completion_tokens == 6


def test_request_id_header_echoed(server: Server) -> None:
    body = {"model": MODEL_NAME, "messages": chat(), "max_tokens": 2}
    response = post(server, "/v1/chat/completions", body, headers={"X-Request-Id": "abc-123"})
    assert response.headers["x-request-id"] == "abc-123"
    assert response.json()["id"] == "chatcmpl-abc-123"
    generated = post(server, "/v1/chat/completions", body)
    assert generated.headers["x-request-id"] and generated.json()["id"].endswith(
        generated.headers["x-request-id"]
    )


def test_64_concurrent_streams(server: Server) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await client.chat.completions.create(
            model=MODEL_NAME, messages=chat(f"request {i}"), max_tokens=8, stream=True,
            stream_options={"include_usage": True}, temperature=0,
        )  # fmt: skip
        text, usage = "", None
        async for chunk in stream:
            usage = chunk.usage or usage
            text += "".join(c.delta.content or "" for c in chunk.choices)
        return text, usage.completion_tokens

    async def main() -> list[tuple[str, int]]:
        client = openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120
        )
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    start = time.monotonic()
    results = asyncio.run(main())
    assert len(results) == 64 and all(n == 8 for _, n in results)
    assert time.monotonic() - start < 120


# ---- disconnects -------------------------------------------------------------------------


def wait_idle(server: Server, baseline: float, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (
            metric(server, "num_requests_running") == 0
            and metric(server, "kv_cache_usage_perc") <= baseline
        ):
            return
        time.sleep(0.1)
    raise AssertionError("the engine did not return to idle after the client disconnected")


def test_stream_disconnect_frees_kv(server: Server) -> None:
    baseline = metric(server, "kv_cache_usage_perc")
    generated = metric(server, "generation_tokens_total")
    body = {
        "model": MODEL_NAME, "prompt": MEDIUM_PROMPT, "max_tokens": 300, "ignore_eos": True,
        "stream": True,
    }  # fmt: skip
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json=body, headers=AUTH, timeout=60
    ) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        assert metric(server, "num_requests_running") >= 1
        assert metric(server, "kv_cache_usage_perc") > baseline
    wait_idle(server, baseline)
    # aborted, not run to its 300 tokens
    assert metric(server, "generation_tokens_total") - generated < 300


def test_non_streaming_disconnect_frees_kv(server: Server) -> None:
    baseline = metric(server, "kv_cache_usage_perc")
    body = {"model": MODEL_NAME, "prompt": MEDIUM_PROMPT, "max_tokens": 300, "ignore_eos": True}
    generated = metric(server, "generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", body, timeout=httpx.Timeout(60, read=1.0))
    wait_idle(server, baseline)
    assert metric(server, "generation_tokens_total") - generated < 300
