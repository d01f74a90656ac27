"""4 engines behind the router: agent sessions (next prompt = prompt + output + new text)
hit the cache under kv-aware routing and mostly miss under round-robin; an engine killed
mid-run loses no request that had not started."""

from __future__ import annotations

import concurrent.futures
import random

import httpx
import pytest

from router_utils import running, start_engine, start_router


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rackserve.model.create import create_checkpoint
    from rackserve.model.presets import tiny_config

    return create_checkpoint(tiny_config(), tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def engines(tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engines")
    procs = [start_engine(tiny, tmp) for _ in range(4)]
    with running(*procs):
        yield list(procs)


def run_sessions(base: str, num_sessions: int, num_turns: int, seed: int, workers: int = 8) -> dict:
    """Returns prompt tokens, cached tokens and the theoretical reusable tokens (turn k+1
    could reuse turn k's prompt and output), over all turns. ``workers`` sessions are in
    flight at once; with 1 the engines see one order, so the hit rates repeat exactly."""
    rng = random.Random(seed)
    words = [f"w{seed}x{i}" for i in range(300)]

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    prompts = {s: f"session {seed}-{s}: " + text(40) for s in range(num_sessions)}
    totals = {"prompt": 0, "cached": 0, "reusable": 0}
    previous: dict[int, int] = {}

    def turn(s: int) -> tuple[int, str, dict]:
        body = {
            "model": "tiny", "prompt": prompts[s], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "user": f"s{s}",
        }  # fmt: skip
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        data = r.json()
        return s, data["choices"][0]["text"], data["usage"]

    for _ in range(num_turns):
        # A new order each turn: in a fixed one, round-robin over 4 engines would send
        # session s to engine s % 4 every turn (32 % 4 == 0), i.e. act as session affinity.
        order = rng.sample(range(num_sessions), num_sessions)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            results = list(pool.map(turn, order))
        for s, output, usage in results:
            totals["prompt"] += usage["prompt_tokens"]
            totals["cached"] += usage["prompt_tokens_details"]["cached_tokens"]
            totals["reusable"] += previous.get(s, 0)
            previous[s] = usage["prompt_tokens"] + usage["completion_tokens"]
            prompts[s] += output + " " + text(rng.randint(4, 10))
    return totals


def check_policies(engines, tmp_path, num_sessions: int, num_turns: int, workers: int = 8) -> dict:
    urls = ",".join(e.url for e in engines)
    rates = {}
    for seed, policy in enumerate(("kv-aware", "round-robin")):
        router = start_router(tmp_path, "--engines", urls, "--policy", policy)
        with running(router):
            totals = run_sessions(router.url, num_sessions, num_turns, seed, workers)
        rates[policy] = totals["cached"] / totals["prompt"]
        rates["theoretical"] = totals["reusable"] / totals["prompt"]
    print("hit rates:", rates)
    assert rates["kv-aware"] >= 0.8 * rates["theoretical"]
    assert rates["round-robin"] < 0.6 * rates["kv-aware"]
    return rates


def test_kv_aware_beats_round_robin(engines, tmp_path):
    # one request at a time: with 8 in flight, the order they reach round-robin varies, and
    # over 24 reusable turns its hit rate spread past the margin (0.40 against a limit of
    # 0.39, CI 2026-12-02); the concurrent form is the 32-session one
    check_policies(engines, tmp_path, num_sessions=8, num_turns=4, workers=1)


@pytest.mark.slow
def test_kv_aware_beats_round_robin_32_sessions(engines, tmp_path):
    rates = check_policies(engines, tmp_path, num_sessions=32, num_turns=6)
    assert rates["kv-aware"] >= 0.9 * rates["theoretical"]


# ~22 s (kills and restarts an engine); routing around a down engine is covered without
# processes by test_policies.py::test_pool_routes_sessions_to_their_prefix_and_around_down_engines
@pytest.mark.slow
def test_engine_killed_requests_retried(engines, tmp_path, tiny):
    """Kill one engine: requests not started go elsewhere (none fails); the router marks
    it down and takes it back once a new engine listens on its port."""
    urls = ",".join(e.url for e in engines)
    router = start_router(tmp_path, "--engines", urls, "--policy", "round-robin")
    with running(router):
        victim = engines[1]
        victim.kill()
        body = {"model": "tiny", "prompt": "hello there", "max_tokens": 4, "temperature": 0}
        for _ in range(8):
            r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.headers["X-Routed-To"] != victim.url
        port = int(victim.url.rsplit(":", 1)[1])
        engines[1] = start_engine(tiny, tmp_path, port=port)
        with running(engines[1]):
            import time

            deadline = time.monotonic() + 30
            routed = set()
            while victim.url not in routed and time.monotonic() < deadline:
                r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
                assert r.status_code == 200
                routed.add(r.headers["X-Routed-To"])
                time.sleep(0.1)
            assert victim.url in routed  # accepted back
