"""NIXL moves the KV (UCX, DRAM on the CPU) where the package is installed; skipped elsewhere
(nixl is not a dependency: ``pip install nixl nixl-cu13`` to run it)."""

from __future__ import annotations

import time

import pytest
import torch

from rackserve.engine.outputs import EngineCoreRequest
from rackserve.model.create import create_checkpoint
from rackserve.model.presets import tiny_config
from rackserve.request import SamplingParams

from disagg_utils import consumer_config, decode, drain, make_core, prefill, producer_config

nixl = pytest.importorskip("nixl")
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return create_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny"), seed=0)


def test_nixl_agents_move_bytes():
    from rackserve.disagg.nixl import NixlAgent

    producer, consumer = NixlAgent("p"), NixlAgent("c")
    region = torch.randn(3000, dtype=torch.float32)
    out = torch.zeros_like(region)
    metadata, descs, registration = producer.expose(region)
    try:
        consumer.read(metadata, descs, out, timeout_s=20)
    finally:
        producer.release(registration)
    assert torch.equal(out, region)


@pytest.mark.parametrize("fault", ["", "corrupt_chunk"])
def test_pd_over_nixl_equals_aggregated(tiny, fault):
    g = torch.Generator().manual_seed(5)
    prompts = {f"n{i}": torch.randint(10, 4000, (40 + 37 * i,), generator=g).tolist()
               for i in range(3)}  # fmt: skip
    aggregated = make_core(tiny)
    extra = {"inject_fault": fault} if fault else {}
    producer = make_core(tiny, producer_config("nixl", kv_connector_extra_config=extra))
    consumer = make_core(tiny, consumer_config("nixl"))
    try:
        for req_id, ids in prompts.items():
            aggregated.add_request(EngineCoreRequest(req_id, ids, PARAMS, time.time()))
        want: dict[str, list[int]] = {}
        drain(aggregated, want)
        prefill(producer, prompts, PARAMS)
        assert decode(consumer, producer, prompts, PARAMS) == want  # recomputed on a fault
        connector = consumer.kv_connector
        if fault:
            assert connector.num_failures == len(prompts) and connector.num_loads == 0
        else:
            assert connector.num_loads == len(prompts) and connector.num_failures == 0
            assert connector.num_bytes_received > 0
            assert len(producer.kv_connector.store) == 0
        assert consumer.scheduler.kv.usage == 0
    finally:
        for core in (aggregated, producer, consumer):
            core.shutdown()
