"""Seeded sampling through the engine (issue 14's gate, on CPU): a seeded request gives the
same tokens alone and in a batch of 64 whose other requests are seeded and not, greedy and
random, with other temperatures, top-k and top-p."""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path

import pytest

from rackserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from rackserve.engine.core import EngineCore
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.model.create import create_checkpoint
from rackserve.model.presets import tiny_config
from rackserve.request import SamplingParams

PROBE = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=1234, max_tokens=12)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return create_checkpoint(tiny_config(vocab_size=512), tmp_path_factory.mktemp("m"), seed=2)


def engine(model_dir: Path) -> EngineCore:
    config = EngineConfig(
        model=str(model_dir),
        model_config=ModelConfig.from_pretrained(model_dir),
        cache=CacheConfig(),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=1024),
        device="cpu",
    )
    return EngineCore(config, log_stats=False)


def run(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]):
    for req_id, (ids, params) in requests.items():
        core.add_request(EngineCoreRequest(req_id, ids, params, time.time()))
    outputs: dict[str, list[int]] = {req_id: [] for req_id in requests}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            outputs[out.request_id] += out.new_token_ids
    return outputs


def test_seeded_request_alone_and_in_a_batch_of_64(model_dir):
    prompt = [5, 17, 301, 44, 9, 250, 3]
    alone = run(engine(model_dir), {"probe": (prompt, PROBE)})["probe"]
    requests = {"probe": (prompt, PROBE)}
    for i, (t, k) in enumerate(itertools.product([0.0, 0.5, 1.3], [0, 5, 40] * 7)):
        params = SamplingParams(
            temperature=t,
            top_k=k,
            top_p=0.8 if i % 3 else 1.0,
            seed=None if i % 2 else 1000 + i,
            max_tokens=4 + i % 13,
        )
        requests[f"o{i}"] = ([(7 * i + j) % 500 + 2 for j in range(3 + i % 9)], params)
    assert len(requests) == 64
    batch = run(engine(model_dir), requests)
    assert len(alone) == PROBE.max_tokens and batch["probe"] == alone
    # a request that differs only in its seed samples other tokens: the seed is used
    other = dataclasses.replace(PROBE, seed=1235)
    assert run(engine(model_dir), {"probe": (prompt, other)})["probe"] != alone
