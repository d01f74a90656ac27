"""The calls ``KVCacheManager.idle_until`` lets a scheduler skip change nothing: two
managers get the same random calls (prefill chunks, long decodes, prefix hits, preemption
under cache pressure, frees with and without a final count), except that one of them misses
most of the skippable ones, and they must agree on every return value, block table, cached
key, reference count and free-queue order. Each skipped call, made on the other manager,
must be what the skip assumes (an empty append, or a commit that only records the count)."""

from __future__ import annotations

import random

import pytest
from kv_sim import make_request, sampled_token

from rackserve.kv.block_pool import KVCacheBlock
from rackserve.kv.manager import HitBlocks, KVCacheManager
from rackserve.kv.spec import CacheGroupSpec, cache_groups_for
from rackserve.model.presets import preset_config, tiny_config

TINY = cache_groups_for(tiny_config())
FLASH = cache_groups_for(preset_config("v4-flash", num_layers=4, num_experts=8))
# Hand-made layouts where one bound of idle_until is the only one that fires: sliding groups
# only (the A-boundary bound), and a full group whose block is smaller than A.
SLIDING_ONLY = [
    CacheGroupSpec("swa", (0,), 8, 1, 16, 8, 2),
    CacheGroupSpec("state", (0,), 12, 1, 12, 8, 2),
]
SMALL_FULL = [
    CacheGroupSpec("swa", (0,), 16, 1, 16, 8, 2),
    CacheGroupSpec("kv", (0,), 4, 4, None, 8, 2),
]


def plain(result):
    """Blocks compare by identity: compare their ids (and hashes) instead."""
    if isinstance(result, tuple):
        return tuple(plain(x) for x in result)
    if isinstance(result, HitBlocks):
        return result.num_tokens, plain(result.blocks)
    if isinstance(result, KVCacheBlock):
        return result.block_id, result.block_hash
    return result


def pool_state(m: KVCacheManager) -> list:
    return [
        (
            [b.block_id for b in pool.free_queue],
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            {key: b.block_id for key, b in pool._cached.items()},
        )
        for pool in m.pools
    ]


class Pair(tuple):
    pass


class Twin:
    """Applies calls to a skipping manager (``fast``) and to one that gets every call
    (``full``), and checks they stay identical."""

    def __init__(self, specs, num_blocks, **kwargs) -> None:
        self.fast = KVCacheManager(specs, num_blocks, **kwargs)
        self.full = KVCacheManager(specs, num_blocks, **kwargs)

    def call(self, name: str, *args):
        """Returns the skipping manager's result; a (fast, full) pair for
        get_computed_blocks, whose hit blocks belong to one manager, and takes such a pair
        as ``hit``."""
        fast_args = [a[0] if isinstance(a, Pair) else a for a in args]
        full_args = [a[1] if isinstance(a, Pair) else a for a in args]
        fast = getattr(self.fast, name)(*fast_args)
        full = getattr(self.full, name)(*full_args)
        assert plain(fast) == plain(full), name
        return Pair((fast, full)) if name == "get_computed_blocks" else fast

    def skip(self, name: str, *args):
        """A call the scheduler skips under ``idle_until``: only the full manager gets it,
        and it must be what the skip assumes (an empty append, or a no-op commit)."""
        full = getattr(self.full, name)(*args)
        if name == "allocate_slots":
            assert full is not None and not any(full.block_ids)

    def check(self, running) -> None:
        assert pool_state(self.fast) == pool_state(self.full)
        assert self.fast.stats == self.full.stats
        for req in running:
            assert self.fast.get_block_ids(req) == self.full.get_block_ids(req)


def drive(
    seed: int, specs, num_blocks: dict[str, int], max_prompt: int, num_requests: int, **kwargs
) -> int:
    """A small engine loop: up to 6 running requests, chunked prefill, mostly 1-token decode
    steps, preemption when full, multi-turn sessions. Returns the number of empty appends
    seen or of skipped calls, whichever is fewer (so the test knows both were exercised)."""
    rng = random.Random(seed)
    twin = Twin(specs, num_blocks, **kwargs)
    system = [rng.randrange(2, 4000) for _ in range(rng.randrange(1, max_prompt))]
    contexts: list[list[int]] = []
    waiting, running, budget = [], [], {}
    num_fast = num_skipped = 0
    for i in range(num_requests):
        base = contexts.pop() if contexts and rng.random() < 0.5 else list(system)
        prompt = base + [rng.randrange(2, 4000) for _ in range(rng.randrange(1, max_prompt))]
        req = make_request(f"r{i}", prompt)
        budget[req.request_id] = rng.randrange(1, 3 * max_prompt)
        waiting.append(req)
        for _ in range(rng.randrange(1, 4 * max_prompt)):
            scheduled = []
            for req in list(running):
                if req not in running:
                    continue
                left = len(req.all_token_ids) - req.num_computed_tokens
                num_new = min(left, 1 if rng.random() < 0.8 else rng.randrange(1, 300))
                end = req.num_computed_tokens + num_new
                idle_until = twin.fast.idle_until.get(req.request_id, 0)
                if num_new > 0 and end <= idle_until and rng.random() < 0.8:
                    twin.skip("allocate_slots", req, num_new, req.num_computed_tokens)
                    num_skipped += 1
                    scheduled.append((req, num_new))
                    continue
                while (
                    new := twin.call("allocate_slots", req, num_new, req.num_computed_tokens)
                ) is None:
                    victim = running.pop()
                    twin.call("free", victim, victim.num_computed_tokens)
                    victim.num_computed_tokens = 0
                    scheduled = [s for s in scheduled if s[0] is not victim]
                    waiting.insert(0, victim)
                    if victim is req:
                        break
                if new is not None:
                    num_fast += new is twin.fast._states[req.request_id].no_new_blocks
                    scheduled.append((req, num_new))
            while waiting and len(running) < 6:
                req = waiting[0]
                both = twin.call("get_computed_blocks", req)
                num_hit, hit = both[0][0], Pair((both[0][1], both[1][1]))
                num_new = min(rng.randrange(1, 400), len(req.all_token_ids) - num_hit)
                if twin.call("allocate_slots", req, num_new, num_hit, hit) is None:
                    twin.call("free", req)
                    break
                waiting.pop(0)
                req.num_computed_tokens = num_hit
                running.append(req)
                scheduled.append((req, num_new))
            for req, num_new in scheduled:
                req.num_computed_tokens += num_new
                idle_until = twin.fast.idle_until.get(req.request_id, 0)
                if req.num_computed_tokens < idle_until and rng.random() < 0.8:
                    twin.skip("commit", req, req.num_computed_tokens)
                else:
                    twin.call("commit", req, req.num_computed_tokens)
                if rng.random() < 0.1:  # a repeated commit changes nothing
                    twin.call("commit", req, req.num_computed_tokens)
                if req.num_computed_tokens == len(req.all_token_ids):
                    req.all_token_ids.append(sampled_token(req))
                    budget[req.request_id] -= 1
                    if budget[req.request_id] <= 0 or rng.random() < 0.01:
                        # finished (final count given) or aborted (count already committed)
                        twin.call("free", req, *([req.num_computed_tokens] * rng.randrange(2)))
                        running.remove(req)
                        contexts.append(list(req.all_token_ids))
            twin.check(running)
    for req in running:
        twin.call("free", req, req.num_computed_tokens)
    twin.check([])
    return min(num_fast, num_skipped)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    ("specs", "num_blocks", "max_prompt", "num_requests", "kwargs"),
    [
        (TINY, {"sliding": 200, "full": 200}, 60, 30, {}),
        (TINY, {"sliding": 40, "full": 30}, 60, 30, {"checkpoint_interval": 32}),
        (TINY, {"sliding": 200, "full": 200}, 60, 30, {"enable_prefix_caching": False}),
        (SLIDING_ONLY, {"sliding": 100, "full": 0}, 60, 30, {}),
        (SMALL_FULL, {"sliding": 60, "full": 200}, 60, 30, {"checkpoint_interval": 32}),
        (FLASH, {"sliding": 160, "full": 40}, 300, 10, {}),
        (FLASH, {"sliding": 120, "full": 20}, 300, 10, {"checkpoint_interval": 256}),
    ],
    ids=[
        "tiny",
        "tiny-tight-interval",
        "tiny-no-caching",
        "sliding-only",
        "small-full-block",
        "flash",
        "flash-tight-interval",
    ],
)
def test_skipped_calls_change_nothing(seed, specs, num_blocks, max_prompt, num_requests, kwargs):
    blocks = {s.name: num_blocks["sliding" if s.is_sliding else "full"] for s in specs}
    assert drive(seed, specs, blocks, max_prompt, num_requests, **kwargs) > 0


def test_arguments_are_checked_on_every_path():
    m = KVCacheManager(TINY, {s.name: 50 for s in TINY})
    req = make_request("r", list(range(2, 40)))
    assert m.allocate_slots(req, 38, 0) is not None
    m.commit(req, 38)
    with pytest.raises(ValueError, match="went back"):
        m.commit(req, 37)
    with pytest.raises(ValueError, match="num_new_tokens"):
        m.allocate_slots(req, -1, 38)
