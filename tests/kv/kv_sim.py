"""A minimal scheduler loop over KVCacheManager for the manager tests (no model, no tensors).

Every computed step appends one "sampled" token, as the engine does: after a step that
reaches the end of the known tokens, ``all_token_ids`` grows by one that is not computed yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from rackserve.kv.manager import HitBlocks, KVCacheManager, NewBlocks


@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    cache_salt: str | None = None
    num_computed_tokens: int = 0


def make_request(request_id: str, prompt: list[int], cache_salt: str | None = None) -> FakeRequest:
    return FakeRequest(request_id, list(prompt), len(prompt), cache_salt)


def sampled_token(req: FakeRequest) -> int:
    """A deterministic stand-in for sampling: depends only on the request's tokens so far."""
    return 50_000 + (sum(req.all_token_ids) * 31 + len(req.all_token_ids)) % 1000


def start(manager: KVCacheManager, req: FakeRequest) -> tuple[int, HitBlocks]:
    num_hit, hit = manager.get_computed_blocks(req)
    req.num_computed_tokens = num_hit
    return num_hit, hit


def step(
    manager: KVCacheManager, req: FakeRequest, num_new: int, hit: HitBlocks | None = None
) -> NewBlocks:
    """Allocate, "compute" and commit ``num_new`` tokens; sample when all are computed."""
    new = manager.allocate_slots(req, num_new, req.num_computed_tokens, hit)
    assert new is not None, "cache full in a test that expects room"
    req.num_computed_tokens += num_new
    manager.commit(req, req.num_computed_tokens)
    if req.num_computed_tokens == len(req.all_token_ids):
        req.all_token_ids.append(sampled_token(req))
    return new


def prefill(manager: KVCacheManager, req: FakeRequest, chunk: int = 1 << 30) -> int:
    """Look up the prefix, then compute the rest of the known tokens in chunks; returns the
    number of hit tokens."""
    num_hit, hit = start(manager, req)
    num_tokens = len(req.all_token_ids)
    first = True
    while req.num_computed_tokens < num_tokens:
        num_new = min(chunk, num_tokens - req.num_computed_tokens)
        step(manager, req, num_new, hit if first else None)
        first = False
    return num_hit


def decode(manager: KVCacheManager, req: FakeRequest, num_tokens: int) -> None:
    for _ in range(num_tokens):
        step(manager, req, 1)


def finish(manager: KVCacheManager, req: FakeRequest) -> None:
    manager.free(req, req.num_computed_tokens)


def run_turn(
    manager: KVCacheManager, req: FakeRequest, num_output: int, chunk: int = 1 << 30
) -> int:
    """Prefill, decode until ``num_output`` tokens were sampled, free; returns the hit."""
    num_hit = prefill(manager, req, chunk)
    decode(manager, req, num_output - 1)
    finish(manager, req)
    return num_hit
