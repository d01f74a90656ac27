"""The scheduler and KV manager under speculation, with a fake runner that stores row
contents: rejected drafts leave no trace (rows are rewritten before any query reads them,
the prefix cache keys verified tokens only), the lookahead is allocated, nothing leaks."""

from __future__ import annotations

import random

from rackserve.config import SchedulerConfig
from rackserve.engine.outputs import RunnerOutput, SchedulerOutput
from rackserve.engine.scheduler import Scheduler
from rackserve.kv.manager import KVCacheManager
from rackserve.kv.spec import cache_groups_for
from rackserve.model.presets import tiny_config
from rackserve.request import Request, RequestStatus, SamplingParams

EOS = 1
K = 3
SPECS = cache_groups_for(tiny_config())


def prefix_ids(tokens: list[int]) -> list[int]:
    """ids[p] names tokens [0, p]: a row's content depends on its whole prefix."""
    ids, h = [], 17
    for t in tokens:
        h = (h * 1_000_003 + t) % (1 << 61)
        ids.append(h)
    return ids


class FakeSpecRunner:
    """Writes a prefix id per computed position and group, checks every row a query reads,
    then accepts a random number of drafts and proposes K new random ones. The drafter's
    chain writes junk into the K lookahead positions past each step."""

    def __init__(self, sched: Scheduler, rng: random.Random) -> None:
        self.sched, self.rng = sched, rng
        self.rows: dict[tuple[int, int, int], int] = {}
        self.num_accepted = 0

    def _slot(self, tables, g: int, p: int) -> tuple[int, int, int]:
        span = SPECS[g].block_tokens
        assert p // span < len(tables[g]), (SPECS[g].name, p, "not allocated")
        block_id = tables[g][p // span]
        assert block_id != 0, (SPECS[g].name, p)
        return (g, block_id, p % span)

    def run(self, out: SchedulerOutput) -> RunnerOutput:
        ids = [r.req_id for r in out.new_reqs] + out.cached_reqs.req_ids
        sampled, drafts_out = [], {}
        for req_id in ids:
            req = self.sched.requests[req_id]
            n = out.num_scheduled_tokens[req_id]
            drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
            start = req.num_computed_tokens - n  # advanced optimistically by schedule()
            tokens = req.all_token_ids + drafts
            content = prefix_ids(tokens)
            tables = self.sched.kv.get_block_ids(req)
            for p in range(start, start + n):
                for g, spec in enumerate(SPECS):
                    self.rows[self._slot(tables, g, p)] = content[p]
                    first = max(0, p - spec.window + 1) if spec.is_sliding else 0
                    for r in range(first, p + 1):
                        assert self.rows[self._slot(tables, g, r)] == content[r], (spec.name, p, r)
            for p in range(start + n, start + n + K):  # the chain's lookahead: junk
                for g in range(len(SPECS)):
                    self.rows[self._slot(tables, g, p)] = -1
            if start + n < len(tokens):
                sampled.append([])  # a prefill chunk short of the end
                continue
            a = self.rng.randint(0, len(drafts))
            self.num_accepted += a
            new = self.rng.randrange(2, 60)
            while drafts and a < len(drafts) and new == drafts[a]:
                new = self.rng.randrange(2, 60)  # a rejected draft differs from the target
            sampled.append([*drafts[:a], new])
            drafts_out[req_id] = [self.rng.randrange(2, 60) for _ in range(K)]
        return RunnerOutput(req_ids=ids, sampled_token_ids=sampled, draft_token_ids=drafts_out)


def make(num_history_blocks: int) -> Scheduler:
    blocks = {g.name: (300 if g.is_sliding else num_history_blocks) for g in SPECS}
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=48, max_model_len=400)
    return Scheduler(config, KVCacheManager(SPECS, blocks), (EOS,), num_spec_tokens=K)


def test_random_accept_reject_with_aborts_leaks_nothing():
    rng = random.Random(0)
    sched = make(num_history_blocks=8)  # tight: preemption happens
    runner = FakeSpecRunner(sched, rng)
    system = [rng.randrange(2, 60) for _ in range(40)]  # shared: prefix hits
    num_verified = 0
    for i in range(1000):
        if rng.random() < 0.3 and len(sched.waiting) < 4:
            prompt = system[: rng.randrange(8, 40)] + [rng.randrange(2, 60) for _ in range(5)]
            params = SamplingParams(temperature=0, max_tokens=rng.randrange(3, 40))
            sched.add_request(Request(f"r{i}", prompt, params, (EOS,), arrival_time=float(i)))
        if rng.random() < 0.03 and sched.running:
            sched.finish_requests(
                [rng.choice(sched.running).request_id], RequestStatus.FINISHED_ABORTED
            )
        out = sched.schedule()
        num_verified += len(out.scheduled_spec_decode_tokens)
        sched.update(out, runner.run(out))
    while sched.num_unfinished:
        out = sched.schedule()
        sched.update(out, runner.run(out))
    assert num_verified > 300 and runner.num_accepted > 100
    assert sched.num_preemptions > 0 and sched.kv.stats.num_hit_tokens > 0
    assert sched.kv.usage == 0.0
    for pool in sched.kv.pools:
        assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
        assert pool.num_free_blocks == len(pool.blocks) - 1
    stats = sched.stats().spec_decoding
    assert stats is not None and stats.num_drafts > 300
    assert stats.num_accepted_tokens == runner.num_accepted
    per_pos = stats.num_accepted_tokens_per_pos
    assert len(per_pos) == K and per_pos[0] >= per_pos[1] >= per_pos[2] > 0


def test_drafts_are_granted_and_rejected_ones_uncounted():
    sched = make(num_history_blocks=100)
    params = SamplingParams(temperature=0, max_tokens=50)
    sched.add_request(Request("a", list(range(2, 12)), params, (EOS,), arrival_time=0.0))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 10} and not out.scheduled_spec_decode_tokens
    sched.update(out, RunnerOutput(["a"], [[20]], draft_token_ids={"a": [21, 22, 23]}))
    req = sched.requests["a"]
    assert req.num_computed_tokens == 10 and req.spec_token_ids == [21, 22, 23]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_spec_decode_tokens == {"a": [21, 22, 23]}
    # 21 accepted, 22 rejected (the target said 30): KV stands for 20 and 21 only
    sched.update(out, RunnerOutput(["a"], [[21, 30]], draft_token_ids={"a": [31, 32, 33]}))
    assert req.output_token_ids == [20, 21, 30]
    assert req.num_computed_tokens == 12 == req.num_tokens - 1
    stats = sched.stats().spec_decoding
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.num_accepted_tokens_per_pos == [1, 0, 0]


def test_stop_in_the_middle_of_an_accepted_run():
    sched = make(num_history_blocks=100)
    params = SamplingParams(temperature=0, max_tokens=3)
    sched.add_request(Request("a", list(range(2, 12)), params, (EOS,), arrival_time=0.0))
    out = sched.schedule()
    sched.update(out, RunnerOutput(["a"], [[20]], draft_token_ids={"a": [21, 22, 23]}))
    out = sched.schedule()
    (result,) = sched.update(out, RunnerOutput(["a"], [[21, 22, 23, 24]]))
    assert result.new_token_ids == [21, 22] and result.finish_reason == "length"
    assert sched.kv.usage == 0.0 and not sched.num_unfinished


def test_drafts_trimmed_at_max_model_len():
    sched = make(num_history_blocks=100)
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    sched.add_request(Request("a", list(range(2, 400)), params, (EOS,), arrival_time=0.0))
    while not sched.requests["a"].output_token_ids:
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        done = sched.requests["a"].num_computed_tokens >= sched.requests["a"].num_tokens
        sched.update(
            out, RunnerOutput(ids, [[20] if done else []], draft_token_ids={"a": [5, 6, 7]})
        )
    out = sched.schedule()  # 399 tokens known, max_model_len 400: room for one draft
    assert out.num_scheduled_tokens == {"a": 2} and out.scheduled_spec_decode_tokens == {"a": [5]}
