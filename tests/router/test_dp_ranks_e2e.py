"""A real ``rackserve serve --data-parallel-size 2`` behind ``rackserve router`` on loopback
(tiny model, CPU), the router reading the engine's KV events: it learns the two ranks,
subscribes to each rank's events (rank r on the endpoint's port + r), spreads new sessions
over the ranks, sends a session's next turn to the rank that holds its prefix (the engine
reports the hit: the ranks' caches are separate, so the other rank would report none), and
the outputs at temperature 0 equal a direct request's. ~17 s on 2 busy cores (unmarked:
under the 20 s line); the pure and fake-engine forms: test_dp_ranks.py."""

from __future__ import annotations

import time

import httpx
import pytest

from rackserve.parallel.groups import free_port_block

from router_utils import running, start_engine, start_router

BLOCK_TOKENS = 32  # the tiny model's anchor block (test_kv_events_routing.py)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rackserve.model.create import create_checkpoint
    from rackserve.model.presets import tiny_config

    return create_checkpoint(tiny_config(), tmp_path_factory.mktemp("models") / "tiny")


def complete(base: str, prompt: str, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
    }  # fmt: skip
    r = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r


def test_dp2_engine_sessions_return_to_their_rank(tiny, tmp_path):
    events = f"tcp://127.0.0.1:{free_port_block(2)}"  # rank 1 publishes on the next port
    engine = start_engine(
        tiny, tmp_path, "--data-parallel-size", "2", "--kv-events-endpoint", events
    )
    router = start_router(
        tmp_path, "--engines", engine.url, "--policy", "kv-aware", "--kv-events", events,
        "--model", str(tiny),
    )  # fmt: skip
    with running(engine, router):
        assert httpx.get(f"{engine.url}/server_info").json() == {"data_parallel_size": 2}
        deadline = time.monotonic() + 30
        while f'engine="{engine.url}#rank1"' not in httpx.get(f"{router.url}/metrics").text:
            assert time.monotonic() < deadline, router.log()
            time.sleep(0.1)

        words = [f"w{i}" for i in range(50)]
        prompts = {s: f"session {s}: " + " ".join(words[s::3] * 4) for s in range(4)}
        first = {}
        for s, prompt in prompts.items():
            r = complete(router.url, prompt)
            data = r.json()
            first[s] = (r.headers["X-Routed-Rank"], data["choices"][0]["text"], data["usage"])
        assert {rank for rank, _, _ in first.values()} == {"0", "1"}  # new sessions spread
        time.sleep(1.0)  # the ranks' KV events reach the router

        # the control first: the other rank does not hold a session (a misrouted turn misses)
        rank, text, usage = first[0]
        other = {"X-data-parallel-rank": "1" if rank == "0" else "0"}
        r = complete(engine.url, prompts[0] + text + " a detour elsewhere.", other)
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        for s, (rank, text, usage) in first.items():
            second = prompts[s] + text + " and then the next tool call returned."
            r = complete(router.url, second)
            assert r.headers["X-Routed-To"] == engine.url
            assert r.headers["X-Routed-Rank"] == rank
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= usage["prompt_tokens"] // BLOCK_TOKENS * BLOCK_TOKENS > 0
            direct = complete(engine.url, second)  # the engine alone picks a rank
            assert r.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
        # the router expected those hits: both ranks' events arrived (without rank 1's, its
        # sessions would have looked uncached to the router and landed by rotation)
        expected = sum(
            u["prompt_tokens"] // BLOCK_TOKENS * BLOCK_TOKENS for *_, u in first.values()
        )
        metrics = httpx.get(f"{router.url}/metrics").text
        line = next(
            x for x in metrics.splitlines() if x.startswith("rackserve_router_expected_hit")
        )
        assert float(line.split()[-1]) >= expected > 0
