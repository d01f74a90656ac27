"""32 remote-KV requests whose KV lands at once, while 8 requests decode: with the admission
cap (--max-kv-loads-per-step 4) at most 4 join a step (spread over >= 8 steps), without it
(0) all join one step. Step times are printed: on the CPU's tiny model a step's fixed cost
dominates, so the ITL spike the cap prevents is not visible here (measured: max step
0.15-0.29 s either way); benchmarks/gpu_pd.sh measures it on GPUs."""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import pytest
import torch

from rackserve.engine.outputs import EngineCoreRequest
from rackserve.model.create import create_checkpoint
from rackserve.model.presets import tiny_config
from rackserve.request import KVTransferParams, SamplingParams

from disagg_utils import consumer_config, make_core, prefill, producer_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return create_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny"), seed=0)


def burst_step_times(
    tiny, cap: int, num_burst: int, prompt_len: int
) -> tuple[float, float, list[int]]:
    """(median, max) step time of the steps that ran the running decodes while the burst
    was being admitted, and the requests that joined the batch at each step."""
    g = torch.Generator().manual_seed(0)
    burst = {
        f"b{i}": torch.randint(10, 4000, (prompt_len,), generator=g).tolist()
        for i in range(num_burst)
    }
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    producer = make_core(
        tiny, producer_config(lease_s=300), max_num_seqs=64, kv_cache_memory=96 << 20
    )
    consumer = make_core(
        tiny, consumer_config(max_kv_loads_per_step=cap), max_num_seqs=64,
        kv_cache_memory=96 << 20,
    )  # fmt: skip
    try:
        prefill(producer, burst, params)
        running = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        for i in range(8):
            ids = torch.randint(10, 4000, (64,), generator=g).tolist()
            consumer.add_request(EngineCoreRequest(f"run{i}", ids, running, time.time()))
        for _ in range(5):  # the running requests are decoding
            consumer.step()
        host, port = producer.kv_connector.server.address
        for req_id, ids in burst.items():
            kv = KVTransferParams(
                do_remote_prefill=True, transfer_id=req_id, remote_host=host, remote_port=port
            )
            p = replace(params, kv_transfer_params=kv)
            consumer.add_request(EngineCoreRequest(req_id, ids, p, time.time()))
        connector = consumer.kv_connector
        consumer.step()  # admits (all of them without the cap) and starts the pulls
        while not all(r.future.done() for r in connector.inflight.values()):
            time.sleep(0.05)  # the KV arrives together, while the engine is busy elsewhere
        times = []
        deadline = time.monotonic() + 60
        while connector.num_loads < num_burst or connector.num_waiting:
            assert time.monotonic() < deadline
            start = time.perf_counter()
            consumer.step()
            times.append(time.perf_counter() - start)
        for _ in range(5):
            start = time.perf_counter()
            consumer.step()
            times.append(time.perf_counter() - start)
        loads = [r.num_loaded for r in connector.records if r.num_loaded]
        assert sum(loads) == num_burst
        return statistics.median(times), max(times), loads
    finally:
        producer.shutdown()
        consumer.shutdown()


def check(tiny, num_burst: int, prompt_len: int) -> None:
    capped = burst_step_times(tiny, 4, num_burst, prompt_len)
    uncapped = burst_step_times(tiny, 0, num_burst, prompt_len)
    print(f"step time median/max: cap 4 {capped[:2]}, no cap {uncapped[:2]}")
    assert max(capped[2]) <= 4 and len(capped[2]) >= num_burst // 4
    assert max(uncapped[2]) == num_burst  # landed together: joined one step together


def test_admission_cap_spreads_a_burst(tiny):
    check(tiny, num_burst=32, prompt_len=200)


@pytest.mark.slow
def test_admission_cap_spreads_a_long_burst(tiny):
    check(tiny, num_burst=32, prompt_len=900)
