"""The transfer overlaps the prefill: with chunked prefill on the prefill side, each finished
block's rows (every cache group) go to the decode side while later chunks compute; the last
transfer carries only the tail. Outputs stay equal to one aggregated engine's. On ``tcp``
the pieces' bytes follow on the connection, on ``nccl`` (gloo here) on the pair."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from rackserve.disagg.wire import transfer_key
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.model.create import create_checkpoint
from rackserve.model.presets import tiny_config
from rackserve.request import KVTransferParams, SamplingParams

from disagg_utils import consumer_config, drain, make_core, producer_config

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
CHUNK = 64  # the prefill side's chunk: a 400-token prompt takes 7 steps


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return create_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny"), seed=0)


def request(req_id: str, ids: list[int], kv: KVTransferParams | None) -> EngineCoreRequest:
    return EngineCoreRequest(req_id, ids, replace(PARAMS, kv_transfer_params=kv), time.time())


@pytest.mark.parametrize(
    "transport, chunking",
    [("tcp", "budget"), ("nccl", "budget"), ("tcp", "threshold")],  # nccl: its gloo pair
)
def test_decode_side_receives_blocks_before_the_last_chunk(tiny, transport, chunking):
    """chunking "budget": the prefill side's step budget is CHUNK tokens; "threshold": a
    512-token budget with --long-prefill-token-threshold CHUNK, so the two prompts prefill
    side by side, CHUNK tokens each a step."""
    g = torch.Generator().manual_seed(3)
    prompts = {
        "early": torch.randint(10, 4000, (400,), generator=g).tolist(),  # pull first
        "late": torch.randint(10, 4000, (330,), generator=g).tolist(),  # pull mid-prefill
    }
    if transport == "nccl":  # a pair carries one pull at a time: "late" would wait on "early"
        del prompts["late"]
    aggregated = make_core(tiny)
    chunks = (
        {"max_num_batched_tokens": CHUNK}
        if chunking == "budget"
        else {"long_prefill_token_threshold": CHUNK}
    )
    producer = make_core(tiny, producer_config(transport), **chunks)
    consumer = make_core(tiny, consumer_config(transport))
    try:
        for req_id, ids in prompts.items():
            aggregated.add_request(request(req_id, ids, None))
        want: dict[str, list[int]] = {}
        drain(aggregated, want)

        host, port = producer.kv_connector.server.address
        specs = consumer.scheduler.kv.specs

        def pull(req_id: str) -> None:
            kv = KVTransferParams(
                do_remote_prefill=True, transfer_id=req_id, remote_host=host, remote_port=port
            )
            consumer.add_request(request(req_id, prompts[req_id], kv))
            consumer.step()  # admitted: blocks reserved, the pull waits on the producer

        def prefill(req_id: str) -> None:
            kv = KVTransferParams(do_remote_decode=True, transfer_id=req_id)
            producer.add_request(request(req_id, prompts[req_id], kv))

        def watched(req_id: str) -> None:
            """The pull waits on the producer (only then are pieces copied out)."""
            deadline = time.monotonic() + 10
            while not producer.kv_connector.store.is_watched(_key(req_id, prompts[req_id])):
                assert time.monotonic() < deadline
                time.sleep(0.005)

        pull("early")  # before the producer even has the request
        prefill("early")
        if "late" in prompts:
            prefill("late")
        watched("early")
        producer.step()
        if "late" in prompts:
            pull("late")
            watched("late")
        log = consumer.kv_connector.client.pieces
        keys = {req_id: [] for req_id in prompts}  # each request's piece records
        before_last: dict[str, int] = {}
        remaining: dict[str, int] = {}

        def arrived(records, sent: list[set[int]]) -> bool:
            """Every history page the producer has added so far reached the decode side."""
            got = [0] * len(sent)
            for r in records:
                got[r.group] += r.num_slots
            return bool(records) and all(
                got[g] >= len(sent[g]) for g, spec in enumerate(specs) if not spec.is_sliding
            )

        while producer.has_unfinished_requests():
            for req_id in prompts:
                req = producer.scheduler.requests.get(req_id)
                if req is None or req_id in before_last:
                    continue
                remaining[req_id] = req.num_prompt_tokens - req.num_computed_tokens
                if remaining[req_id] <= CHUNK:
                    # the next step may compute its last chunk: the blocks finished so far
                    # (added to the store when this step starts) reach the decode side first
                    producer.kv_connector.prefill.stream_blocks()
                    sent = producer.kv_connector.prefill.prefills[req_id].sent
                    deadline = time.monotonic() + 10
                    while not arrived(log.records(_key(req_id, prompts[req_id])), sent):
                        assert time.monotonic() < deadline, "no piece before the last chunk"
                        time.sleep(0.01)
                    before_last[req_id] = len(log.records(_key(req_id, prompts[req_id])))
            producer.step()
        assert set(before_last) == set(prompts)
        got: dict[str, list[int]] = {}
        drain(consumer, got)
        assert got == want
        for req_id in prompts:
            keys[req_id] = log.records(_key(req_id, prompts[req_id]))
        stats = producer.kv_connector.server.stream_stats
        assert stats.bytes_streamed > 0 and stats.bytes_tail > 0
        received = sum(r.nbytes for records in keys.values() for r in records)
        assert stats.bytes_streamed + stats.bytes_tail == received
        for req_id in prompts:
            records = keys[req_id]
            assert len(records) > before_last[req_id] >= 2
            groups = {r.group for r in records if r.num_slots}
            assert groups == set(range(len(specs)))  # every group travelled
            for g, spec in enumerate(specs):
                if spec.is_sliding:  # the window's pages lie in the last chunk: the tail
                    continue
                early = sum(r.num_slots for r in records[: before_last[req_id]] if r.group == g)
                total = sum(r.num_slots for r in records if r.group == g)
                # history pages: all but those of the last chunk (+ the MTP row) went early
                late = -(-(remaining[req_id] + 1) // spec.block_tokens) + 1
                assert early > 0 and total - early <= late, (spec.name, early, total)
        assert consumer.kv_connector.num_failures == 0
        assert len(producer.kv_connector.store) == 0
        assert consumer.scheduler.kv.usage == 0 and producer.scheduler.kv.usage == 0
    finally:
        for core in (aggregated, producer, consumer):
            core.shutdown()


def _key(req_id: str, ids: list[int]) -> str:
    return transfer_key(req_id, ids[:-1])  # the prefill side runs prompt[:N-1]


def test_prefill_aborted_mid_stream_recomputes(tiny):
    """The prefill request is aborted while a streaming pull waits on it: the pull fails at
    once (not after the lease), the decode side recomputes, nothing is left held."""
    ids = torch.randint(10, 4000, (300,), generator=torch.Generator().manual_seed(4)).tolist()
    aggregated = make_core(tiny)
    producer = make_core(tiny, producer_config(lease_s=60), max_num_batched_tokens=CHUNK)
    consumer = make_core(tiny, consumer_config(lease_s=60))
    try:
        aggregated.add_request(request("a", ids, None))
        want: dict[str, list[int]] = {}
        drain(aggregated, want)
        producer.add_request(request("a", ids, KVTransferParams(True, transfer_id="a")))
        for _ in range(3):
            producer.step()
        host, port = producer.kv_connector.server.address
        kv = KVTransferParams(
            do_remote_prefill=True, transfer_id="a", remote_host=host, remote_port=port
        )
        consumer.add_request(request("a", ids, kv))
        consumer.step()
        deadline = time.monotonic() + 10
        while not producer.kv_connector.store.is_watched(_key("a", ids)):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        producer.step()  # the blocks finished so far go out
        log = consumer.kv_connector.client.pieces
        while not log.records(_key("a", ids)):  # the pull is streaming
            assert time.monotonic() < deadline
            time.sleep(0.01)
        start = time.monotonic()
        producer.abort_requests(["a"])
        got: dict[str, list[int]] = {}
        drain(consumer, got)
        assert time.monotonic() - start < 10  # the lease is 60 s
        assert got == want
        assert consumer.kv_connector.num_failures == 1
        assert len(producer.kv_connector.store) == 0
        assert consumer.scheduler.kv.usage == 0 and producer.scheduler.kv.usage == 0
    finally:
        for core in (aggregated, producer, consumer):
            core.shutdown()


def test_pull_outlives_a_queued_prefill(tiny):
    """A streaming pull waits 4 leases on a prefill that has not started (queued): the
    producer's keepalives hold the connection and its entry; the KV then lands."""
    ids = torch.randint(10, 4000, (150,), generator=torch.Generator().manual_seed(6)).tolist()
    lease = 0.5
    producer = make_core(tiny, producer_config(lease_s=lease), max_num_batched_tokens=CHUNK)
    consumer = make_core(tiny, consumer_config(lease_s=lease))
    try:
        producer.add_request(request("q", ids, KVTransferParams(True, transfer_id="q")))
        host, port = producer.kv_connector.server.address
        kv = KVTransferParams(
            do_remote_prefill=True, transfer_id="q", remote_host=host, remote_port=port
        )
        consumer.add_request(request("q", ids, kv))
        consumer.step()
        time.sleep(4 * lease)  # the producer does not step: the prefill waits in its queue
        assert producer.kv_connector.store.is_watched(_key("q", ids))
        drain(producer, {})
        got: dict[str, list[int]] = {}
        drain(consumer, got)
        assert len(got["q"]) == PARAMS.max_tokens
        assert consumer.kv_connector.num_failures == 0 and consumer.kv_connector.num_loads == 1
        assert len(producer.kv_connector.store) == 0
    finally:
        producer.shutdown()
        consumer.shutdown()
