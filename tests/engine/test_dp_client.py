"""The DP front end: least-load assignment (unit), and N engine-rank processes behind one
client giving one rank's greedy tokens, in one launch and as two "hosts" on loopback (a
head with the API side and rank 0, a headless host with rank 1)."""

from __future__ import annotations

import asyncio
import multiprocessing
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rackserve.config import ParallelConfig
from rackserve.engine.dp import DPLoadTracker, LeastLoad, RoundRobin, make_policy
from rackserve.engine.dp_client import DPAsyncEngineClient, merge_stats
from rackserve.engine.dp_process import num_dp_ports, run_headless
from rackserve.engine.outputs import SchedulerStats
from rackserve.engine.request_output import RequestOutputKind
from rackserve.parallel.groups import free_port_block
from rackserve.request import SamplingParams

from dep_utils import MAX_TOKENS, create_model, engine_config, prompts, single_rank


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return create_model(tmp_path_factory.mktemp("dp"))


def test_least_load_counts_requests_then_tokens():
    tracker = DPLoadTracker(3)
    assert [tracker.assign(f"a{i}", 10 * (i + 1)) for i in range(3)] == [0, 1, 2]
    assert tracker.assign("b", 5) == 0  # all hold one request: rank 0 has the fewest tokens
    tracker.on_tokens("a1", 100)
    assert tracker.finish("a0") == 0
    assert tracker.finish("a0") is None  # unknown now: no double count
    # rank 0: b (5 tokens); rank 1: a1 (120); rank 2: a2 (30) -> equal counts, fewest tokens
    assert tracker.assign("c", 1) == 0
    assert [load.num_requests for load in tracker.loads] == [2, 1, 1]
    assert tracker.assign("d", 1) == 2  # ranks 1 and 2 hold one each; rank 2 fewer tokens
    with pytest.raises(ValueError, match="already assigned"):
        tracker.assign("d", 1)


def test_policies_are_pluggable():
    tracker = DPLoadTracker(2, RoundRobin())
    assert [tracker.assign(str(i), 100 if i == 0 else 1) for i in range(4)] == [0, 1, 0, 1]
    assert isinstance(make_policy("least_load"), LeastLoad)
    with pytest.raises(ValueError, match="unknown DP assignment policy"):
        make_policy("fastest")

    class Broken:
        def choose(self, loads, num_prompt_tokens):
            return 7

    with pytest.raises(ValueError, match="rank 7"):
        DPLoadTracker(2, Broken()).assign("x", 1)


def test_merge_stats_sums_ranks():
    a = SchedulerStats(num_running_reqs=2, kv_cache_usage=0.5, prefix_cache_hits=10)
    b = SchedulerStats(
        num_running_reqs=1, num_waiting_reqs=3, kv_cache_usage=0.75, expert_balancedness=[0.5]
    )
    merged = merge_stats([a, None, b])
    assert (merged.num_running_reqs, merged.num_waiting_reqs) == (3, 3)
    assert merged.kv_cache_usage == 0.75 and merged.prefix_cache_hits == 10
    assert merged.expert_balancedness == [0.5]


async def _generate_all(
    client: DPAsyncEngineClient,
    requests: dict[str, list[int]],
    rank: int | None = None,
    n: int = 1,
) -> dict:
    """Greedy tokens of every request (of every one of its ``n`` outputs when n > 1), all
    pinned to ``rank`` when given (as the X-data-parallel-rank header does)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=n)

    async def one(req_id: str, ids: list[int]) -> list[int] | list[list[int]]:
        outputs = [
            out
            async for out in client.generate(
                req_id, ids, params, kind=RequestOutputKind.FINAL_ONLY, data_parallel_rank=rank
            )
        ]
        if n > 1:
            return [c.token_ids for c in outputs[-1].outputs]
        return outputs[-1].outputs[0].token_ids

    results = await asyncio.gather(*(one(r, ids) for r, ids in requests.items()))
    return dict(zip(requests, results, strict=True))


def _run_client(
    model_dir: Path, parallel: ParallelConfig, requests: dict, mirror: bool = False
) -> tuple[dict, list]:
    """Tokens of ``requests`` through a DP client; ``mirror``: then the same set again once
    per rank, each copy pinned to its rank, all at once (``bench replay --mode mirror``):
    returns also each copy's tokens and the rank every pinned engine request went to."""

    async def main():
        config = engine_config(model_dir, parallel)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        client = DPAsyncEngineClient(config, tokenizer, startup_timeout_s=120)
        await client.start()
        try:
            tokens = await _generate_all(client, requests)
            mirrored: dict = {}
            if mirror:
                ranks_of: dict[str, int] = {}
                assign = client.tracker.assign

                def spy(request_id: str, num_tokens: int, rank: int | None = None) -> int:
                    ranks_of[request_id] = assign(request_id, num_tokens, rank)
                    return ranks_of[request_id]

                client.tracker.assign = spy  # type: ignore[method-assign]
                copies = [
                    {f"c{r}-{k}": ids for k, ids in requests.items()}
                    for r in range(client.num_ranks)
                ]
                results = await asyncio.gather(
                    *(_generate_all(client, c, rank=r) for r, c in enumerate(copies)),
                    _generate_all(client, {"fan": next(iter(requests.values()))}, rank=1, n=2),
                )
                mirrored = {"copies": results[:-1], "fan": results[-1], "ranks": ranks_of}
                with pytest.raises(ValueError, match="out of range"):
                    await _generate_all(client, {"bad": [5, 6]}, rank=client.num_ranks)
            await client.check_health(timeout_s=30)
            assigned = sorted(client.tracker.rank_of.values())  # finished: forgotten
        finally:
            await client.shutdown()
        return (tokens, mirrored) if mirror else tokens, assigned

    return asyncio.run(main())


def _assert_equal(reference: dict, tokens: dict) -> None:
    for req_id, want in reference["tokens"].items():
        assert tokens[req_id] == want, req_id


def test_dp2_front_end_equals_one_rank(model_dir):
    requests = prompts(4)
    reference = single_rank(model_dir, requests)
    parallel = ParallelConfig(data_parallel_size=2, enable_expert_parallel=True)
    (tokens, mirrored), assigned = _run_client(model_dir, parallel, requests, mirror=True)
    _assert_equal(reference, tokens)
    assert assigned == []  # every finished request left the load tracker
    # X-data-parallel-rank: each mirrored copy ran whole on its own rank, with the same tokens
    ranks = mirrored["ranks"]
    for rank, copy in enumerate(mirrored["copies"]):
        assert {ranks[f"c{rank}-{k}"] for k in requests} == {rank}
        assert {k: copy[f"c{rank}-{k}"] for k in requests} == reference["tokens"]
    fan_children = [r for r in ranks if r not in {f"c{c}-{k}" for c in (0, 1) for k in requests}]
    assert len(fan_children) == 2 and {ranks[c] for c in fan_children} == {1}  # n=2: both
    first = next(iter(requests))
    assert mirrored["fan"]["fan"] == [reference["tokens"][first]] * 2


def _two_hosts(model_dir: Path, world: int, requests: dict) -> dict:
    port = free_port_block(num_dp_ports(world))
    common = {
        "data_parallel_size": world,
        "data_parallel_size_local": world // 2,
        "data_parallel_address": "127.0.0.1",
        "data_parallel_rpc_port": port,
        "enable_expert_parallel": True,
    }
    headless = ParallelConfig(headless=True, data_parallel_start_rank=world // 2, **common)
    host = multiprocessing.get_context("spawn").Process(
        target=run_headless, args=(engine_config(model_dir, headless),)
    )
    host.start()
    try:
        tokens, _ = _run_client(model_dir, ParallelConfig(**common), requests)
    finally:
        host.join(60)
        if host.is_alive():
            host.kill()
    assert host.exitcode == 0  # the head's SHUTDOWN stopped the headless ranks
    return tokens


def test_two_hosts_on_loopback_equal_one_rank(model_dir):
    requests = prompts(3)
    _assert_equal(single_rank(model_dir, requests), _two_hosts(model_dir, 2, requests))


# ~15 s on 2 cores; test_two_hosts_on_loopback_equal_one_rank is the short form
@pytest.mark.slow
def test_two_hosts_dep4_equal_one_launch(model_dir):
    requests = prompts(5)
    one_launch, _ = _run_client(
        model_dir, ParallelConfig(data_parallel_size=4, enable_expert_parallel=True), requests
    )
    assert _two_hosts(model_dir, 4, requests) == one_launch
    _assert_equal(single_rank(model_dir, requests), one_launch)
