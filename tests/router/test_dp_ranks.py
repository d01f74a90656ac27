"""The router over the data-parallel ranks of engines, fast: candidate expansion and
picking (pure), the real router app over fake engines (one DP-1 without /server_info, one
of DP size 2), and a rank's KV events feeding its own candidate. With a real DP=2 engine:
test_dp_ranks_e2e.py (slow)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from rackserve.kv.events import BlockStored, KVEventPublisher, rank_endpoint
from rackserve.router.app import Router, RouterSettings
from rackserve.router.engines import EnginePool, fetch_dp_size
from rackserve.router.kv_index import EventSubscriber, KVIndex

from router_utils import free_port, serve_router_app

RANK = "X-data-parallel-rank"


def session_prompt(name: str, turns: int) -> str:
    """An agent session's prompt after ``turns`` turns: each turn extends the last."""
    return "".join(
        f"[{name} turn {t}] " + f"{name} says something long. " * 8 for t in range(turns)
    )


def test_candidates_expand_per_rank_and_a_prefix_returns_to_its_rank():
    pool = EnginePool(["http://a", "http://b/"], "engine", "kv-aware")
    assert [e.label for e in pool.engines] == ["http://a", "http://b"]
    assert pool.set_dp_size("http://a", 1) == []
    assert pool.set_dp_size("http://b", 2) == [2]
    assert [e.label for e in pool.engines] == ["http://a", "http://b#rank0", "http://b#rank1"]
    assert [e.headers for e in pool.engines] == [{}, {RANK: "0"}, {RANK: "1"}]
    assert pool.set_dp_size("http://b", 2) == []  # known: nothing added
    assert len(pool.index.device) == 3  # the index grew with the candidates
    with pytest.raises(ValueError, match="must be >= 1"):
        pool.set_dp_size("http://b", 0)
    with pytest.raises(ValueError, match="not one of"):
        pool.set_dp_size("http://c", 2)
    with pytest.raises(ValueError, match="repeat"):
        EnginePool(["http://a", "http://a/"], "engine", "kv-aware")

    # Three new sessions spread over the three candidates; each later turn (the prompt
    # extended) goes back to the candidate that holds its prefix, whatever the rotation.
    first = {}
    for name in "PQR":
        choice = pool.choose({"prompt": session_prompt(name, 1)}, None, set())
        pool.start(choice, None)
        pool.finish(choice)
        first[name] = choice.index
    assert sorted(first.values()) == [0, 1, 2]
    for turns in (2, 3):
        for name in "PQR":
            choice = pool.choose({"prompt": session_prompt(name, turns)}, None, set())
            assert choice.index == first[name] and choice.hit_units > 0
            pool.start(choice, None)
            pool.finish(choice)

    # Load is per rank: work in flight on b#rank1 sends a new session elsewhere.
    busy = pool.choose({"prompt": session_prompt("S", 1)}, None, set())
    pool.start(busy, None)
    other = pool.choose({"prompt": session_prompt("T", 1)}, None, set())
    assert other.index != busy.index
    pool.finish(busy)

    # One HTTP server for both ranks: a failed request takes both down, not the DP-1 one.
    pool.mark_down(2, "connection refused")
    assert [e.up for e in pool.engines] == [True, False, False]
    assert pool.choose({"prompt": session_prompt("R", 4)}, None, set()).index == 0
    # restarted with DP 1: rank 1 is retired (its header would be refused), rank 0 stays
    for e in pool.engines:
        e.up = True
    pool.set_dp_size("http://b", 1)
    assert [(e.up, e.retired) for e in pool.engines] == [
        (True, False),
        (True, False),
        (False, True),
    ]


class FakeEngine:
    """/health, /server_info (``dp_size``; None: no such route, an older server) and
    /v1/completions answering which rank the header pinned it to."""

    def __init__(self, dp_size: int | None) -> None:
        self.dp_size = dp_size
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.received: list[tuple[str, str | None]] = []  # (prompt, rank header)
        self.runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self.health)
        if self.dp_size is not None:
            app.router.add_get("/server_info", self.server_info)
        app.router.add_post("/v1/completions", self.completions)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"data_parallel_size": self.dp_size})

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        rank = request.headers.get(RANK)
        if rank is not None and not 0 <= int(rank) < (self.dp_size or 1):
            return web.json_response({"error": {"message": "bad rank"}}, status=400)
        self.received.append((body["prompt"], rank))
        return web.json_response({"choices": [{"text": f"rank {rank}"}]})


async def router_scenario() -> None:
    a, b = FakeEngine(None), FakeEngine(2)
    await a.start()
    await b.start()
    pool = EnginePool([a.url, b.url], "engine", "kv-aware")
    router = Router(engines=pool, settings=RouterSettings(health_interval_s=0.05))
    runner, url = await serve_router_app(router)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            timeout = aiohttp.ClientTimeout(total=2)
            assert await fetch_dp_size(session, a.url, timeout) == 1  # 404: one candidate
            assert await fetch_dp_size(session, b.url, timeout) == 2
            nobody = f"http://127.0.0.1:{free_port()}"
            assert await fetch_dp_size(session, nobody, timeout) is None  # asked again later
            for _ in range(200):  # the health loop learns the sizes
                if len(pool.engines) == 3:
                    break
                await asyncio.sleep(0.01)
            assert pool.dp_sizes == {a.url: 1, b.url: 2}

            async def send(prompt: str) -> tuple[str, str | None, str]:
                body = {"model": "m", "prompt": prompt, "max_tokens": 1}
                async with session.post(f"{url}/v1/completions", json=body) as r:
                    assert r.status == 200
                    text = (await r.json())["choices"][0]["text"]
                    return r.headers["X-Routed-To"], r.headers.get("X-Routed-Rank"), text

            first = {name: await send(session_prompt(name, 1)) for name in "PQR"}
            assert set(first.values()) == {
                (a.url, None, "rank None"), (b.url, "0", "rank 0"), (b.url, "1", "rank 1"),
            }  # fmt: skip
            for name in "PQR":
                assert await send(session_prompt(name, 2)) == first[name]
    finally:
        await runner.cleanup()
        for engine in (a, b):
            assert engine.runner is not None
            await engine.runner.cleanup()
    # the DP-1 engine never saw the header; the DP engine saw each turn pinned to its rank
    assert {rank for _, rank in a.received} == {None}
    assert sorted(rank for _, rank in b.received) == ["0", "0", "1", "1"]


def test_router_pins_each_session_to_its_rank_over_http():
    asyncio.run(router_scenario())


def test_rank_kv_events_feed_the_ranks_candidate():
    base = f"tcp://127.0.0.1:{free_port()}"
    rank1 = rank_endpoint(base, 1)
    assert rank1 == base.rsplit(":", 1)[0] + f":{int(base.rsplit(':', 1)[1]) + 1}"
    publishers = [KVEventPublisher(base, "e-r0"), KVEventPublisher(rank1, "e-r1")]
    index = KVIndex(1)
    subscriber = EventSubscriber(index, [base])
    pool = EnginePool(["http://e"], "engine", "kv-aware", index=index, approximate=False)
    pool.on_new_rank = lambda i, url, rank: subscriber.add(rank_endpoint(base, rank), i)
    try:
        assert pool.set_dp_size("http://e", 2) == [1]
        h = [b"h0", b"h1"]
        deadline = time.monotonic() + 10
        # PUB drops batches until a subscription arrives: publish until the index has them
        while index.match(1, h) != (2, 0) or index.match(0, h[:1]) != (1, 0):
            assert time.monotonic() < deadline, "rank events never reached their candidate"
            publishers[0].publish([BlockStored(h[:1], None, 32, "device")])
            publishers[1].publish([BlockStored(h, None, 64, "device")])
            time.sleep(0.05)
        assert index.match(0, h) == (1, 0)  # rank 0 holds only h0: nothing crossed over
        assert index.engine_ids == ["e-r0", "e-r1"]
    finally:
        subscriber.close()
        for publisher in publishers:
            publisher.close()
