"""Integer edges and request limits, without a server: what the engine holds is int64, a
child seed never overflows, and the engine core refuses (not dies on) what it cannot hold."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from pydantic import ValidationError

from rackserve.engine.outputs import EngineCoreRequest
from rackserve.request import INT64_MAX, INT64_MIN, SamplingParams, child_seed
from rackserve.server.async_client import AsyncEngineClient
from rackserve.server.errors import ApiError
from rackserve.server.limits import RequestLimits
from rackserve.server.metrics import ServerMetrics
from rackserve.server.middleware import MAX_JSON_DEPTH, check_depth
from rackserve.server.protocol import CompletionRequest, ParamError


def test_child_seeds_wrap_within_int64() -> None:
    assert child_seed(5, 3) == 8
    assert child_seed(INT64_MAX, 1) == INT64_MIN
    assert child_seed(INT64_MAX - 1, 127) == INT64_MIN + 125
    seeds = [child_seed(INT64_MAX - 3, i) for i in range(128)]
    assert len(set(seeds)) == 128 and all(INT64_MIN <= s <= INT64_MAX for s in seeds)
    msgspec.msgpack.encode(seeds)  # what overflowed before: the engine message


@pytest.mark.parametrize("field", ["seed", "top_k", "max_tokens", "min_tokens"])
def test_sampling_params_refuse_values_beyond_int64(field: str) -> None:
    kwargs = {"max_tokens": INT64_MAX} if field == "min_tokens" else {}
    with pytest.raises(ValueError, match=f"{field} must fit in a signed 64-bit integer"):
        SamplingParams(**{**kwargs, field: INT64_MAX + 1})
    SamplingParams(seed=INT64_MIN)


def test_vocab_checks() -> None:
    SamplingParams(top_k=100).check_vocab(100)
    with pytest.raises(ValueError, match="top_k must be at most the vocabulary size 100"):
        SamplingParams(top_k=101).check_vocab(100)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[100]).check_vocab(100)
    SamplingParams(logit_bias={99: 1.0}).check_vocab(100)
    with pytest.raises(ValueError, match="logit_bias keys must be in"):
        SamplingParams(logit_bias={100: 1.0}).check_vocab(100)


def test_lenient_parsing_keeps_range_checks() -> None:
    """Issue 15's leniency (null = default, unknown fields ignored) and issue 9's int64
    bounds hold together: an ignored field never hides an out-of-range known one."""
    body = CompletionRequest.model_validate(
        {"prompt": "a", "seed": None, "top_k": None, "store": True, "metadata": {"k": "v"}}
    )
    assert body.seed is None and body.top_k is None and body.priority == 0
    assert body.ignored_fields() == ["store", "metadata"]
    for field in ("seed", "top_k", "priority"):
        with pytest.raises(ValidationError, match=field):
            CompletionRequest.model_validate({"prompt": "a", "store": True, field: INT64_MAX + 1})
    with pytest.raises(ParamError, match="top_k"):
        RequestLimits().check(CompletionRequest(prompt="a", unknown=1, top_k=1001), 1, 1000)


def test_request_limits() -> None:
    limits = RequestLimits(max_sequences_per_request=8, max_tokens_per_request=16)
    limits.check(CompletionRequest(prompt=["a", "b"], n=4, max_tokens=16), 2, 1000)
    with pytest.raises(ParamError) as info:
        limits.check(CompletionRequest(prompt=["a", "b", "c"], n=3), 3, 1000)
    assert info.value.code == "too_many_sequences" and "9 sequences" in str(info.value)
    with pytest.raises(ParamError) as info:
        limits.check(CompletionRequest(prompt="a", max_tokens=17), 1, 1000)
    assert info.value.code == "max_tokens_limit" and info.value.param == "max_tokens"
    with pytest.raises(ParamError, match="top_k"):
        limits.check(CompletionRequest(prompt="a", top_k=1001), 1, 1000)
    with pytest.raises(ValueError, match="--max-sequences-per-request"):
        RequestLimits(max_sequences_per_request=0)


def test_json_depth_bound() -> None:
    ok = [[[]]]
    check_depth(ok, b"[[[]]]")
    deep: list = []
    node = deep
    for _ in range(MAX_JSON_DEPTH):
        node.append([])
        node = node[0]
    with pytest.raises(ApiError, match="deeper than") as info:
        check_depth(deep, b"")
    assert info.value.status == 400
    with pytest.raises(ApiError):  # msgspec gave up (RecursionError): the body decides
        check_depth(None, b"  [[[[")
    check_depth(None, b"null")


def test_engine_core_rejects_what_it_cannot_hold(tiny_model: Path) -> None:
    from rackserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from rackserve.engine.core import EngineCore

    config = EngineConfig(
        model=str(tiny_model),
        model_config=ModelConfig.from_pretrained(tiny_model),
        cache=CacheConfig(kv_cache_memory=16 << 20),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=128),
        device="cpu",
    )
    core = EngineCore(config, log_stats=False)
    vocab = core.model.cfg.vocab_size
    bad = [
        SamplingParams(top_k=vocab + 1, max_tokens=2),
        SamplingParams(stop_token_ids=[vocab], max_tokens=2),
    ]
    for i, params in enumerate(bad):
        with pytest.raises(ValueError):
            core.add_request(EngineCoreRequest(f"bad{i}", [5, 6, 7], params, time.time()))
    with pytest.raises(ValueError, match="priority"):
        core.add_request(
            EngineCoreRequest("p", [5], SamplingParams(max_tokens=2), time.time(), 2**63)
        )
    good = SamplingParams(top_k=vocab, temperature=1.0, seed=INT64_MAX, max_tokens=3)
    core.add_request(EngineCoreRequest("good", [5, 6, 7], good, time.time()))
    finished = set()
    for _ in range(20):
        finished |= {o.request_id for o in core.step().outputs if o.finish_reason is not None}
        if not core.has_unfinished_requests():
            break
    assert finished == {"good"}


def test_abort_counts_each_engine_request_once() -> None:
    """Both branches counted aborts; merged, an abort of a client request with two
    unfinished engine requests adds 2 to request_success{abort}, not 3."""
    metrics = ServerMetrics("m")
    client = AsyncEngineClient.__new__(AsyncEngineClient)
    client.processor = SimpleNamespace(abort_request=lambda request_id: ["r-0", "r-1"])
    client.metrics, client.dead_reason = metrics, None
    client._queues, client._send_queue = {}, asyncio.Queue()
    client.abort("r")
    text = metrics.render().decode()
    assert 'request_success_total{finished_reason="abort",model_name="m"} 2.0' in text
    assert client._send_queue.qsize() == 1  # one ABORT message for both engine requests
