"""DEP engine ranks (gloo processes): greedy tokens and logprobs equal one rank's, idle ranks
run the dummy pass, and the loader holds only each rank's experts."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from rackserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from rackserve.engine.core import EngineCore
from rackserve.engine.dp import run_until_idle
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.model.create import create_checkpoint
from rackserve.model.presets import tiny_config
from rackserve.parallel.launch import run_ranks
from rackserve.request import SamplingParams

KV_BYTES = 24 << 20
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # 2 layers (one hash MoE, one learned), 8 experts: the smallest model with both routers.
    cfg = tiny_config(num_layers=2, num_experts=8, vocab_size=512)
    return create_checkpoint(cfg, tmp_path_factory.mktemp("dep"), seed=3, with_mtp=False)


def engine_config(model_dir: Path, parallel: ParallelConfig) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        model_config=ModelConfig.from_pretrained(model_dir),
        cache=CacheConfig(kv_cache_memory=KV_BYTES),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256),
        device="cpu",
        parallel=parallel,
    )


def prompts(num: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(0)
    return {
        f"r{i}": torch.randint(2, 512, (int(5 + 7 * i),), generator=gen).tolist()
        for i in range(num)
    }


def collect(core: EngineCore, requests: dict[str, list[int]], run) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    for req_id, ids in requests.items():
        core.add_request(EngineCoreRequest(req_id, ids, params, time.time()))
    tokens: dict[str, list[int]] = {r: [] for r in requests}
    logprobs: dict[str, list[list[float]]] = {r: [] for r in requests}
    for step in run():
        for out in step.outputs:
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += [lp.logprobs for lp in out.new_logprobs or []]
    return {"tokens": tokens, "logprobs": logprobs}


def dep_worker(groups, model_dir: str, assignment: list[dict[str, list[int]]], kw: dict) -> dict:
    parallel = ParallelConfig(
        data_parallel_size=groups.world_size, enable_expert_parallel=True, **kw
    )
    core = EngineCore(engine_config(Path(model_dir), parallel), log_stats=False, groups=groups)
    experts = core.model.model.layers[0].ffn.experts
    result = collect(core, assignment[groups.rank], lambda: run_until_idle(core, groups))
    result["local_slots"] = experts.w13.shape[0]
    result["steps"] = core.ep.num_steps
    return result


def single_rank(model_dir: Path, requests: dict[str, list[int]]) -> dict:
    core = EngineCore(engine_config(model_dir, ParallelConfig()), log_stats=False)

    def run():
        while core.has_unfinished_requests():
            yield core.step()

    return collect(core, requests, run)


def check_equal(reference: dict, results: list[dict]) -> None:
    for result in results:
        for req_id, tokens in result["tokens"].items():
            assert tokens == reference["tokens"][req_id], req_id
            assert len(tokens) == MAX_TOKENS
            got = torch.tensor(result["logprobs"][req_id])
            want = torch.tensor(reference["logprobs"][req_id])
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_dep2_equals_one_rank_with_an_idle_rank(model_dir):
    requests = prompts(3)
    reference = single_rank(model_dir, requests)
    # Rank 1 gets nothing: it runs the dummy pass every step so rank 0's dispatch completes.
    results = run_ranks(dep_worker, 2, str(model_dir), [requests, {}], {})
    check_equal(reference, results)
    assert [r["local_slots"] for r in results] == [4, 4]  # 8 experts over 2 ranks
    assert results[0]["steps"] == results[1]["steps"] > 0  # the ranks stepped together


@pytest.mark.slow
def test_dep4_with_redundant_experts_equals_one_rank(model_dir):
    requests = prompts(5)
    reference = single_rank(model_dir, requests)
    names = list(requests)
    assignment = [{n: requests[n] for n in names[r::3]} for r in range(3)] + [{}]
    results = run_ranks(dep_worker, 4, str(model_dir), assignment, {"num_redundant_experts": 4})
    check_equal(reference, results)
    assert [r["local_slots"] for r in results] == [3, 3, 3, 3]  # (8 + 4) / 4


def test_dep2_splits_requests_both_ranks_busy(model_dir):
    requests = prompts(4)
    reference = single_rank(model_dir, requests)
    names = list(requests)
    assignment = [{n: requests[n] for n in names[:1]}, {n: requests[n] for n in names[1:]}]
    results = run_ranks(dep_worker, 2, str(model_dir), assignment, {"num_redundant_experts": 2})
    check_equal(reference, results)
