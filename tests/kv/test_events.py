"""KV events: the wire format (router_contract.md), the block pool's key changes as events,
and an engine publishing over ZMQ hashes a router can recompute from the prompt."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch
import zmq

from rackserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from rackserve.engine.core import EngineCore
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.kv.block_pool import BlockPool
from rackserve.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    decode_batch,
    device_events,
    encode_batch,
    rank_endpoint,
)
from rackserve.kv.hashing import BlockHashChain
from rackserve.model.create import create_checkpoint
from rackserve.model.presets import tiny_config
from rackserve.request import SamplingParams


def test_batch_round_trip_keeps_every_event_kind():
    batch = KVEventBatch(
        1.5,
        7,
        "engine-0",
        [
            BlockStored([b"\x01" * 32, b"\x02" * 32], None, 64, "device"),
            BlockStored([b"\x03" * 32], b"\x02" * 32, 32, "pool"),
            BlockRemoved([b"\x01" * 32], "device"),
            AllBlocksCleared(),
        ],
    )
    assert decode_batch(encode_batch(batch)) == batch
    with pytest.raises(msgspec.DecodeError):
        decode_batch(b"not a batch")


def test_block_pool_key_changes_become_device_events():
    pool = BlockPool(4, record_events=True)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, ("kv", b"A"))
    pool.cache_block(b, ("kv", b"B"))
    assert not pool.cache_block(c, ("kv", b"A"))  # duplicate key: no event
    pool.free([a, b, c])
    pool.uncache_free_block(b)  # demoted: removed
    pool.get_new_blocks(3)  # c, b (transient) then a: evicted
    pool.reset_prefix_cache()
    events = pool.take_events()
    assert pool.take_events() == []
    assert device_events(events, block_tokens=32) == [
        BlockStored([b"A", b"B"], None, 64, "device"),
        BlockRemoved([b"B"], "device"),
        BlockRemoved([b"A"], "device"),
        AllBlocksCleared(),
    ]


def test_dp_ranks_publish_on_their_own_port():
    assert rank_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert rank_endpoint("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert rank_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv-1"


def test_publisher_refuses_a_bad_endpoint():
    with pytest.raises(ValueError, match="ZMQ address"):
        KVEventPublisher("127.0.0.1:5557", "e")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return create_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny"), seed=0)


def subscribe(endpoint: str) -> zmq.Socket:
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.setsockopt(zmq.RCVTIMEO, 2000)
    socket.connect(endpoint)
    time.sleep(0.3)  # PUB drops messages until the subscription has arrived
    return socket


def received(socket: zmq.Socket) -> list[KVEventBatch]:
    batches = []
    while socket.poll(200):
        batches.append(decode_batch(socket.recv()))
    return batches


def test_engine_publishes_hashes_a_router_can_recompute(tiny):
    config = EngineConfig(
        model=str(tiny),
        model_config=ModelConfig.from_pretrained(tiny),
        cache=CacheConfig(kv_events_endpoint="tcp://127.0.0.1:*", kv_offload_memory=1 << 24),
        scheduler=SchedulerConfig(4, 256, 512),
        device="cpu",
    )
    core = EngineCore(config, log_stats=False)
    socket = subscribe(core.kv_events.publisher.endpoint)
    prompt = torch.randint(10, 4000, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    core.add_request(EngineCoreRequest("r", prompt, params, time.time()))
    while core.has_unfinished_requests():
        core.step()
    batches = received(socket)
    assert [b.seq for b in batches] == list(range(len(batches)))
    stored = [
        h for b in batches for e in b.events if isinstance(e, BlockStored) for h in e.block_hashes
    ]
    # The router's side: hash the prompt with the engine's granularity and algorithm and look
    # up the anchor group's block ends (csa_kv: 32-token blocks): [0, 32), [0, 64), [0, 96).
    kv = core.scheduler.kv
    chain = BlockHashChain(kv.granularity, None, config.cache.prefix_caching_hash_algo)
    chain.extend(prompt)
    assert stored == [chain.prefix_hash(end) for end in (32, 64, 96)]
    assert all(e.medium == "device" for b in batches for e in b.events)

    kv.reset_prefix_cache()
    core.step()
    (batch,) = received(socket)
    assert batch.events == [AllBlocksCleared()]
    core.shutdown()
