"""Scheduler unit tests: a fake runner, the real KV manager, exact expectations."""

from __future__ import annotations

import pytest

from rackserve.config import ConfigError, SchedulerConfig
from rackserve.engine.outputs import RunnerOutput, SchedulerOutput
from rackserve.engine.scheduler import Scheduler
from rackserve.kv.manager import KVCacheManager
from rackserve.kv.spec import cache_groups_for
from rackserve.model.presets import tiny_config
from rackserve.request import Request, RequestStatus, SamplingParams

EOS = 1
TOKEN = 7  # what the fake runner samples


def make_scheduler(num_history_blocks: int = 100, policy: str = "fcfs", **config) -> Scheduler:
    groups = cache_groups_for(tiny_config())
    blocks = {g.name: (1000 if g.is_sliding else num_history_blocks) for g in groups}
    defaults = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, policy=policy)
    return Scheduler(
        SchedulerConfig(**{**defaults, **config}), KVCacheManager(groups, blocks), (EOS,)
    )


def request(req_id: str, num_prompt: int, max_tokens: int = 4, priority: int = 0) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    prompt = [10 + (i % 50) for i in range(num_prompt)]
    return Request(req_id, prompt, params, (EOS,), arrival_time=0.0, priority=priority)


def fake_run(sched: Scheduler, out: SchedulerOutput) -> RunnerOutput:
    """Sample TOKEN for every request whose step reaches its last known token."""
    ids = [r.req_id for r in out.new_reqs] + out.cached_reqs.req_ids
    sampled = []
    for req_id in ids:
        req = sched.requests[req_id]
        sampled.append([TOKEN] if req.num_computed_tokens >= req.num_tokens else [])
    return RunnerOutput(req_ids=ids, sampled_token_ids=sampled)


def step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sched.update(out, fake_run(sched, out))
    return out


def test_token_budget_and_chunked_prefill():
    sched = make_scheduler(max_num_batched_tokens=64)
    sched.add_request(request("a", 100))
    sched.add_request(request("b", 30))
    out = step(sched)
    assert out.num_scheduled_tokens == {"a": 64}  # a takes the whole budget, b waits
    out = step(sched)
    assert out.num_scheduled_tokens == {"a": 36, "b": 28}  # a finishes its prompt, b chunks
    out = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 2}  # a decodes, b completes its prompt
    assert sched.requests["a"].output_token_ids == [TOKEN, TOKEN]


def test_long_prefill_token_threshold_caps_a_request_per_step():
    """--long-prefill-token-threshold 24: a long prompt takes at most 24 tokens a step, new or
    running, so a short one beside it fits the same step; decodes are not touched."""
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=24)
    sched.add_request(request("a", 70))
    sched.add_request(request("b", 10))
    assert step(sched).num_scheduled_tokens == {"a": 24, "b": 10}
    assert step(sched).num_scheduled_tokens == {"a": 24, "b": 1}
    assert step(sched).num_scheduled_tokens == {"a": 22, "b": 1}  # a's prompt ends
    assert step(sched).num_scheduled_tokens == {"a": 1, "b": 1}
    assert sched.requests["a"].output_token_ids == [TOKEN, TOKEN]


@pytest.mark.parametrize(
    "config, message",
    [
        ({"long_prefill_token_threshold": -1}, "must be >= 0"),
        ({"long_prefill_token_threshold": 8, "enable_chunked_prefill": False,
          "max_num_batched_tokens": 256}, "needs chunking on"),
    ],
)  # fmt: skip
def test_long_prefill_token_threshold_errors(config, message):
    with pytest.raises(ConfigError, match=message):
        SchedulerConfig(max_model_len=256, **config)


def test_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add_request(request(f"r{i}", 8))
    out = step(sched)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert len(sched.waiting) == 1


def test_finishes_at_max_tokens_and_frees_blocks():
    sched = make_scheduler()
    sched.add_request(request("a", 20, max_tokens=3))
    while sched.num_unfinished:
        step(sched)
    assert sched.kv.usage == 0.0
    out = sched.schedule()
    assert out.finished_req_ids == {"a"}  # the runner hears about it on the next step


def test_preemption_recomputes_the_last_running_request():
    # 4 history blocks of 32 tokens: two 50-token requests cannot both grow past 64.
    sched = make_scheduler(num_history_blocks=5, max_num_batched_tokens=128)
    sched.add_request(request("a", 50, max_tokens=20))
    sched.add_request(request("b", 50, max_tokens=20))
    step(sched)
    assert [r.request_id for r in sched.running] == ["a", "b"]
    preempted = set()
    for _ in range(30):
        preempted |= step(sched).preempted_req_ids
        if preempted:
            break
    assert preempted == {"b"}
    b = sched.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert sched.num_preemptions == 1
    while sched.num_unfinished:
        step(sched)
    assert sched.kv.usage == 0.0


def test_abort_at_any_moment_frees_every_block():
    sched = make_scheduler(max_num_batched_tokens=32)
    sched.add_request(request("a", 100))
    sched.add_request(request("b", 10))
    step(sched)  # a mid-prefill, b waiting
    assert sched.kv.usage > 0
    sched.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv.usage == 0.0 and sched.num_unfinished == 0
    assert sched.schedule().finished_req_ids == {"a", "b"}


def test_max_model_len():
    sched = make_scheduler(max_model_len=64)
    with pytest.raises(ValueError, match="maximum context length is 64"):
        sched.add_request(request("long", 64))
    sched.add_request(request("a", 60, max_tokens=100))
    while sched.num_unfinished:
        step(sched)
    # generation stops with "length" when the context is full
    assert sched.finished_req_ids == {"a"}


def test_priority_policy_admits_the_most_urgent_first():
    sched = make_scheduler(policy="priority", max_num_seqs=1)
    sched.add_request(request("low", 8, priority=5))
    sched.add_request(request("high", 8, priority=-1))
    out = step(sched)
    assert set(out.num_scheduled_tokens) == {"high"}


def test_request_admitted_with_its_kv_skips_prefill():
    """P/D decode side / bench decode: blocks for the context are allocated at admission,
    the window's old pages released, and the runner hears of it as a new request that
    already computed its context; then it decodes one token per step."""
    sched = make_scheduler(max_num_batched_tokens=64)
    req = request("pd", 200, max_tokens=3)
    assert sched.add_request_with_kv(req, 199)
    assert req.num_computed_tokens == 199 and not sched.waiting
    swa, *_ = sched.kv.get_block_ids(req)
    assert swa[: (199 - 16 + 1) // 8] == [0] * ((199 - 16 + 1) // 8)  # released: null block
    out = step(sched)
    (new,) = out.new_reqs
    assert new.req_id == "pd" and new.num_computed_tokens == 199 and not out.cached_reqs.num_reqs
    assert out.num_scheduled_tokens == {"pd": 1}
    out = step(sched)
    assert out.cached_reqs.req_ids == ["pd"] and not out.new_reqs
    while sched.num_unfinished:
        step(sched)
    assert req.output_token_ids == [TOKEN] * 3 and sched.kv.usage == 0.0


def test_request_with_kv_refused_when_the_cache_is_full():
    sched = make_scheduler(num_history_blocks=4)  # 3 usable blocks of 32 tokens
    assert not sched.add_request_with_kv(request("big", 200), 199)
    assert sched.num_unfinished == 0 and sched.kv.usage == 0.0
    with pytest.raises(ValueError, match="at least one token"):
        sched.add_request_with_kv(request("x", 10), 10)


def test_transferred_kv_is_not_cached_before_a_step_ran_on_it():
    """add_request_with_kv admits before the KV is written: a request with the same prefix
    must not hit those blocks yet. Once the request has run (and finished), it may."""
    sched = make_scheduler()
    pd = request("pd", 200, max_tokens=30)
    assert sched.add_request_with_kv(pd, 199)
    probe = request("probe", 200)
    assert sched.kv.get_computed_blocks(probe)[0] == 0
    sched.kv.free(probe)
    assert sched.kv.stats.num_queries == 0  # it looked nothing up
    while sched.num_unfinished:
        step(sched)
    # Its history is cached, and the first checkpoint it computed past (224; the window
    # pages of 192 were released during the transfer, before they held anything).
    later = Request("later", [*pd.all_token_ids, 5], pd.sampling_params, (EOS,))
    assert sched.kv.get_computed_blocks(later)[0] == 224


def drain(sched: Scheduler, max_steps: int = 500) -> list:
    outputs = []
    for _ in range(max_steps):
        if not sched.num_unfinished:
            break
        out = sched.schedule()
        outputs += sched.update(out, fake_run(sched, out))
    return outputs


@pytest.mark.parametrize("prompt_len", [40, 100], ids=["grows-too-big", "prompt-too-big"])
def test_a_request_that_can_never_fit_finishes_and_does_not_block_the_queue(prompt_len):
    """2 usable history blocks of 32 tokens: no request can hold more than 64 tokens. One
    that outgrows them (or whose prompt does not fit) finishes with "length" instead of
    preempting itself forever, and the request behind it runs."""
    sched = make_scheduler(num_history_blocks=3, max_num_batched_tokens=128)
    sched.add_request(request("big", prompt_len, max_tokens=100))
    sched.add_request(request("small", 10, max_tokens=4))
    outputs = drain(sched)
    assert sched.num_unfinished == 0
    reasons = {o.request_id: o.finish_reason for o in outputs if o.finish_reason}
    assert reasons == {"big": "length", "small": "length"}  # small: its max_tokens
    num_big = sum(len(o.new_token_ids) for o in outputs if o.request_id == "big")
    assert num_big == (65 - prompt_len if prompt_len < 64 else 0)  # KV for 64 tokens at most
    assert sum(len(o.new_token_ids) for o in outputs if o.request_id == "small") == 4
    assert sched.kv.usage == 0.0


def test_priority_victim_is_never_a_request_already_scheduled_this_step():
    # 4 history blocks of 32 tokens; "low" runs first, then "high" arrives. When "high"
    # needs a third block, the victim ("low", least urgent) must not have been scheduled
    # earlier in the same step: it would be both preempted and in this step's batch.
    sched = make_scheduler(num_history_blocks=5, policy="priority", max_num_batched_tokens=128)
    params = SamplingParams(temperature=0, max_tokens=40)
    low = Request("low", [10 + i for i in range(40)], params, (EOS,), priority=5)
    high = Request("high", [60 + i for i in range(60)], params, (EOS,), priority=0)  # no hit
    sched.add_request(low)
    step(sched)
    sched.add_request(high)
    preempted: set[str] = set()
    for _ in range(30):
        out = step(sched)
        scheduled = set(out.num_scheduled_tokens)
        assert not out.preempted_req_ids & scheduled
        assert not out.preempted_req_ids & set(out.cached_reqs.req_ids)
        preempted |= out.preempted_req_ids
        if preempted:
            break
    assert preempted == {"low"} and "high" in scheduled
    assert [r.request_id for r in sched.running] == ["high"]
    while sched.num_unfinished:
        step(sched)
    assert sched.kv.usage == 0.0


def test_first_output_carries_when_the_request_was_first_scheduled():
    """Queue time must not depend on how many steps the prefill took."""
    sched = make_scheduler(max_num_batched_tokens=32)
    sched.add_request(request("a", 100, max_tokens=3))
    first = sched.schedule()  # admitted: prefill chunk 1 of 4
    scheduled_at = sched.requests["a"].first_scheduled_time
    assert scheduled_at is not None
    assert sched.update(first, fake_run(sched, first)) == []  # no token yet
    outputs = []
    while sched.num_unfinished:
        out = sched.schedule()
        outputs += sched.update(out, fake_run(sched, out))
    assert [o.first_scheduled_time for o in outputs] == [scheduled_at, None, None]
