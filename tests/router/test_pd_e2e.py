"""1 prefill + 1 decode + router as real processes, against one aggregated engine at
temperature 0: mixed requests (shared prefixes, streamed and not, n > 1, stop strings, chat
and completions); then the prefill engine killed (recompute) and the router's errors."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest

from rackserve.parallel.groups import free_port

from router_utils import kv_config, running, start_engine, start_router


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rackserve.model.create import create_checkpoint
    from rackserve.model.presets import tiny_config

    return create_checkpoint(tiny_config(), tmp_path_factory.mktemp("models") / "tiny")


WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
]


def mixed_requests(num: int) -> list[tuple[str, dict]]:
    shared = " ".join(WORDS * 6)
    out = []
    for i in range(num):
        tail = " ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(5 + 7 * (i % 5)))
        text = f"{shared} {tail}" if i % 2 else tail
        body: dict = {"model": "tiny", "temperature": 0, "max_tokens": 8 + i % 7}
        if i % 4 == 3:
            body["stop"] = [" the", "e"]
        if i % 5 == 4:
            body["n"] = 2
        if i % 6 == 2:  # the first token's logprobs come from the prefill engine
            body.update({"logprobs": True, "top_logprobs": 2} if i % 2 else {"logprobs": 2})
        if i % 7 == 3:
            body["min_tokens"] = 3
        body["stream"] = i % 3 == 1
        if i % 2:
            out.append(
                ("/v1/chat/completions", dict(body, messages=[{"role": "user", "content": text}]))
            )
        else:
            out.append(("/v1/completions", dict(body, prompt=text)))
    return out


def _logprobs(c: dict) -> list:
    """A choice's (token, logprob, top tokens) per position (chat or completion)."""
    lp = c.get("logprobs")
    if not lp:
        return []
    if "content" in lp:  # chat
        return [
            (e["token"], e["logprob"], [t["token"] for t in e["top_logprobs"]])
            for e in lp["content"]
        ]
    return [
        (t, v, sorted(top)) for t, v, top in
        zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)
    ]  # fmt: skip


def call(base: str, path: str, body: dict) -> dict:
    """Texts per choice index, finish reasons, logprobs and usage (streamed or not)."""
    if not body.get("stream"):
        r = httpx.post(base + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        data = r.json()
        texts = {
            c["index"]: c["message"]["content"] if "message" in c else c["text"]
            for c in data["choices"]
        }
        reasons = {c["index"]: c["finish_reason"] for c in data["choices"]}
        logprobs = {c["index"]: _logprobs(c) for c in data["choices"]}
        return {"texts": texts, "reasons": reasons, "logprobs": logprobs, "usage": data["usage"]}
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    logprobs: dict[int, list] = {}
    with httpx.stream("POST", base + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                piece = c["delta"].get("content") if "delta" in c else c.get("text")
                texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
                logprobs.setdefault(c["index"], []).extend(_logprobs(c))
                if c.get("finish_reason"):
                    reasons[c["index"]] = c["finish_reason"]
    return {"texts": texts, "reasons": reasons, "logprobs": logprobs}


def run_all(base: str, requests: list[tuple[str, dict]]) -> list[dict]:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda pb: call(base, *pb), requests))


def strip_usage(results: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "usage"} for r in results]


LOGPROB_TOLERANCE = 1e-3  # a decode step batched otherwise moves a logprob by ~1e-6


def assert_same_results(got: list[dict], want: list[dict]) -> None:
    """Texts, finish reasons and logprob tokens equal; logprob values within
    ``LOGPROB_TOLERANCE`` (equality to 4 places failed where a value sat on a rounding
    boundary: -5.47865 +- 1e-6, from steps batched differently on each side)."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(strip_usage(got), strip_usage(want), strict=True)):
        where = f"request {i}"
        assert g["texts"] == w["texts"] and g["reasons"] == w["reasons"], where
        assert g["logprobs"].keys() == w["logprobs"].keys(), where
        for index, entries in w["logprobs"].items():
            mine = g["logprobs"][index]
            assert [(t, top) for t, _, top in mine] == [(t, top) for t, _, top in entries], where
            for (_, a, _), (_, b, _) in zip(mine, entries, strict=True):
                assert abs(a - b) <= LOGPROB_TOLERANCE, (where, a, b)
        assert {k: v for k, v in g.items() if k != "logprobs"} == {
            k: v for k, v in w.items() if k != "logprobs"
        }, where


@pytest.fixture(scope="module")
def pd(tiny, tmp_path_factory):
    """A prefill and a decode engine shared by the module (the kill test runs last)."""
    tmp = tmp_path_factory.mktemp("pd")
    prefill = start_engine(tiny, tmp, "--kv-transfer-config", kv_config("kv_producer"))
    decode = start_engine(tiny, tmp, "--kv-transfer-config", kv_config("kv_consumer"))
    with running(prefill, decode):
        yield prefill, decode


def check_pd_equals_aggregated(tiny, tmp_path, pd, num: int) -> None:
    prefill, decode = pd
    aggregated = start_engine(tiny, tmp_path)
    router = start_router(tmp_path, "--prefill", prefill.url, "--decode", decode.url)
    overlap = start_router(
        tmp_path, "--prefill", prefill.url, "--decode", decode.url, "--overlap-transfer"
    )
    with running(aggregated, router, overlap):
        requests = mixed_requests(num)
        want = run_all(aggregated.url, requests)
        got = run_all(router.url, requests)
        assert_same_results(got, want)
        metrics = httpx.get(f"{router.url}/metrics").text
        assert 'rackserve_router_kv_source_total{source="prefill=' in metrics
        # where TTFT goes outside the engines: every request's prefill step and first byte
        counts = {
            line.split()[0]: float(line.split()[-1]) for line in metrics.splitlines()
            if line.startswith(("rackserve_router_prefill_seconds_count",
                                "rackserve_router_first_byte_seconds_count"))
        }  # fmt: skip
        assert counts["rackserve_router_prefill_seconds_count"] >= 1
        assert counts['rackserve_router_first_byte_seconds_count{role="decode"}'] == len(requests)
        received = [
            line for line in httpx.get(f"{decode.url}/metrics").text.splitlines()
            if line.startswith("rackserve:kv_transfer_bytes_received_total")
        ]  # fmt: skip
        assert received and float(received[0].split()[-1]) > 0
        # cached_tokens as one aggregated engine reports them (the rule: router/app.py)
        cached = cached_tokens_phase(aggregated.url, router.url)
        print("cached_tokens (aggregated, router):", cached)
        assert [got for _, got in cached] == [want for want, _ in cached]
        assert sum(want for want, _ in cached) > 0  # hits happened: the check means something
        # --overlap-transfer: decode requests go out with the prefill ones (after the first,
        # which teaches the router the prefill engine's KV address); same tokens, same hits
        got = run_all(overlap.url, requests)
        assert_same_results(got, want)
        cached = cached_tokens_phase(aggregated.url, overlap.url, COLOURS[::-1])
        assert [got for _, got in cached] == [want for want, _ in cached]
        metrics = httpx.get(f"{overlap.url}/metrics").text
        assert "(overlapped)" in metrics


COLOURS = ["red", "green", "blue", "cyan", "magenta", "yellow", "black", "white", "grey"]


def cached_tokens_phase(
    aggregated: str, router: str, words: list[str] = COLOURS
) -> list[tuple[int, int]]:
    """Agent-like turns sent one at a time (hits do not depend on timing): two chat
    conversations of three turns (each turn = the history + the reply + new text), a
    completion repeated and extended, an n=2 request on a shared prefix. Returns
    (aggregated, router) cached_tokens per request."""
    base = " ".join(words * 8)
    out = []
    for conv in range(2):
        messages = [{"role": "user", "content": f"{conv} {base}"}]
        for turn in range(3):
            body = {"model": "tiny", "temperature": 0, "max_tokens": 6, "messages": messages}
            want = httpx.post(f"{aggregated}/v1/chat/completions", json=body, timeout=120).json()
            got = httpx.post(f"{router}/v1/chat/completions", json=body, timeout=120).json()
            assert got["choices"] == want["choices"]
            out.append((_cached(want), _cached(got)))
            reply = want["choices"][0]["message"]["content"]
            more = " ".join(words[turn:] * 3)
            messages = [*messages, {"role": "assistant", "content": reply},
                        {"role": "user", "content": more}]  # fmt: skip
    prompt = f"{base} {base}"
    for body in (
        {"prompt": prompt},
        {"prompt": prompt},  # a repeat
        {"prompt": f"{prompt} {base}"},  # an extension
        {"prompt": f"{prompt} white red", "n": 2},
    ):
        body = dict(body, model="tiny", temperature=0, max_tokens=5)
        want = httpx.post(f"{aggregated}/v1/completions", json=body, timeout=120).json()
        got = httpx.post(f"{router}/v1/completions", json=body, timeout=120).json()
        assert got["choices"] == want["choices"]
        out.append((_cached(want), _cached(got)))
    return out


def _cached(response: dict) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_pd_equals_aggregated(tiny, tmp_path, pd):
    check_pd_equals_aggregated(tiny, tmp_path, pd, 16)


@pytest.mark.slow
def test_pd_equals_aggregated_64(tiny, tmp_path, pd):
    check_pd_equals_aggregated(tiny, tmp_path, pd, 64)


def test_prefill_answer_carries_the_first_token(pd):
    """The prefill engine's answer names the token it sampled (with its logprobs when asked)
    for the decode side to emit; n > 1 carries none (each completion samples its own). A
    decode engine refuses a malformed or out-of-vocabulary one with a 400."""
    prefill, decode = pd
    body = {"model": "tiny", "prompt": "alpha beta gamma delta", "max_tokens": 1,
            "temperature": 0, "logprobs": 2}  # fmt: skip
    params = {"do_remote_decode": True, "transfer_id": "carry"}
    r = httpx.post(f"{prefill.url}/v1/completions", timeout=60,
                   json=body | {"kv_transfer_params": params})  # fmt: skip
    assert r.status_code == 200, r.text
    answer = r.json()["kv_transfer_params"]
    (token,) = answer["first_token_ids"]
    (entry,) = answer["first_logprobs"]
    assert entry["token_ids"][0] == token and len(entry["token_ids"]) == 3
    assert entry["rank"] >= 1 and entry["logprobs"][0] <= 0
    fan_out = params | {"transfer_id": "fan-out", "num_consumers": 2}
    r = httpx.post(
        f"{prefill.url}/v1/completions", timeout=60, json=body | {"kv_transfer_params": fan_out}
    )
    assert r.status_code == 200 and "first_token_ids" not in r.json()["kv_transfer_params"]
    without_logprobs = {k: v for k, v in answer.items() if k != "first_logprobs"}
    for bad, needle in (([1 << 40], "first_token_ids must be in [0,"),
                        (["x"], "first_token_ids must be a list of token ids"),
                        ([1, 2], "must be one token id")):  # fmt: skip
        r = httpx.post(
            f"{decode.url}/v1/completions",
            timeout=60,
            json=body | {"kv_transfer_params": without_logprobs | {"first_token_ids": bad}},
        )
        assert r.status_code == 400, r.text
        assert needle in r.json()["error"]["message"]
    r = httpx.post(f"{decode.url}/v1/completions", timeout=60,
                   json=body | {"n": 2, "kv_transfer_params": without_logprobs})  # fmt: skip
    assert r.status_code == 400 and "needs one prompt and n = 1" in r.json()["error"]["message"]


def chunks(base: str, path: str, body: dict) -> list[dict]:
    """Every chunk of a streamed response, parsed ([DONE] last, checked)."""
    with httpx.stream("POST", base + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_streamed_first_token_comes_from_the_prefill_answer(tiny, tmp_path, pd):
    """The router sends a streamed request's first chunks from the prefill engine's answer
    (router/first_token.py): chunk for chunk what one aggregated engine streams (one id
    throughout), logprobs, usage and a first token that ends the request included; the
    switch turns it off."""
    prefill, decode = pd
    aggregated = start_engine(tiny, tmp_path)
    router = start_router(tmp_path, "--prefill", prefill.url, "--decode", decode.url)
    plain = start_router(tmp_path, "--prefill", prefill.url, "--decode", decode.url,
                         "--no-first-token-from-prefill")  # fmt: skip
    base = {"model": "tiny", "temperature": 0, "stream": True, "ignore_eos": True}
    usage = {"stream_options": {"include_usage": True}}

    def requests(word: str) -> list[tuple[str, dict]]:  # new prompts: no prefix hits
        return [
            ("/v1/completions", base | usage | {"prompt": f"orbit {word} " * 9, "max_tokens": 6,
                                                 "logprobs": 2}),
            ("/v1/completions", base | {"prompt": [len(word), *range(40, 95)], "max_tokens": 5,
                                        "logprobs": 0}),
            ("/v1/chat/completions", base | usage | {
                "messages": [{"role": "user", "content": f"nebula {word} " * 7}],
                "max_tokens": 6, "logprobs": True, "top_logprobs": 2}),
            ("/v1/chat/completions", base | {
                "messages": [{"role": "user", "content": f"pulsar {word} " * 6}],
                "max_tokens": 4}),
        ]  # fmt: skip

    with running(aggregated, router, plain):
        for proxy, word in ((router, "comet"), (plain, "quasar")):
            for path, body in requests(word):
                want = chunks(aggregated.url, path, body)
                got = chunks(proxy.url, path, body)
                assert len({c["id"] for c in got}) == 1, "one id throughout"
                assert [c["choices"] for c in got] == [c["choices"] for c in want]
                assert [c.get("usage") for c in got] == [c.get("usage") for c in want]
        # t1 ends the request: its text and logprobs come early, its reason after
        body = base | {"prompt": "meteor " * 10, "max_tokens": 1, "logprobs": 1}
        want = [c["choices"][0] for c in chunks(aggregated.url, "/v1/completions", body)]
        got = [c["choices"][0] for c in chunks(router.url, "/v1/completions", body)]
        assert len(want) == 1 and len(got) == 2
        assert got[0] == want[0] | {"finish_reason": None, "stop_reason": None}
        assert got[1] == want[0] | {"text": "", "logprobs": None}

        def early(proxy) -> float:
            name = "rackserve_router_first_tokens_from_prefill_total"
            lines = httpx.get(f"{proxy.url}/metrics").text.splitlines()
            return next(float(x.split()[-1]) for x in lines if x.startswith(name))

        # the three with logprobs and the final one, at least (t1 of the fourth may decode
        # to no text: then the decode side's stream goes whole)
        assert early(router) >= 4
        assert early(plain) == 0


def test_router_errors(tmp_path):
    router = start_router(tmp_path, "--engines", "http://127.0.0.1:9")  # nothing listens
    with _no_wait(router):
        r = httpx.post(f"{router.url}/v1/completions", content=b"{bad", timeout=10)
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
        r = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 503 and "no engine could take" in r.json()["error"]["message"]


class _no_wait:
    """The router has no healthy engine here: wait for it to listen, not to be healthy."""

    def __init__(self, proc):
        self.proc = proc

    def __enter__(self):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{self.proc.url}/health", timeout=1)
                return self.proc
            except httpx.HTTPError:
                time.sleep(0.2)
        raise AssertionError(self.proc.log())

    def __exit__(self, *exc):
        self.proc.stop()


def test_prefill_killed_requests_recompute(tmp_path, pd):
    """The prefill engine dies: the router marks it down, the decode side computes the
    prompts itself; outputs unchanged; the decode engine's KV returns to idle."""
    prefill, decode = pd
    router = start_router(tmp_path, "--prefill", prefill.url, "--decode", decode.url)
    with running(router):
        requests = mixed_requests(4)
        want = run_all(router.url, requests)
        prefill.kill()
        start = time.monotonic()
        got = run_all(router.url, requests)
        assert time.monotonic() - start < 60
        assert_same_results(got, want)
        health = httpx.get(f"{router.url}/health")
        assert health.status_code == 503 and "prefill" in health.json()["error"]["message"]
        usage = [
            line for line in httpx.get(f"{decode.url}/metrics").text.splitlines()
            if line.startswith("rackserve:kv_cache_usage_perc")
        ]  # fmt: skip
        assert float(usage[0].split()[-1]) == 0.0


def test_failed_kv_load_is_a_server_error(tiny, tmp_path):
    """Under kv_load_failure_policy "fail" a request whose prefill engine cannot be reached
    ends with a 500 naming the cause and the policy that would have recomputed it (the
    input was fine: not a 400); the engine serves the next request and its KV is idle."""
    dead = free_port()  # nothing listens there
    decode = start_engine(
        tiny, tmp_path, "--kv-transfer-config",
        kv_config("kv_consumer", kv_load_failure_policy="fail"),
    )  # fmt: skip
    with running(decode):
        params = {"do_remote_prefill": True, "transfer_id": "gone", "remote_host": "127.0.0.1",
                  "remote_port": dead}  # fmt: skip
        body = {"model": "tiny", "prompt": "the prefill side is gone", "max_tokens": 4}
        r = httpx.post(f"{decode.url}/v1/completions", json=body | {"kv_transfer_params": params},
                       timeout=60)  # fmt: skip
        assert r.status_code == 500, r.text
        message = r.json()["error"]["message"]
        assert "KV transfer from the prefill engine failed" in message and "recompute" in message
        r = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        usage = [
            line for line in httpx.get(f"{decode.url}/metrics").text.splitlines()
            if line.startswith("rackserve:kv_cache_usage_perc")
        ]  # fmt: skip
        assert float(usage[0].split()[-1]) == 0.0
