"""The engines behind the router: health, load, and the choice of one for a request.

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
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from rackserve.router.kv_index import KVIndex, TextKeyer, TokenKeyer
from rackserve.router.policies import Candidate, pick

logger = logging.getLogger(__name__)
MAX_SESSIONS = 100_000


@dataclass
class Engine:
    url: str
    role: str  # "prefill", "decode" or "engine" (aggregated)
    up: bool = True
    inflight: int = 0
    load_units: int = 0  # prompt units in flight there the engine has to compute
    num_routed: int = 0
    num_failures: int = 0


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
        self.engines = [Engine(url.rstrip("/"), role) for url in urls]
        self.role = role
        self.policy = policy
        self.keyer = keyer or TextKeyer()
        self.index = index or KVIndex(len(urls))
        self.approximate = approximate  # no KV events: record what we route
        self.load_weight = load_weight
        self.sessions: OrderedDict[str, int] = OrderedDict()
        self.turn = 0

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
        engine = self.engines[index]
        engine.num_failures += 1
        if engine.up:
            logger.warning("router: %s engine %s is down (%s)", self.role, engine.url, reason)
        engine.up = False

    async def check_health(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        async def one(i: int, engine: Engine) -> None:
            ok = False
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                timeout = aiohttp.ClientTimeout(total=timeout_s)
                async with session.get(f"{engine.url}/health", timeout=timeout) as response:
                    ok = response.status == 200
            if ok and not engine.up:
                logger.warning("router: %s engine %s is back", self.role, engine.url)
                if self.approximate:
                    self.index.forget_engine(i)  # restarted: its cache is empty
            elif not ok and engine.up:
                logger.warning(
                    "router: %s engine %s failed its health check", self.role, engine.url
                )
            engine.up = ok

        await asyncio.gather(*(one(i, e) for i, e in enumerate(self.engines)))
