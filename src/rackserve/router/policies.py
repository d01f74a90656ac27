"""Which engine gets a request: pure functions over the router's view of the engines.

``kv-aware`` (default) minimises an estimated cost in prompt tokens::

    cost(e) = prompt - device_hit(e) - (1 - pool_cost) * pool_hit(e)   # tokens to prefill
              + load_weight * load(e)                                   # tokens queued there

where ``load`` is the prompt tokens of the requests the router has in flight there that
the engine has to compute (prompt minus the hit expected when routed: queued prefill work,
what delays the next request's first token; the router knows it at once, unlike a polled
/metrics). Counting whole prompts instead would charge an engine for the very hits that
make it cheap and push sessions off their prefix (benchmarks/results/
2026-12-01-router-cpu.md). Ties go to the session's previous engine, then the least
loaded, then in rotation. ``round-robin``, ``least-load`` and ``session`` (header
``X-Session-Id`` or the OpenAI ``user`` field, else least-load) are the baselines.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("kv-aware", "round-robin", "least-load", "session")


@dataclass(frozen=True)
class Candidate:
    """One healthy engine as a policy sees it."""

    index: int
    load_tokens: int  # prompt tokens to compute of the requests in flight there
    num_inflight: int
    device_hit_tokens: int = 0
    pool_hit_tokens: int = 0


def pick(
    policy: str,
    candidates: list[Candidate],
    prompt_tokens: int,
    turn: int,
    session_engine: int | None,
    load_weight: float = 0.5,
    pool_cost: float = 0.2,
) -> int:
    """The chosen engine's index; ``turn`` counts requests (round-robin). ValueError when
    there is no candidate."""
    if not candidates:
        raise ValueError("no healthy engine")
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; one of {POLICIES}")
    if policy == "round-robin":
        return candidates[turn % len(candidates)].index

    def least_load_key(c: Candidate) -> tuple[int, int, int]:
        return (c.load_tokens, c.num_inflight, c.index)

    if policy == "session" and session_engine is not None:
        for c in candidates:
            if c.index == session_engine:
                return c.index
    if policy in ("least-load", "session"):
        return min(candidates, key=least_load_key).index

    def cost(c: Candidate) -> float:
        uncached = prompt_tokens - c.device_hit_tokens - (1 - pool_cost) * c.pool_hit_tokens
        return max(0.0, uncached) + load_weight * c.load_tokens

    def kv_key(c: Candidate) -> tuple[float, bool, int, int, int]:
        # last: rotate among equals, so new sessions spread even when requests come singly
        rotation = (c.index - turn) % (1 + max(x.index for x in candidates))
        return (cost(c), c.index != session_engine, c.load_tokens, c.num_inflight, rotation)

    return min(candidates, key=kv_key).index
