"""The speculation graphs' padded steps (spec_decode/graphs.py) against the eager path, on
CPU: an uncaptured key runs the very step a graph replays (padded requests on the null row,
every token a closing candidate, the context bucket as max length), so equal tokens here
check everything but the capture itself (tests/spec_decode/test_spec_graphs_gpu.py)."""

from __future__ import annotations

import pytest

from rackserve.config import SpecConfig
from rackserve.kv.spec import CacheGroupSpec
from rackserve.request import SamplingParams
from rackserve.spec_decode.checkpoint import DRAFT_PREFIX

from spec_utils import close_draft_dir, mixed_params_prompts, run, spec_engine, target_dir

BATCH_SIZES = [1, 2, 4]  # 3 requests pad to 4; fewer as they finish
BUCKETS = [32, 64, 1100]


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
        """Each step's drafts, as the runner hands them to the scheduler."""
        runner = core.runner
        collect = runner.collect

        def recorded(handle):
            out = collect(handle)
            drafts.append(out.draft_token_ids)
            return out

        runner.collect = recorded
        return core

    want, got = [], []
    eager = run(recording(spec_engine(target_dir, spec, max_num_seqs=4), want), prompts, params)
    counts = {"verify": 0, "chain": 0, "proposal": 0}
    core = with_graphs(spec_engine(target_dir, spec, max_num_seqs=4), counts)
    assert run(recording(core, got), prompts, params) == eager
    assert core.scheduler.kv.usage == 0.0
    assert counts["proposal"] > 5 and counts["proposal"] >= counts["verify"] - 1, counts
    # the same drafts, step by step (outputs alone would not show it: verification is exact)
    assert got == want and any(any(d.values()) for d in want)
