"""The engines behind the router: health, load, and the choice of one for a request.

A routing candidate is an engine URL, or one data-parallel rank of it: the router asks each
engine's ``/server_info`` for its DP size once it is healthy, and an engine of DP size N
becomes N candidates ``(url, rank)`` with their own load, KV index and session affinity; a
request routed to one carries ``X-data-parallel-rank: rank`` (the server pins it there).
A DP-1 engine (or one that does not say) stays one candidate and gets no header::

    --engines A,B   (A: DP 1, B: DP 2)  ->  candidates [A, B#rank0, B#rank1]
                                            (B#rank1 appended when learned: indices stay)

An engine is marked down when a request cannot reach it or its /health fails, and up again
when /health answers 200 (a restarted engine's cache is empty: the approximate index
forgets it). Load is what the router itself has in flight there (requests and prompt
units, known at once), which a polled /metrics would only show a moment later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from rackserve.router.kv_index import KVIndex, TextKeyer, TokenKeyer
from rackserve.router.policies import Candidate, pick

logger = logging.getLogger(__name__)
MAX_SESSIONS = 100_000
DATA_PARALLEL_RANK_HEADER = "X-data-parallel-rank"  # server/api.py's (vLLM's) header


@dataclass
class Engine:
    url: str
    role: str  # "prefill", "decode" or "engine" (aggregated)
    rank: int | None = None  # the DP rank requests are pinned to; None: no header
    up: bool = True
    retired: bool = False  # a rank the engine no longer has (restarted with fewer)
    inflight: int = 0
    load_units: int = 0  # prompt units in flight there the engine has to compute
    num_routed: int = 0
    num_failures: int = 0

    @property
    def label(self) -> str:
        """The candidate's name in logs and metrics."""
        return self.url if self.rank is None else f"{self.url}#rank{self.rank}"

    @property
    def headers(self) -> dict[str, str]:
        """What a request routed here adds: the DP rank that serves it."""
        return {} if self.rank is None else {DATA_PARALLEL_RANK_HEADER: str(self.rank)}


@dataclass
class Choice:
    engine: Engine
    index: int
    units: int  # prompt size in the keyer's units (tokens or characters)
    hit_units: int = 0
    keys: list[bytes] = field(default_factory=list)

    @property
    def prefill_units(self) -> int:
        """The part of the prompt the engine is expected to compute (its load while the
        request is in flight): cached tokens cost it next to nothing."""
        return max(0, self.units - self.hit_units)


class EnginePool:
    """Engines of one role, their KV index and the routing policy."""

    def __init__(
        self,
        urls: list[str],
        role: str,
        policy: str,
        keyer: TextKeyer | TokenKeyer | None = None,
        index: KVIndex | None = None,
        approximate: bool = True,
        load_weight: float = 0.5,
    ) -> None:
        if not urls:
            raise ValueError(f"no {role} engine URLs given")
        if len({url.rstrip("/") for url in urls}) != len(urls):
            raise ValueError(f"{role} engine URLs repeat: {urls} (a DP engine is listed once)")
        self.engines = [Engine(url.rstrip("/"), role) for url in urls]
        self.role = role
        self.policy = policy
        self.keyer = keyer or TextKeyer()
        self.index = index or KVIndex(len(urls))
        self.approximate = approximate  # no KV events: record what we route
        self.load_weight = load_weight
        self.sessions: OrderedDict[str, int] = OrderedDict()
        self.turn = 0
        self.dp_sizes: dict[str, int] = {}  # URL -> DP size, once learned
        # called (candidate index, url, rank) for each rank candidate added (KV events)
        self.on_new_rank: Callable[[int, str, int], None] | None = None

    @property
    def any_up(self) -> bool:
        return any(e.up for e in self.engines)

    def choose(self, body: dict[str, Any], session: str | None, exclude: set[int]) -> Choice:
        """The engine for ``body`` among the healthy ones not in ``exclude``; ValueError
        when there is none."""
        ids = [i for i, e in enumerate(self.engines) if e.up and i not in exclude]
        if not ids:
            raise ValueError(f"no healthy {self.role} engine")
        keys: list[bytes] = []
        units, block = 0, 1
        if self.policy == "kv-aware":
            try:
                keys, block = self.keyer.keys(body)
            except Exception as e:  # an odd body routes by load, and fails at the engine
                logger.info("could not key a request for kv-aware routing: %s", e)
            units = max(len(keys) * block, 1)
        candidates = []
        for i in ids:
            engine = self.engines[i]
            device, pool = self.index.match(i, keys) if keys else (0, 0)
            candidates.append(
                Candidate(i, engine.load_units, engine.inflight, device * block, pool * block)
            )
        session_engine = self.sessions.get(session) if session else None
        chosen = pick(self.policy, candidates, units, self.turn, session_engine, self.load_weight)
        self.turn += 1
        hit = next(c.device_hit_tokens + c.pool_hit_tokens for c in candidates if c.index == chosen)
        return Choice(self.engines[chosen], chosen, units, hit, keys)

    def set_dp_size(self, url: str, size: int) -> list[int]:
        """Make ``url`` one candidate per DP rank (rank 0 is its existing candidate; the
        others are appended, so indices, sessions and the KV index stay valid); returns
        the indices added. A smaller size later (a restart) retires the extra ranks."""
        if size < 1:
            raise ValueError(f"data-parallel size of {url} must be >= 1, got {size}")
        self.dp_sizes[url] = size
        ranks = [e for e in self.engines if e.url == url]
        if not ranks:
            raise ValueError(f"{url} is not one of the router's {self.role} URLs")
        for engine in ranks:
            engine.retired = engine.rank is not None and engine.rank >= size
            engine.up = engine.up and not engine.retired
        if size == 1:
            return []
        first = ranks[0]
        first.rank = 0
        for engine in ranks[1:]:
            engine.up = first.up and not engine.retired
        added = []
        for rank in range(len(ranks), size):
            self.engines.append(Engine(url, self.role, rank=rank, up=first.up))
            added.append(len(self.engines) - 1)
        if added:
            self.index.grow(len(self.engines))
            logger.info("router: %s engine %s has %d DP ranks", self.role, url, size)
        if self.on_new_rank is not None:
            for i in added:
                self.on_new_rank(i, url, self.engines[i].rank or 0)
        return added

    def start(self, choice: Choice, session: str | None) -> None:
        engine = choice.engine
        engine.inflight += 1
        engine.load_units += choice.prefill_units
        engine.num_routed += 1
        if session:
            self.sessions[session] = choice.index
            self.sessions.move_to_end(session)
            while len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)
        if self.approximate and choice.keys:
            self.index.record_routed(choice.index, choice.keys)

    def finish(self, choice: Choice) -> None:
        choice.engine.inflight -= 1
        choice.engine.load_units -= choice.prefill_units

    def mark_down(self, index: int, reason: str) -> None:
        """The candidate's engine failed a request: all its ranks are down (they share one
        HTTP server, so what one could not reach the others cannot either)."""
        engine = self.engines[index]
        engine.num_failures += 1
        if engine.up:
            logger.warning("router: %s engine %s is down (%s)", self.role, engine.url, reason)
        for other in self.engines:
            if other.url == engine.url:
                other.up = False

    async def check_health(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        """One /health per engine URL, applied to all its ranks; a healthy engine whose DP
        size is not known yet is asked for it."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)

        async def one(url: str) -> None:
            ok = False
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                async with session.get(f"{url}/health", timeout=timeout) as response:
                    ok = response.status == 200
            ranks = [i for i, e in enumerate(self.engines) if e.url == url]
            was_up = any(self.engines[i].up for i in ranks)
            if ok and not was_up:
                logger.warning("router: %s engine %s is back", self.role, url)
                self.dp_sizes.pop(url, None)  # a restart may have another DP size
                if self.approximate:
                    for i in ranks:
                        self.index.forget_engine(i)  # restarted: its cache is empty
            elif not ok and was_up:
                logger.warning("router: %s engine %s failed its health check", self.role, url)
            for i in ranks:
                self.engines[i].up = ok and not self.engines[i].retired
            if ok and url not in self.dp_sizes:
                size = await fetch_dp_size(session, url, timeout)
                if size is not None:
                    self.set_dp_size(url, size)

        urls = list(dict.fromkeys(e.url for e in self.engines))
        await asyncio.gather(*(one(url) for url in urls))


async def fetch_dp_size(
    session: aiohttp.ClientSession, url: str, timeout: aiohttp.ClientTimeout
) -> int | None:
    """The engine's DP size from its ``/server_info``: 1 when it has no such route or says
    nothing valid (an older or foreign server: routed as one candidate, no header); None
    when it could not be reached (asked again at the next check)."""
    try:
        async with session.get(f"{url}/server_info", timeout=timeout) as response:
            if response.status != 200:
                return 1
            info = await response.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, OSError):
        return None
    except ValueError:  # not JSON
        return 1
    size = info.get("data_parallel_size") if isinstance(info, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        logger.warning("router: %s/server_info gave no valid data_parallel_size", url)
        return 1
    return size
