"""An engine killed during a run, in process and fast (fake engines on raw sockets, the real
router app): requests that had not started streaming (not yet sent, or sent and waiting for
the response) are retried on another engine and succeed; streams already under way end
with a clear error event; nothing hangs. The same with real engine processes:
test_kv_aware.py::test_engine_killed_requests_retried (slow)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp

from rackserve.router.app import Router, RouterSettings
from rackserve.router.engines import EnginePool

from router_utils import free_port, serve_router_app

NUM_CHUNKS, CHUNK_S = 40, 0.05  # a stream lasts 2 s


class FakeEngine:
    """Speaks just enough HTTP: /health, and /v1/completions streaming NUM_CHUNKS SSE
    events (with ``hold``, prompt "hold" gets no response until the engine dies: a request
    queued there). :meth:`kill` drops every connection at once, as a crashed process would."""

    def __init__(self, hold: bool = False) -> None:
        self.hold = hold
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.writers: set[asyncio.StreamWriter] = set()
        self.num_requests = 0
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", self.port)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                lines = head.split("\r\n")
                length = next(
                    (int(x.split(":")[1]) for x in lines if x.lower().startswith("content-length")),
                    0,
                )
                body = json.loads(await reader.readexactly(length)) if length else {}
                if lines[0].startswith("GET /health"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    await writer.drain()
                    continue
                if lines[0].startswith("GET "):  # e.g. the router's /server_info: none here
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                self.num_requests += 1
                if self.hold and body.get("prompt") == "hold":
                    await asyncio.Event().wait()  # until killed
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n"
                )
                for i in range(NUM_CHUNKS):
                    event = f'data: {{"choices": [{{"text": "t{i}"}}]}}\n\n'.encode()
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                    await asyncio.sleep(CHUNK_S)
                done = b"data: [DONE]\n\n"
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
                await writer.drain()

    def kill(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.transport.abort()


async def stream(session: aiohttp.ClientSession, url: str, prompt: str) -> tuple[int, str, str]:
    body = {"model": "m", "prompt": prompt, "max_tokens": NUM_CHUNKS, "stream": True}
    async with session.post(f"{url}/v1/completions", json=body) as r:
        text = (await r.read()).decode()
        return r.status, r.headers.get("X-Routed-To", ""), text


async def scenario() -> None:
    engines = [FakeEngine(hold=True), FakeEngine()]
    for engine in engines:
        await engine.start()
    victim, survivor = engines
    pool = EnginePool([e.url for e in engines], "engine", "round-robin")
    # health checks far apart: the requests below meet the dead engine before they do
    router = Router(engines=pool, settings=RouterSettings(health_interval_s=30))
    runner, url = await serve_router_app(router)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
            # one at a time, so round-robin places them: p0, p2, hold on the victim
            tasks = []
            for i, prompt in enumerate(["p0", "p1", "p2", "p3", "hold"]):
                tasks.append(asyncio.create_task(stream(session, url, prompt)))
                while victim.num_requests + survivor.num_requests <= i:
                    await asyncio.sleep(0.01)
            assert (victim.num_requests, survivor.num_requests) == (3, 2)
            await asyncio.sleep(0.2)  # every stream has sent some chunks
            victim.kill()
            late = [asyncio.create_task(stream(session, url, f"q{i}")) for i in range(4)]
            results = await asyncio.wait_for(asyncio.gather(*tasks, *late), 15)
    finally:
        await runner.cleanup()
        survivor.kill()

    finished = [r for r in results if r[2].rstrip().endswith("data: [DONE]")]
    broken = [r for r in results if "failed mid-stream" in r[2]]
    assert len(finished) + len(broken) == len(results)  # each ends one way or the other
    # started on the victim: a clear error event, and the stream ends
    assert len(broken) == 2 and all(r[1] == victim.url for r in broken)
    assert all('"error"' in r[2] and not r[2].rstrip().endswith("[DONE]") for r in broken)
    # not started (held without a response, or sent after the kill): retried, complete
    assert all(r[0] == 200 and r[1] == survivor.url for r in finished)
    assert len(finished) == 2 + 1 + 4
    assert not pool.engines[0].up and pool.engines[1].up
    assert router.retries._value.get() >= 1


def test_engine_killed_mid_run_loses_no_request_that_had_not_started():
    asyncio.run(asyncio.wait_for(scenario(), 30))
