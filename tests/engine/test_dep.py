"""DEP engine ranks (gloo processes): greedy tokens and logprobs equal one rank's, idle ranks
run the dummy pass, and the loader holds only each rank's experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rackserve.config import ParallelConfig
from rackserve.engine.core import EngineCore
from rackserve.engine.dp import run_until_idle
from rackserve.parallel.launch import run_ranks

from dep_utils import MAX_TOKENS, collect, create_model, engine_config, prompts, single_rank


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return create_model(tmp_path_factory.mktemp("dep"))


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
