"""The prefill side's KV export runs after t1's answer is out, not between the sampled token
and the answer: the step returns (and the engine loop queues) the output first, the blocks
are freed at once as before, and the decode side still pulls the right KV."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import msgspec
import pytest
import torch
import zmq

import rackserve.disagg.prefill_side as prefill_side_module
from rackserve.disagg.wire import transfer_key
from rackserve.engine.outputs import EngineCoreOutputs, EngineCoreRequest
from rackserve.engine.process import EngineCoreProc, EngineProcessConfig, MessageType
from rackserve.model.create import create_checkpoint
from rackserve.model.presets import tiny_config
from rackserve.request import KVTransferParams, SamplingParams
from rackserve.runner.kv_transfer import ExportedRows

from disagg_utils import consumer_config, decode, drain, make_core, producer_config

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SLOW_EXPORT_S = 0.2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return create_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(10, 4000, (90,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def expected(tiny, prompt):
    core = make_core(tiny)
    outputs: dict[str, list[int]] = {}
    core.add_request(EngineCoreRequest("a", prompt, PARAMS, time.time()))
    drain(core, outputs)
    return outputs["a"]


def _prefill_request(req_id: str, prompt: list[int]) -> EngineCoreRequest:
    kv = KVTransferParams(do_remote_decode=True, transfer_id=req_id)
    return EngineCoreRequest(req_id, prompt, replace(PARAMS, kv_transfer_params=kv), time.time())


def _slow_exports(monkeypatch, on_export) -> list[float]:
    """ExportedRows made slow (a long gather), calling ``on_export()`` as it starts."""
    started: list[float] = []

    class SlowRows(ExportedRows):
        def __init__(self, caches, block_ids):
            on_export()
            started.append(time.monotonic())
            time.sleep(SLOW_EXPORT_S)
            super().__init__(caches, block_ids)

    monkeypatch.setattr(prefill_side_module, "ExportedRows", SlowRows)
    return started


@pytest.mark.parametrize("flush", ["loop", "next_step"])
def test_step_returns_t1_before_the_export(tiny, prompt, expected, monkeypatch, flush):
    """``flush``: the loop calls flush_kv_exports after sending; or a driver that does not
    (a test's drain) gets the export at the next step's start."""
    producer = make_core(tiny, producer_config())
    consumer = make_core(tiny, consumer_config())
    started = _slow_exports(monkeypatch, lambda: None)
    store = producer.kv_connector.store
    key = transfer_key("a", prompt[:-1])
    try:
        producer.add_request(_prefill_request("a", prompt))
        firsts: dict[str, list[int]] = {}
        while not firsts:
            for out in producer.step().outputs:
                if out.new_token_ids:
                    firsts[out.request_id] = out.new_token_ids
        assert firsts == {"a": expected[:1]}
        assert started == []  # the answer left step() before any export work
        assert producer.scheduler.kv.usage == 0  # its blocks are freed at once, as before
        assert store.get(key) is None  # the entry is open, its rows not there yet
        assert producer.has_unfinished_requests()  # a loop steps once more for the export
        if flush == "loop":
            producer.flush_kv_exports()
        else:
            drain(producer, {})
        assert len(started) == 1 and store.get(key) is not None
        assert not producer.has_unfinished_requests()
        assert decode(consumer, producer, {"a": prompt}, PARAMS, firsts=firsts) == {"a": expected}
        assert consumer.kv_connector.num_loads == 1 and consumer.kv_connector.num_failures == 0
        assert len(store) == 0 and consumer.scheduler.kv.usage == 0
    finally:
        producer.shutdown()
        consumer.shutdown()


def _queued_first_token(proc: EngineCoreProc, req_id: str) -> bool:
    """Whether an OUTPUTS message with ``req_id``'s first token waits in the output queue."""
    for frames in list(proc.output_queue.queue):
        if frames is None or frames[0] != bytes([MessageType.OUTPUTS]):
            continue
        outputs = msgspec.msgpack.decode(frames[1], type=EngineCoreOutputs)
        if any(o.request_id == req_id and o.new_token_ids for o in outputs.outputs):
            return True
    return False


def test_engine_loop_queues_the_answer_before_the_export(tiny, prompt, tmp_path, monkeypatch):
    """The engine process's loop (its IO threads not started: messages stay queued): when
    the export starts, t1's OUTPUTS message is already on its way to the API process."""
    core = make_core(tiny, producer_config())
    answered_first: list[bool] = []
    config = EngineProcessConfig(
        core.config, f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", os.getpid()
    )
    context = zmq.Context()
    proc = EngineCoreProc(core, context, config)
    _slow_exports(monkeypatch, lambda: answered_first.append(_queued_first_token(proc, "a")))
    try:
        proc.input_queue.put((MessageType.ADD, _prefill_request("a", prompt)))
        deadline = time.monotonic() + 60
        while not answered_first:
            assert time.monotonic() < deadline, "the export never ran"
            proc._iterate()
        assert answered_first == [True]
        assert not core.has_unfinished_requests() and core.scheduler.kv.usage == 0
        assert core.kv_connector.store.get(transfer_key("a", prompt[:-1])) is not None
    finally:
        core.shutdown()
        context.destroy(linger=0)
