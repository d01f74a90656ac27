"""KV events end to end: two in-process engines publish over real ZMQ sockets, the router's
subscriber feeds its index, and the kv-aware policy routes by what the engines report
(stored and evicted blocks), not by its own record; an engine that goes away is routed
around, and once a new engine publishes on its endpoint the stale view is dropped and the
engine is used again."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import pytest
import torch

from rackserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from rackserve.engine.core import EngineCore
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.kv.spec import cache_groups_for, plan_num_blocks
from rackserve.model.create import create_checkpoint
from rackserve.model.presets import tiny_config
from rackserve.request import SamplingParams
from rackserve.router.engines import EnginePool
from rackserve.router.kv_index import EventSubscriber, KVIndex, TokenKeyer

MAX_NUM_SEQS, MAX_BATCHED, MAX_LEN = 4, 256, 256
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return create_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny"), seed=0)


def free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def engine(model_dir, endpoint: str, kv_tokens: int = 260) -> EngineCore:
    """fp32 engine publishing KV events, whose full-history groups hold ~``kv_tokens``."""
    model_config = ModelConfig.from_pretrained(model_dir)
    groups = cache_groups_for(model_config, dtype_bytes=4)
    minimum = plan_num_blocks(groups, 1 << 40, MAX_NUM_SEQS, MAX_BATCHED)
    budget = sum(minimum[g.name] * g.bytes_per_block for g in groups if g.is_sliding)
    budget += sum(
        2 * g.bytes_per_block + kv_tokens * g.bytes_per_token for g in groups if not g.is_sliding
    )
    config = EngineConfig(
        model=str(model_dir),
        model_config=model_config,
        cache=CacheConfig(kv_cache_memory=int(budget), kv_events_endpoint=endpoint),
        scheduler=SchedulerConfig(MAX_NUM_SEQS, MAX_BATCHED, MAX_LEN),
        device="cpu",
        dtype="float32",
    )
    return EngineCore(config, log_stats=False)


def serve(core: EngineCore, prompt: list[int], request_id: str) -> None:
    core.add_request(EngineCoreRequest(request_id, prompt, PARAMS, time.time()))
    while core.has_unfinished_requests():
        core.step()


def held(core: EngineCore, hashes: list[bytes]) -> int:
    """Leading blocks of ``hashes`` the engine's anchor group really holds (the truth the
    index should mirror)."""
    kv = core.scheduler.kv
    g = next(i for i, spec in enumerate(kv.specs) if not spec.is_sliding)
    name = kv.specs[g].name
    n = 0
    while n < len(hashes) and kv.pools[g].get_cached_block((name, hashes[n])) is not None:
        n += 1
    return n


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the router's index did not catch up"
        time.sleep(0.02)


def test_token_keyer_makes_the_servers_token_ids(tiny):
    """A chat is keyed on the ids the server prefills (rendered, then encoded without
    special tokens); a completion prompt with them."""
    keyer = TokenKeyer(str(tiny), None, "sha256")
    messages = [
        {"role": "system", "content": "You are a coding agent. " * 20},
        {"role": "user", "content": "Fix the failing test. " * 20},
    ]
    text = keyer.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = keyer.token_ids({"messages": messages})
    assert len(ids) > 100 and ids == keyer.tokenizer.encode(text, add_special_tokens=False)
    assert keyer.token_ids({"prompt": "hello there"}) == keyer.tokenizer.encode("hello there")
    keys, block = keyer.keys({"messages": messages})
    assert block == 32 and len(keys) == len(ids) // 32


def test_router_routes_by_engine_events_and_survives_a_restart(tiny):
    g = torch.Generator().manual_seed(0)
    prompts = {name: torch.randint(10, 4000, (100,), generator=g).tolist() for name in "PQRST"}
    endpoints = [free_endpoint(), free_endpoint()]
    engines = [engine(tiny, ep) for ep in endpoints]
    keyer = TokenKeyer(str(tiny), None, "sha256")
    index = KVIndex(2)
    subscriber = EventSubscriber(index, endpoints)
    pool = EnginePool(
        ["http://e0", "http://e1"], "engine", "kv-aware", keyer, index, approximate=False
    )
    try:
        time.sleep(0.5)  # PUB drops batches until the subscriptions have arrived
        keys = {name: keyer.keys({"prompt": ids})[0] for name, ids in prompts.items()}
        assert all(len(k) == 3 for k in keys.values())  # 100 tokens: 3 blocks of 32

        def routed(name: str) -> int:
            # a later turn of the same session: its prompt extends the one served
            body = {"prompt": prompts[name] + [11, 12, 13] * 20}
            return pool.choose(body, None, set()).index

        # 1. Stored: P on engine 1 -> the index holds its 3 blocks there, and a longer
        # prompt over P goes to engine 1, whatever the rotation says.
        serve(engines[1], prompts["P"], "p")
        wait_for(lambda: index.match(1, keys["P"]) == (3, 0))
        assert held(engines[1], keys["P"]) == 3
        assert index.match(0, keys["P"]) == (0, 0)
        assert {routed("P") for _ in range(4)} == {1}
        serve(engines[0], prompts["S"], "s")
        wait_for(lambda: index.match(0, keys["S"]) == (3, 0))
        assert {routed("S") for _ in range(4)} == {0}

        # 2. Removed: Q and R fill engine 1's small cache and evict P's tail; the router learns it
        # from the engine (its own record would still say engine 1 holds P).
        serve(engines[1], prompts["Q"], "q")
        serve(engines[1], prompts["R"], "r")
        wait_for(lambda: index.match(1, keys["P"])[0] < 3)  # leaf first: P's tail went
        assert index.match(1, keys["P"]) == (held(engines[1], keys["P"]), 0)
        assert index.match(1, keys["R"]) == (3, 0)
        assert routed("R") == 1

        # 3. Engine 1 goes away: marked down, R's next turn is routed around it.
        engines[1].shutdown()
        pool.mark_down(1, "test: engine stopped")
        assert routed("R") == 0
        # ... and comes back as a new process on the same endpoint (health check passes):
        # its first batch carries a new engine id, so the old instance's blocks are dropped.
        engines[1] = engine(tiny, endpoints[1])
        pool.engines[1].up = True
        time.sleep(0.5)  # the subscriber reconnects to the new publisher
        serve(engines[1], prompts["T"], "t")
        wait_for(lambda: index.match(1, keys["T"]) == (3, 0))
        assert index.match(1, keys["R"]) == (0, 0)  # stale view gone
        assert index.num_restarts == 1
        assert routed("T") == 1  # used again
    finally:
        subscriber.close()
        for core in engines:
            core.shutdown()
