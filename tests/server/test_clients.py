"""Real third-party clients' exact requests, replayed: lm-eval's local-completions
(loglikelihood, rolling loglikelihood, generate_until) and guidellm's chat benchmark.

The bodies in tests/data were recorded from lm-eval 0.4.13 and guidellm 0.8.1 run against
this server (tests/server/helpers/record_lm_eval.py; guidellm through a recording proxy).
Both clients install from the registry, but pull in ~60 packages (datasets, pandas,
scikit-learn, uvloop, ...) that would change the server's own environment, so the suite
replays their bodies and applies lm-eval's own parsing rule to the answers."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from test_api import post, sse_events

from conftest import Server

DATA = Path(__file__).parents[1] / "data"


def lm_eval_parse_logprobs(response: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval's LocalCompletionsAPI.parse_logprobs: the continuation's summed logprob and
    whether every continuation token was the greedy one."""
    results = []
    choices = sorted(response["choices"], key=lambda c: c["index"])
    for choice, ctxlen in zip(choices, ctxlens, strict=True):
        logprobs = choice["logprobs"]
        token_logprobs = logprobs["token_logprobs"][ctxlen:-1]
        tops = logprobs["top_logprobs"][ctxlen:-1]
        greedy = all(lp == max(top.values()) for lp, top in zip(token_logprobs, tops, strict=True))
        results.append((sum(token_logprobs), greedy))
    return results


def test_lm_eval_requests(server: Server) -> None:
    recorded = json.loads((DATA / "lm_eval_requests.json").read_text())
    scored = 0
    for body in recorded["request_bodies"]:
        body = {**body, "model": "tiny"}
        response = post(server, "/v1/completions", body)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert len(answer["choices"]) == len(body["prompt"])
        if not body.get("echo"):  # generate_until
            assert all(isinstance(c["text"], str) for c in answer["choices"])
            continue
        for choice, prompt in zip(answer["choices"], body["prompt"], strict=True):
            assert len(choice["logprobs"]["token_logprobs"]) == len(prompt) + 1
        # lm-eval scores everything after the first token as one continuation
        parsed = lm_eval_parse_logprobs(answer, [1] * len(body["prompt"]))
        assert all(value < 0 and isinstance(greedy, bool) for value, greedy in parsed)
        scored += len(parsed)
    assert scored >= 4


def test_guidellm_requests(server: Server) -> None:
    recorded = json.loads((DATA / "guidellm_requests.json").read_text())
    for request in recorded["requests"]:
        body = {**request["body"], "model": "tiny"}
        with httpx.stream(
            "POST", f"{server.base_url}{request['path']}", json=body,
            headers={"Authorization": "Bearer test-key"}, timeout=60,
        ) as response:  # fmt: skip
            assert response.status_code == 200
            events = sse_events(response)
        assert events[-1] == "[DONE]"
        usages = [e["usage"] for e in events[:-1] if e.get("usage")]
        assert usages and usages[-1]["completion_tokens"] == body["max_completion_tokens"]
