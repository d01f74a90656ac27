"""The host KV pool end to end on the tiny model (fp32, CPU): agent sessions whose working
set is several times the device cache give the same tokens and logprobs at temperature 0
with the pool as with a cache large enough for everything, and hit where without the pool
they recompute. Also a pool server shared by two engines: a turn on the second engine hits
the prefix the first one spilled."""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from rackserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from rackserve.engine.core import EngineCore
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.kv.events import decode_batch
from rackserve.kv.offload.server import KVPoolServer
from rackserve.kv.spec import cache_groups_for, plan_num_blocks
from rackserve.model.create import create_checkpoint
from rackserve.model.presets import tiny_config
from rackserve.request import SamplingParams

MAX_NUM_SEQS, MAX_BATCHED, MAX_LEN = 8, 256, 512
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return create_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny"), seed=0)


def engine(model_dir, kv_tokens: int, device: str = "cpu", **cache) -> EngineCore:
    """fp32 engine whose full-history groups hold about ``kv_tokens`` tokens."""
    groups = cache_groups_for(ModelConfig.from_pretrained(model_dir), dtype_bytes=4)
    minimum = plan_num_blocks(groups, 1 << 40, MAX_NUM_SEQS, MAX_BATCHED)
    full = [g for g in groups if not g.is_sliding]
    budget = sum(minimum[g.name] * g.bytes_per_block for g in groups if g.is_sliding)
    budget += sum(2 * g.bytes_per_block + kv_tokens * g.bytes_per_token for g in full)
    config = EngineConfig(
        model=str(model_dir),
        model_config=ModelConfig.from_pretrained(model_dir),
        cache=CacheConfig(kv_cache_memory=int(budget), **cache),
        scheduler=SchedulerConfig(MAX_NUM_SEQS, MAX_BATCHED, MAX_LEN),
        device=device,
        dtype="float32",
    )
    return EngineCore(config, log_stats=False)


def subscribe(endpoint: str) -> zmq.Socket:
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(endpoint)
    time.sleep(0.3)  # PUB drops messages until the subscription has arrived
    return socket


def sessions(num_sessions: int, seed: int = 0) -> tuple[dict[str, list[int]], torch.Generator]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"s{i}": torch.randint(10, 4000, (96,), generator=g).tolist() for i in range(num_sessions)
    }, g


def run_turn(core: EngineCore, prompts: dict[str, list[int]], turn: int) -> dict[str, tuple]:
    """All sessions' turn at once; per session (tokens, logprobs, cached tokens)."""
    for sid, ids in prompts.items():
        core.add_request(EngineCoreRequest(f"{sid}.t{turn}", ids, PARAMS, time.time()))
    tokens = {f"{s}.t{turn}": [] for s in prompts}
    logprobs = {f"{s}.t{turn}": [] for s in prompts}
    cached = {}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            cached.setdefault(out.request_id, out.num_cached_tokens)
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += [lp.logprobs[0] for lp in out.new_logprobs or ()]
    return {s: (tokens[s], logprobs[s], cached[s]) for s in tokens}


def play(core: EngineCore, num_turns: int, num_sessions: int = 6) -> dict[str, tuple]:
    """Multi-turn sessions: next prompt = prompt + output + 40 new tokens."""
    prompts, g = sessions(num_sessions)
    results = {}
    for turn in range(num_turns):
        done = run_turn(core, prompts, turn)
        results |= done
        for sid in prompts:
            new = torch.randint(10, 4000, (40,), generator=g).tolist()
            prompts[sid] = prompts[sid] + done[f"{sid}.t{turn}"][0] + new
    return results


def same_outputs(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        assert a[rid][0] == b[rid][0], rid
        assert a[rid][1] == pytest.approx(b[rid][1], abs=1e-3), (
            rid
        )  # fp32 noise of other batch shapes


def test_pool_outputs_equal_recomputation_and_hit(tiny):
    reference = play(engine(tiny, kv_tokens=20_000), num_turns=3)  # everything stays cached
    small = play(engine(tiny, kv_tokens=600), num_turns=3)
    core = engine(tiny, kv_tokens=600, kv_offload_memory=64 << 20)
    pooled = play(core, num_turns=3)
    same_outputs(pooled, reference)
    same_outputs(small, reference)
    hits = {name: sum(r[2] for r in res.values()) for name, res in
            (("reference", reference), ("small", small), ("pooled", pooled))}  # fmt: skip
    # 6 sessions of ~100-300 tokens do not fit in 600 tokens: without the pool they miss
    assert hits["small"] < hits["reference"] / 2
    # with the pool nearly all of it comes back (loads landing at other steps can reorder
    # admissions, so not always exactly the same)
    assert hits["pooled"] >= 0.9 * hits["reference"]
    stats = core.step().scheduler_stats
    assert stats.prefix_cache_pool_hits > 0
    assert stats.prefix_cache_hits >= hits["pooled"]  # + re-admissions after preemption
    assert stats.kv_offload_bytes > 0 and stats.kv_load_bytes > 0
    assert 0 < stats.kv_pool_usage < 1
    core.shutdown()


@pytest.mark.gpu
def test_pool_on_cuda_outputs_equal_recomputation(tiny):
    """The GPU path (pinned host buffers, side-stream copies both ways) gives the same
    tokens as a cache that keeps everything, and brings the hits back."""
    reference = play(engine(tiny, kv_tokens=20_000, device="cuda"), num_turns=3)
    core = engine(tiny, kv_tokens=600, device="cuda", kv_offload_memory=64 << 20)
    pooled = play(core, num_turns=3)
    same_outputs(pooled, reference)
    hits = [sum(r[2] for r in res.values()) for res in (reference, pooled)]
    assert hits[1] >= 0.9 * hits[0]
    stats = core.step().scheduler_stats
    assert stats.prefix_cache_pool_hits > 0 and stats.kv_load_bytes > 0
    core.shutdown()


def test_shared_pool_server_serves_another_engine(tiny):
    server = KVPoolServer(64 << 20, "tcp://127.0.0.1:*")
    server.start()
    try:
        first = engine(
            tiny,
            kv_tokens=520,
            kv_offload_server=server.endpoint,
            kv_events_endpoint="tcp://127.0.0.1:*",
        )
        events = subscribe(first.kv_events.publisher.endpoint)
        prompts, _ = sessions(6, seed=1)
        run_turn(first, prompts, 0)
        run_turn(first, sessions(12, seed=2)[0], 0)  # other users: evicts (spills) the first
        first.offload.flush()
        first.step()  # publishes the pool-tier events of the last stores
        kinds = set()
        while events.poll(200):
            for event in decode_batch(events.recv()).events:
                kinds.add((type(event).__name__, getattr(event, "medium", None)))
        assert {("BlockStored", "device"), ("BlockRemoved", "device")} <= kinds
        assert ("BlockStored", "pool") in kinds

        first.offload.flush()
        first.shutdown()
        second = engine(tiny, kv_tokens=520, kv_offload_server=server.endpoint)
        repeat = {"s0": prompts["s0"] + [7, 8, 9]}
        (result,) = run_turn(second, repeat, 1).values()
        assert result[2] == 96  # the whole prompt came back from the pool
        assert second.scheduler.kv.stats.num_pool_hit_tokens == 96
        fresh = run_turn(engine(tiny, kv_tokens=520), repeat, 1)
        assert result[0] == next(iter(fresh.values()))[0]
        second.shutdown()
    finally:
        server.stop()
