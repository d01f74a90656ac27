"""Rollback of the hybrid cache: after runs with rejected drafts, every cache group holds
exactly what a request that never saw the rejected tokens holds (fp32, 1e-5), across
sliding-window pages, compressor state rows and compressed (CSA/HCA) entries."""

from __future__ import annotations

import time

import pytest
import torch

from rackserve.config import SpecConfig
from rackserve.engine.core import EngineCore
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.kv.spec import CacheGroupSpec
from rackserve.request import SamplingParams
from rackserve.spec_decode.checkpoint import DRAFT_PREFIX

from spec_utils import close_draft_dir, spec_engine, target_dir

K = 3


def live_rows(
    core: EngineCore, req_id: str, prefix: str, computed: int
) -> dict[tuple[str, int], torch.Tensor]:
    """Every row a future query of the request may read, per (group, layer): sliding
    groups the window [computed - W + 1, computed), compressed groups the closed entries."""
    kv = core.scheduler.kv
    tables = kv.get_block_ids(core.scheduler.requests[req_id])
    rows = {}
    for spec, table in zip(kv.specs, tables, strict=True):
        if not spec.name.startswith(prefix) or (not prefix and spec.name.startswith(DRAFT_PREFIX)):
            continue
        index = _indices(spec, computed)
        per_block = spec.entries_per_block
        slots = torch.tensor([table[i // per_block] * per_block + i % per_block for i in index])
        name = spec.name[len(prefix) :]
        for layer in spec.layer_ids:
            rows[(name, layer)] = core.runner.caches.flat(spec.name, layer)[slots]
    return rows


def _indices(spec: CacheGroupSpec, computed: int) -> range:
    if spec.is_sliding:
        return range(max(0, computed - spec.window + 1), computed)
    return range(computed // spec.ratio)  # entries closed by positions < computed


def step_until(core: EngineCore, done) -> None:
    for _ in range(1000):
        if done():
            return
        core.step()
    raise AssertionError("never reached")


@pytest.mark.parametrize("method", ["draft_model", "mtp"])
def test_rejected_drafts_leave_no_trace(target_dir, close_draft_dir, method):
    """draft_model: a draft that is often right (mixed runs); its own groups compared too.
    mtp: random MTP weights, nearly every draft rejected; the MTP layer's sliding rows
    (layer num_hidden_layers of ``swa``) compared with a plain prefill's."""
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(2, 512, (29,), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    if method == "mtp":
        spec, reference_spec = SpecConfig("mtp", K), SpecConfig("mtp", 1)
    else:
        spec, reference_spec = SpecConfig("draft_model", K, str(close_draft_dir)), None
    a = spec_engine(target_dir, spec, max_num_batched_tokens=64)
    a.add_request(EngineCoreRequest("a", prompt, params, time.time()))
    req = a.scheduler.requests["a"]
    stats = a.scheduler.spec_stats

    def rejected_after_many() -> bool:  # the last verify step threw drafts away
        accepted_all = stats.num_draft_tokens - stats.num_accepted_tokens == num_rejected[0]
        num_rejected[0] = stats.num_draft_tokens - stats.num_accepted_tokens
        return len(req.output_token_ids) >= 45 and not accepted_all

    num_rejected = [0]
    step_until(a, rejected_after_many)
    assert stats.num_accepted_tokens < stats.num_draft_tokens
    assert method == "mtp" or stats.num_accepted_tokens > 0
    computed = req.num_computed_tokens
    tokens = req.all_token_ids[:computed]
    assert computed == req.num_tokens - 1 and computed > 70  # many windows and pages

    def reference(model_dir, spec=None) -> EngineCore:
        """A request that computes exactly the verified tokens, in one prefill."""
        core = spec_engine(model_dir, spec, max_num_batched_tokens=512)
        core.add_request(EngineCoreRequest("a", tokens, params, time.time()))
        core.step()
        assert core.scheduler.requests["a"].num_computed_tokens == computed
        return core

    b = reference(target_dir, reference_spec)
    got, want = live_rows(a, "a", "", computed), live_rows(b, "a", "", computed)
    assert set(got) == set(want) and {name for name, _ in got} >= {
        "swa",
        "csa_state",
        "hca_state",
        "csa_kv",
        "hca_kv",
    }
    mtp_layer = ("swa", a.model.cfg.num_hidden_layers)
    assert (mtp_layer in want) == (method == "mtp")
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-5, msg=str(key))
    if method == "mtp":
        return
    # the draft model's own groups: as if it had only ever seen the verified tokens
    c = reference(close_draft_dir)
    got, want = live_rows(a, "a", DRAFT_PREFIX, computed), live_rows(c, "a", "", computed)
    assert set(got) == set(want) and len(want) > 5
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-5, msg=str(key))
    # and continuing gives the same tokens as the request that never saw the rejections
    before = len(req.output_token_ids)
    step_until(a, lambda: len(req.output_token_ids) >= before + 12)
    ref = b.scheduler.requests["a"]
    step_until(b, lambda: len(ref.output_token_ids) >= 13)
    assert req.output_token_ids[before - 1 : before + 12] == ref.output_token_ids[:13]
