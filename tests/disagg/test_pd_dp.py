"""A prefill engine with 2 data-parallel ranks (gloo, CPU): each rank serves its KV on
kv_port + rank, the API side says which rank ran a request (``kv_transfer_port``, what the
serving layer puts into the response's kv_transfer_params for the router), and a decode
engine that pulls from there (policy "fail": a wrong address would fail, not recompute)
gives an aggregated engine's tokens."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
import torch
from transformers import AutoTokenizer

from rackserve.config import (
    CacheConfig,
    ConfigError,
    DisaggConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from rackserve.engine.dp_client import DPAsyncEngineClient
from rackserve.engine.dp_process import kv_transfer_for_rank
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.engine.request_output import RequestOutputKind
from rackserve.model.create import create_checkpoint
from rackserve.model.presets import tiny_config
from rackserve.request import KVTransferParams, SamplingParams

from disagg_utils import consumer_config, drain, make_core, producer_config

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return create_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny"), seed=0)


def dp_config(model_dir, kv: DisaggConfig | None, dp: int = 2) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        model_config=ModelConfig.from_pretrained(model_dir),
        cache=CacheConfig(kv_cache_memory=32 << 20),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024),
        device="cpu",
        parallel=ParallelConfig(data_parallel_size=dp),
        kv_transfer=kv,
    )


def test_each_rank_gets_its_kv_port(tiny):
    config = dp_config(tiny, producer_config())
    port = config.kv_transfer.kv_port
    assert kv_transfer_for_rank(config, 0) is config
    assert kv_transfer_for_rank(config, 1).kv_transfer.kv_port == port + 1
    consumer = dp_config(tiny, consumer_config())
    assert kv_transfer_for_rank(consumer, 3) is consumer  # consumers bind nothing
    high = dp_config(tiny, DisaggConfig(kv_role="kv_producer", kv_port=65535))
    with pytest.raises(ConfigError, match="not a valid port"):
        kv_transfer_for_rank(high, 1)


def test_dp2_prefill_ranks_serve_their_requests_kv(tiny):
    g = torch.Generator().manual_seed(7)
    prompts = {f"d{i}": torch.randint(10, 4000, (30 + 23 * i,), generator=g).tolist()
               for i in range(6)}  # fmt: skip
    aggregated = make_core(tiny)
    for req_id, ids in prompts.items():
        aggregated.add_request(EngineCoreRequest(req_id, ids, PARAMS, time.time()))
    want: dict[str, list[int]] = {}
    drain(aggregated, want)
    aggregated.shutdown()

    kv = producer_config()
    base = kv.kv_port
    ports: dict[str, int] = {}

    async def prefill_all() -> None:
        client = DPAsyncEngineClient(
            dp_config(tiny, kv), AutoTokenizer.from_pretrained(tiny), startup_timeout_s=120
        )
        await client.start()
        try:

            async def one(req_id: str, ids: list[int]) -> None:
                params = replace(
                    PARAMS, kv_transfer_params=KVTransferParams(True, transfer_id=req_id)
                )
                async for _ in client.generate(
                    req_id, ids, params, kind=RequestOutputKind.FINAL_ONLY
                ):
                    pass
                ports[req_id] = client.kv_transfer_port(req_id, base)

            await asyncio.gather(*(one(r, ids) for r, ids in prompts.items()))
            # the decode side pulls while the ranks still hold the copies
            consumer = make_core(tiny, consumer_config(kv_load_failure_policy="fail"))
            try:
                for req_id, ids in prompts.items():
                    params = KVTransferParams(
                        do_remote_prefill=True, transfer_id=req_id, remote_host="127.0.0.1",
                        remote_port=ports[req_id],
                    )  # fmt: skip
                    p = replace(PARAMS, kv_transfer_params=params)
                    consumer.add_request(EngineCoreRequest(req_id, ids, p, time.time()))
                got: dict[str, list[int]] = {}
                await asyncio.to_thread(drain, consumer, got)
                assert not consumer.take_request_errors()
                assert got == want
                assert consumer.kv_connector.num_loads == len(prompts)
            finally:
                consumer.shutdown()
        finally:
            await client.shutdown()

    asyncio.run(prefill_all())
    assert set(ports.values()) == {base, base + 1}  # both ranks prefilled some
