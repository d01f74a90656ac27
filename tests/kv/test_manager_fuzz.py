"""Randomised end-to-end check of the manager against a fake runner that stores row contents.

The fake runner writes, for every computed position p of every group, an id of the whole
token prefix [0, p] into the slot its block table maps p to, and checks every row a query
reads (sliding: [p-W+1, p]; full history: [0, p]). Any wrong hit, a page reused while still
needed, or a misplaced NewBlocks offset shows up as a wrong row. A small scheduler runs
multi-turn sessions with shared system prompts, chunked prefill, cache pressure and
preemption; reference counts are checked against the live block tables after every step.
"""

from __future__ import annotations

import random
from collections import Counter, deque

import pytest
from kv_sim import make_request, sampled_token

from rackserve.kv.manager import KVCacheManager, NewBlocks
from rackserve.kv.spec import cache_groups_for
from rackserve.model.presets import tiny_config

SPECS = cache_groups_for(tiny_config())


def prefix_ids(tokens: list[int]) -> list[int]:
    """ids[p] names tokens [0, p]: a row's content depends on its whole prefix."""
    ids, h = [], 17
    for t in tokens:
        h = (h * 1_000_003 + t) % (1 << 61)
        ids.append(h)
    return ids


class FakeRunner:
    def __init__(self) -> None:
        self.rows: dict[tuple[int, int, int], int] = {}  # (group, block id, row) -> prefix id
        self.block_tables: dict[str, list[list[int]]] = {}

    def apply(self, request_id: str, new: NewBlocks) -> None:
        tables = self.block_tables.setdefault(request_id, [[] for _ in SPECS])
        for table, offset, block_ids in zip(tables, new.offsets, new.block_ids, strict=True):
            assert offset in (0, len(table))  # a fresh table, or an append
            del table[offset:]
            table.extend(block_ids)

    def run(self, req, start: int, num_new: int) -> None:
        tables = self.block_tables[req.request_id]
        content = prefix_ids(req.all_token_ids[: start + num_new])

        def slot(g: int, p: int) -> tuple[int, int, int]:
            span = SPECS[g].block_tokens
            block_id = tables[g][p // span]
            assert block_id != 0, (SPECS[g].name, p)
            return (g, block_id, p % span)

        for p in range(start, start + num_new):
            for g, spec in enumerate(SPECS):
                self.rows[slot(g, p)] = content[p]
                if spec.is_sliding:
                    for r in range(max(0, p - spec.window + 1), p + 1):
                        assert self.rows[slot(g, r)] == content[r], (spec.name, p, r)
        for g, spec in enumerate(SPECS):
            if not spec.is_sliding:
                for r in range(start + num_new):
                    assert self.rows[slot(g, r)] == content[r], (spec.name, r)


def check_ref_counts(m: KVCacheManager, running) -> None:
    for g, pool in enumerate(m.pools):
        held = Counter(b for r in running for b in m.get_block_ids(r)[g] if b != 0)
        free = {b.block_id for b in pool.free_queue}
        assert pool.num_free_blocks == len(free)
        for block in pool.blocks[1:]:
            assert block.ref_cnt == held[block.block_id], (g, block)
            assert (block.block_id in free) == (block.ref_cnt == 0)


def simulate(seed: int, num_sliding: int, num_full: int, interval: int | None) -> float:
    rng = random.Random(seed)
    num_blocks = {s.name: num_sliding if s.is_sliding else num_full for s in SPECS}
    m = KVCacheManager(SPECS, num_blocks, checkpoint_interval=interval)
    runner = FakeRunner()
    system_prompts = [[rng.randrange(2, 4000) for _ in range(rng.randrange(20, 90))] for _ in "ab"]
    contexts: list[list[int]] = []  # finished sessions' token ids, for their next turn
    waiting: deque = deque()
    running: list = []
    budget: dict[str, int] = {}  # remaining output tokens
    for i in range(40):
        if contexts and rng.random() < 0.6:
            prompt = contexts.pop(rng.randrange(len(contexts)))
        else:
            prompt = list(rng.choice(system_prompts))
        prompt = prompt + [rng.randrange(2, 4000) for _ in range(rng.randrange(1, 60))]
        req = make_request(f"r{i}", prompt, cache_salt=None)
        budget[req.request_id] = rng.randrange(1, 30)
        waiting.append(req)
        if rng.random() < 0.5:
            continue
        for _ in range(rng.randrange(1, 12)):  # engine steps between arrivals
            scheduled = []
            for req in list(running):
                if req not in running:  # preempted earlier in this step
                    continue
                num_new = min(
                    rng.randrange(1, 48), len(req.all_token_ids) - req.num_computed_tokens
                )
                while (new := m.allocate_slots(req, num_new, req.num_computed_tokens)) is None:
                    victim = running.pop()  # preempt the newest; it is recomputed later
                    m.free(victim, victim.num_computed_tokens)
                    runner.block_tables.pop(victim.request_id)
                    victim.num_computed_tokens = 0
                    scheduled = [s for s in scheduled if s[0] is not victim]
                    waiting.appendleft(victim)
                    if victim is req:
                        break
                if new is not None:
                    runner.apply(req.request_id, new)
                    scheduled.append((req, num_new))
            while waiting and len(running) < 4:
                req = waiting[0]
                num_hit, hit = m.get_computed_blocks(req)
                num_new = min(rng.randrange(1, 64), len(req.all_token_ids) - num_hit)
                new = m.allocate_slots(req, num_new, num_hit, hit)
                if new is None:
                    m.free(req)
                    break
                waiting.popleft()
                req.num_computed_tokens = num_hit
                runner.apply(req.request_id, new)
                running.append(req)
                scheduled.append((req, num_new))
            for req, num_new in scheduled:
                runner.run(req, req.num_computed_tokens, num_new)
                req.num_computed_tokens += num_new
                m.commit(req, req.num_computed_tokens)
                if req.num_computed_tokens == len(req.all_token_ids):
                    req.all_token_ids.append(sampled_token(req))
                    budget[req.request_id] -= 1
                    if budget[req.request_id] == 0:
                        m.free(req, req.num_computed_tokens)
                        runner.block_tables.pop(req.request_id)
                        running.remove(req)
                        contexts.append(list(req.all_token_ids))
            check_ref_counts(m, running)
    for req in running:
        m.free(req, req.num_computed_tokens)
    for pool in m.pools:
        assert pool.num_free_blocks == pool.num_blocks - 1
    return m.stats.hit_rate


@pytest.mark.parametrize(
    ("seed", "num_sliding", "num_full", "interval"),
    [  # roomy pools (hits), then pools small enough to fail allocations and preempt
        (0, 200, 400, None),
        (3, 60, 200, 64),
        (1, 40, 60, 32),
        (2, 16, 12, None),
        (4, 14, 10, 32),
        (5, 12, 20, None),
    ],
)
def test_random_sessions_read_exact_rows(seed, num_sliding, num_full, interval):
    hit_rate = simulate(seed, num_sliding, num_full, interval)
    if num_full >= 200:
        assert hit_rate > 0.3  # multi-turn sessions and shared system prompts do hit
