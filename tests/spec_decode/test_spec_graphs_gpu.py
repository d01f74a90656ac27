"""GPU check (``pytest -m gpu``; never in CI): speculating with captured CUDA graphs (the
verify step, the draft model's chain, the proposal graphs) gives the eager engine's tokens,
greedy and seeded."""

from __future__ import annotations

import pytest
import torch

from rackserve.config import SpecConfig
from rackserve.request import SamplingParams

from spec_utils import close_draft_dir, mixed_params_prompts, run, spec_engine, target_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def cuda_engine(model_dir, spec, enforce_eager: bool):
    # a fixed KV budget: with pytest -n 2 the other worker's memory is not this engine's
    return spec_engine(
        model_dir, spec, max_num_seqs=4, device="cuda", enforce_eager=enforce_eager,
        kv_cache_memory=1 << 30,
    )  # fmt: skip


@pytest.mark.parametrize("greedy", [False, True])  # True: the whole-proposal graphs too
@pytest.mark.parametrize("method", ["mtp", "draft_model"])
def test_graphs_equal_eager_on_gpu(target_dir, close_draft_dir, method, greedy):
    spec = (
        SpecConfig("mtp", 3)
        if method == "mtp"
        else SpecConfig("draft_model", 3, str(close_draft_dir))
    )
    prompts, params = mixed_params_prompts()
    if greedy:
        params = {
            r: SamplingParams(temperature=0, max_tokens=p.max_tokens, ignore_eos=True)
            for r, p in params.items()
        }
    eager = run(cuda_engine(target_dir, spec, True), prompts, params)
    core = cuda_engine(target_dir, spec, False)
    proposer = core.runner.proposer
    assert proposer.graphs is not None and proposer.graphs.set.graphs
    assert proposer.proposal_graphs is not None and proposer.proposal_graphs.set.graphs
    assert run(core, prompts, params) == eager
