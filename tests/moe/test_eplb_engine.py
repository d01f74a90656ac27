"""EPLB inside DEP engine ranks (gloo processes): with skewed routing the balancedness is low
without EPLB and near uniform routing's after a rebalance; a rearrangement running while
requests decode changes no greedy token."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from rackserve.config import (
    CacheConfig,
    EngineConfig,
    EPLBConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from rackserve.engine.core import EngineCore
from rackserve.engine.dp import dp_step, run_until_idle
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.model.create import create_checkpoint
from rackserve.model.presets import tiny_config
from rackserve.parallel.launch import run_ranks
from rackserve.request import SamplingParams

VOCAB = 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    cfg = tiny_config(num_layers=2, num_experts=16, vocab_size=VOCAB)
    return create_checkpoint(cfg, tmp_path_factory.mktemp("eplb"), seed=5, with_mtp=False)


def config(model_dir: Path, parallel: ParallelConfig, batched_tokens: int) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        model_config=ModelConfig.from_pretrained(model_dir),
        cache=CacheConfig(kv_cache_memory=32 << 20, enable_prefix_caching=False),
        scheduler=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=batched_tokens, max_model_len=256
        ),
        device="cpu",
        parallel=parallel,
    )


def add(core: EngineCore, prefix: str, num: int, length: int, seed: int, max_tokens: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(num):
        ids = torch.randint(2, VOCAB, (length,), generator=gen).tolist()
        core.add_request(EngineCoreRequest(f"{prefix}{i}", ids, params, time.time()))


def balance_worker(groups, model_dir: str) -> dict:
    parallel = ParallelConfig(
        data_parallel_size=groups.world_size,
        enable_expert_parallel=True,
        num_redundant_experts=4,
        enable_eplb=True,
        # window 1: balancedness of the last step only; no automatic rebalance here
        eplb=EPLBConfig(window_size=1, step_interval=10_000),
        skewed_routing=2.5,
    )
    core = EngineCore(config(Path(model_dir), parallel, 512), log_stats=False, groups=groups)
    ep = core.ep
    # One prefill step of 512 tokens per rank (max_tokens=1: the prefill is the only step).
    add(core, "a", 4, 128, seed=10 + groups.rank, max_tokens=1)
    run_until_idle(core, groups)
    before, uniform = ep.balancedness()
    ep.rebalance()  # the window's loads, all-reduced: every rank computes the same target
    while ep.rearranging:
        core.step()  # idle steps (dummy passes) land one layer per step boundary
    add(core, "b", 4, 128, seed=20 + groups.rank, max_tokens=1)
    run_until_idle(core, groups)
    after, uniform_after = ep.balancedness()
    return {"before": before, "after": after, "uniform": uniform, "uniform_after": uniform_after}


def test_eplb_recovers_the_gap_to_uniform_routing(model_dir):
    results = run_ranks(balance_worker, 4, str(model_dir))
    first = results[0]
    for r in results[1:]:  # the metric is all-reduced over EP: every rank reports the same
        assert r["before"] == pytest.approx(first["before"])
        assert r["after"] == pytest.approx(first["after"])
    before, after = torch.tensor(first["before"]), torch.tensor(first["after"])
    uniform = torch.tensor(first["uniform"])
    assert (before <= 0.5).all(), first
    assert (after >= 0.9).all(), first
    assert ((after - before) >= 0.9 * (uniform - before)).all(), first


def decode_worker(groups, model_dir: str, eplb: bool) -> dict:
    parallel = ParallelConfig(
        data_parallel_size=groups.world_size,
        enable_expert_parallel=True,
        num_redundant_experts=2,
        enable_eplb=eplb,
        eplb=EPLBConfig(window_size=4, step_interval=3),
        skewed_routing=1.5,
    )
    core = EngineCore(config(Path(model_dir), parallel, 64), log_stats=False, groups=groups)
    add(core, f"r{groups.rank}-", 3, 20 + 9 * groups.rank, seed=groups.rank, max_tokens=10)
    tokens: dict[str, list[int]] = {}
    moved_while_running = 0
    last = None
    while True:
        step, any_work, _ = dp_step(core, groups)
        if not any_work:
            break
        assert step is not None
        last = step
        moved_while_running += int(core.ep.rearranging and core.has_unfinished_requests())
        for out in step.outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert last is not None and last.scheduler_stats is not None
    exported = last.scheduler_stats.expert_balancedness  # refreshed every window (4 steps)
    default = torch.arange(18) % 16
    changed = int((core.ep.placement.physical_to_logical.cpu() != default).sum())
    return {
        "tokens": tokens,
        "rebalances": core.ep.num_rebalances,
        "moving_steps": moved_while_running,
        "changed": changed,
        "exported": exported,
    }


def test_rearrangement_during_decode_changes_no_token(model_dir):
    plain = run_ranks(decode_worker, 2, str(model_dir), False)
    balanced = run_ranks(decode_worker, 2, str(model_dir), True)
    for a, b in zip(plain, balanced, strict=True):
        assert a["tokens"] == b["tokens"]
        assert all(len(t) == 10 for t in b["tokens"].values())
        assert a["rebalances"] == 0 and a["changed"] == 0
        assert b["rebalances"] >= 2  # every 3 steps while decoding
        assert b["moving_steps"] > 0  # layers landed while requests were running
        assert b["changed"] > 0  # the placement really moved
        for result in (a, b):  # the metric: one value per MoE layer, in (0, 1]
            assert len(result["exported"]) == 2
            assert all(0 < v <= 1 for v in result["exported"])
