"""The speculation graphs' padded steps (spec_decode/graphs.py) against the eager path, on
CPU: an uncaptured key runs the very step a graph replays (padded requests on the null row,
every token a closing candidate, the context bucket as max length), so equal tokens here
check everything but the capture itself (tests/spec_decode/test_spec_graphs_gpu.py)."""

from __future__ import annotations

import time

import pytest
import torch

from rackserve.config import SpecConfig
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.kv.spec import CacheGroupSpec
from rackserve.request import SamplingParams
from rackserve.spec_decode.checkpoint import DRAFT_PREFIX

from spec_utils import (
    close_draft_dir,
    kv_budget,
    mixed_params_prompts,
    run,
    spec_engine,
    target_dir,
)

BATCH_SIZES = [1, 2, 4]  # 3 requests pad to 4; fewer as they finish
BUCKETS = [32, 64, 1100]
COUNTS = ("verify", "chain", "proposal")  # graph uses (with_graphs)


def with_graphs(core, counts: dict[str, int]):
    """Enable the speculation graphs (uncaptured) on ``core``'s runner, counting uses."""
    runner = core.runner
    groups: list[CacheGroupSpec] = [
        g for g in runner.caches.groups.values() if not g.name.startswith(DRAFT_PREFIX)
    ]
    proposer = runner.proposer
    proposer.enable_graphs(
        runner.model, runner.caches, runner.buffers, groups, BATCH_SIZES, BUCKETS, capture=False
    )

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            counts[name] += out is not None
            return out

        return wrapper

    proposer.graphs.run = counted("verify", proposer.graphs.run)
    if getattr(proposer, "draft_graphs", None) is not None:
        proposer.draft_graphs.run = counted("chain", proposer.draft_graphs.run)
    proposer.proposal_graphs.run = counted("proposal", proposer.proposal_graphs.run)
    return core


@pytest.mark.parametrize("method", ["mtp", "draft_model"])
def test_graph_steps_equal_eager(target_dir, close_draft_dir, method):
    spec = (
        SpecConfig("mtp", 2)
        if method == "mtp"
        else SpecConfig("draft_model", 3, str(close_draft_dir))
    )
    prompts, params = mixed_params_prompts()
    eager = run(spec_engine(target_dir, spec, max_num_seqs=4), prompts, params)
    counts = {"verify": 0, "chain": 0, "proposal": 0}
    core = with_graphs(spec_engine(target_dir, spec, max_num_seqs=4), counts)
    assert run(core, prompts, params) == eager
    assert core.scheduler.kv.usage == 0.0
    assert counts["verify"] > 5  # most steps are uniform verify steps
    if method == "draft_model":
        assert counts["chain"] > 5


@pytest.mark.parametrize(
    "method,k", [("mtp", 1), ("mtp", 3), ("draft_model", 2), ("draft_model", 4)]
)
def test_proposal_graph_equals_eager(target_dir, close_draft_dir, method, k):
    """All greedy: after each uniform verify step the whole proposal is one padded graph
    step (MTP: each request's kept rows padded to 1 + K; the draft model: its kept tokens
    and y padded to 2 + K; padding on the null row), then the chain. The random MTP layer
    accepts little, the close draft much: both short and full kept runs are exercised;
    requests end apart, so batches shrink and pad to the graph's batch size."""
    spec = SpecConfig(method, k, None if method == "mtp" else str(close_draft_dir))
    prompts, params = mixed_params_prompts()
    params = {
        r: SamplingParams(temperature=0, max_tokens=p.max_tokens, ignore_eos=True)
        for r, p in params.items()
    }

    def recording(core, drafts: list):
        """Each step's verified drafts, as its collect reads them (proposed on the device:
        fed there, their ids read back behind the next step's)."""
        runner = core.runner
        emit = runner._emit

        def recorded(reqs, inputs, num_rows, *args):
            sampled = [k for k, s in enumerate(inputs.sample_mask) if s]
            rows = zip(sampled, num_rows, strict=True)
            drafts.append({reqs[k].req_id: reqs[k].token_ids[1 - n :] for k, n in rows if n > 1})
            return emit(reqs, inputs, num_rows, *args)

        runner._emit = recorded
        return core

    want, got = [], []
    eager = run(recording(spec_engine(target_dir, spec, max_num_seqs=4), want), prompts, params)
    counts = {"verify": 0, "chain": 0, "proposal": 0}
    core = with_graphs(spec_engine(target_dir, spec, max_num_seqs=4), counts)
    assert run(recording(core, got), prompts, params) == eager
    assert core.scheduler.kv.usage == 0.0
    assert counts["proposal"] > 5 and counts["proposal"] >= counts["verify"] - 1, counts
    # the same drafts, step by step (outputs alone would not show it: verification is exact)
    assert got == want and sum(map(len, want)) > 10


@pytest.mark.parametrize("method", ["mtp", "draft_model"])
def test_drafts_left_on_the_device_are_fed_or_read_back(target_dir, close_draft_dir, method):
    """The drafts a graph proposes stay on the device: the scheduler holds placeholders and
    the next launch feeds the ids into the verify's inputs there. Drafts proposed before
    the last collected step (a request the scheduler left out of a step; forced here every
    other step) have landed on the host and replace the placeholders at the launch. A
    request with a penalty reads the drafts on the host: the steps it is in propose there
    (the others on the device). The tokens and the drafts each step verifies are the eager
    engine's."""
    spec = SpecConfig(method, 3, None if method == "mtp" else str(close_draft_dir))
    prompts = {"a": [5, 9, 300, 4, 71], "b": list(range(20, 60)), "c": [8] * 12, "d": [3, 4]}
    params = {
        r: SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
        for r, m in zip(prompts, (24, 30, 18, 20), strict=True)
    }
    penalised = dict(params, d=SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                               presence_penalty=0.5))  # fmt: skip

    def recording(core, verified: list):
        """Each step's verified drafts, as its collect reads them."""
        runner = core.runner
        emit = runner._emit

        def recorded(reqs, inputs, num_rows, *args):
            rows = zip([k for k, s in enumerate(inputs.sample_mask) if s], num_rows, strict=True)
            verified.append({reqs[k].req_id: reqs[k].token_ids[1 - n :] for k, n in rows if n > 1})
            return emit(reqs, inputs, num_rows, *args)

        runner._emit = recorded
        return core

    def counting(core, paths: dict[str, int]):
        """How many requests' drafts were fed on the device, and read back at a launch."""
        runner = core.runner
        take = runner._take_drafts

        def counted(sched):
            drafts = sched.scheduled_spec_decode_tokens.values()
            placeholders = sum(runner.placeholder in d for d in drafts)
            pending = take(sched)
            paths["fed"] += len(pending)
            paths["read"] += placeholders - len(pending)
            return pending

        runner._take_drafts = counted
        collect = runner.collect

        def timed(handle):  # the proposal's device time, a step late
            out = collect(handle)
            paths["timed"] += out.propose_time_s > 0
            return out

        runner.collect = timed
        return core

    def skipping(core):
        """Every other collected step forgotten as the last one: its drafts count as older."""
        runner = core.runner
        collect, calls = runner.collect, [0]

        def collected(handle):
            out = collect(handle)
            calls[0] += 1
            if calls[0] % 2:
                runner._last_collected = None
            return out

        runner.collect = collected
        return core

    verified = {"plain": [], "penalised": []}  # by the eager engines, step by step
    expected = {
        case: run(recording(spec_engine(target_dir, spec, max_num_seqs=4), verified[case]),
                  prompts, p)
        for case, p in (("plain", params), ("penalised", penalised))
    }  # fmt: skip
    for case in ("fed", "read", "penalised"):
        got, paths = [], {"fed": 0, "read": 0, "timed": 0}
        graphs = with_graphs(
            spec_engine(target_dir, spec, max_num_seqs=4), dict.fromkeys(COUNTS, 0)
        )
        core = counting(recording(graphs, got), paths)
        if case == "read":
            core = skipping(core)
        requests = penalised if case == "penalised" else params
        eager = "penalised" if case == "penalised" else "plain"
        assert run(core, prompts, requests) == expected[eager]
        assert got == verified[eager] and sum(map(len, got)) > 10
        if case == "fed":
            assert paths["fed"] > 10 and paths["read"] == 0, paths
            assert paths["timed"] > 5, paths  # steps, each one after a device proposal
            fed = paths["fed"]
        elif case == "read":
            assert paths["read"] > 5 and paths["fed"] > 5, paths
        else:  # the steps with d propose on the host; once it finished, on the device
            assert paths["read"] == 0 and paths["fed"] < fed / 2, (paths, fed)


@pytest.mark.parametrize("method", ["mtp", "draft_model"])
def test_drafts_on_the_device_under_preemption_prefix_hits_and_aborts(
    target_dir, close_draft_dir, method
):
    """The drafts left on the device against the plain engine, greedy, token for token: a
    KV budget that preempts (a preempted request drops its placeholders and drafts again
    after its recompute), prompts that share a prefix, and a request aborted while its
    drafts are in flight. Every block comes back."""
    spec = SpecConfig(method, 3, None if method == "mtp" else str(close_draft_dir))
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(2, 512, (40,), generator=g).tolist()
    prompts = {
        f"r{i}": (shared if i % 2 else []) + torch.randint(2, 512, (n,), generator=g).tolist()
        for i, n in enumerate((7, 60, 25, 90, 12, 33, 48))
    }
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    aborted, abort_at = "r0", 6  # after its prefill, mid-decode

    def outputs(core, abort: bool = True) -> dict[str, list[int]]:
        for req_id, ids in prompts.items():
            core.add_request(EngineCoreRequest(req_id, ids, params, time.time()))
        found: dict[str, list[int]] = {r: [] for r in prompts}
        for step in range(10_000):
            if not core.has_unfinished_requests():
                break
            if abort and step == abort_at:
                core.abort_requests([aborted])
            for out in core.step().outputs:
                found[out.request_id] += out.new_token_ids
        assert not core.has_unfinished_requests()
        assert core.scheduler.kv.usage == 0.0
        return found

    def engine(spec_config):
        budget = kv_budget(target_dir, spec, tokens=260, max_num_seqs=4, max_num_batched_tokens=64)
        return spec_engine(target_dir, spec_config, max_num_seqs=4, max_num_batched_tokens=64,
                           max_model_len=256, kv_cache_memory=budget)  # fmt: skip

    plain = outputs(engine(None), abort=False)  # greedy tokens do not depend on the batch
    core = with_graphs(engine(spec), dict.fromkeys(COUNTS, 0))
    runner, fed = core.runner, []
    take = runner._take_drafts

    def counted(sched):
        pending = take(sched)
        fed.extend(p[0] for p in pending)
        return pending

    runner._take_drafts = counted
    got = outputs(core)
    cut = got.pop(aborted)
    assert 0 < len(cut) < params.max_tokens and cut == plain.pop(aborted)[: len(cut)]
    assert got == plain
    assert core.scheduler.num_preemptions > 0 and len(fed) > 10
    assert core.scheduler.stats().prefix_cache_hits > 0
