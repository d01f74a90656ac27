"""Speculation changes no greedy output: token for token against the plain engine, with MTP
and with draft models, across chunked prefill, prefix hits, preemption and repeated prompts
(n > 1 fans out into such requests); seeded sampling is reproducible, with exact logprobs."""

from __future__ import annotations

import time

import pytest
import torch

from rackserve.config import SpecConfig
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.request import SamplingParams

from spec_utils import close_draft_dir, kv_budget, random_draft_dir, run, spec_engine, target_dir

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def mixed_prompts(vocab: int, num: int = 12) -> dict[str, list[int]]:
    """5 .. 150 tokens; every third shares a 40-token prefix (hits); two repeat a prompt."""
    g = torch.Generator().manual_seed(12)
    shared = torch.randint(2, vocab, (40,), generator=g).tolist()
    prompts = {}
    for i in range(num):
        n = int(torch.randint(5, 110, (1,), generator=g))
        ids = torch.randint(2, vocab, (n,), generator=g).tolist()
        prompts[f"r{i}"] = shared + ids if i % 3 == 0 else ids
    prompts["r0-copy"] = prompts["r0"]
    return prompts


@pytest.fixture(scope="module")
def prompts(target_dir):
    return mixed_prompts(512)


@pytest.fixture(scope="module")
def baseline(target_dir, prompts):
    core = spec_engine(target_dir, None, max_num_batched_tokens=128)
    return run(core, prompts, GREEDY)


def check(core, prompts, expected, params=GREEDY):
    assert run(core, prompts, params) == expected
    assert core.scheduler.kv.usage == 0.0  # lookahead blocks all back
    stats = core.scheduler.stats()
    assert stats.prefix_cache_hits > 0
    return stats.spec_decoding


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_greedy_equals_plain(target_dir, prompts, baseline, k):
    core = spec_engine(target_dir, SpecConfig("mtp", k), max_num_batched_tokens=128)
    stats = check(core, prompts, baseline)
    assert stats.num_drafts > 0 and stats.num_draft_tokens == k * stats.num_drafts


@pytest.mark.slow
@pytest.mark.parametrize("k", [5])
def test_mtp_greedy_equals_plain_long(target_dir, prompts, baseline, k):
    test_mtp_greedy_equals_plain(target_dir, prompts, baseline, k)


def test_draft_identical_to_target_accepts_everything(target_dir, prompts, baseline):
    core = spec_engine(
        target_dir, SpecConfig("draft_model", 3, str(target_dir)), max_num_batched_tokens=128
    )
    stats = check(core, prompts, baseline)
    assert stats.acceptance_rate == 1.0 and stats.mean_acceptance_length == 4.0


@pytest.mark.parametrize("k", [1, 5])
def test_random_draft_is_still_exact(target_dir, random_draft_dir, prompts, baseline, k):
    spec = SpecConfig("draft_model", k, str(random_draft_dir))
    core = spec_engine(target_dir, spec, max_num_batched_tokens=128)
    stats = check(core, prompts, baseline)
    assert stats.acceptance_rate < 0.2


def test_close_draft_under_preemption(target_dir, close_draft_dir, prompts, baseline):
    spec = SpecConfig("draft_model", 3, str(close_draft_dir))
    budget = kv_budget(target_dir, spec, tokens=300, max_num_batched_tokens=128)
    core = spec_engine(
        target_dir, spec, max_num_batched_tokens=128, max_model_len=256, kv_cache_memory=budget
    )
    stats = check(core, prompts, baseline)
    assert core.scheduler.num_preemptions > 0
    assert 0.1 < stats.acceptance_rate < 1.0  # both accepted and rejected runs


def _run_with_logprobs(core, prompts, params) -> dict[str, tuple[list[int], list[float]]]:
    """Token ids and the sampled tokens' logprobs of every request."""
    for req_id, ids in prompts.items():
        core.add_request(EngineCoreRequest(req_id, ids, params[req_id], time.time()))
    found: dict[str, tuple[list[int], list[float]]] = {r: ([], []) for r in prompts}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            found[out.request_id][0].extend(out.new_token_ids)
            found[out.request_id][1].extend(lp.logprobs[0] for lp in out.new_logprobs or [])
    return found


def test_seeded_sampling_is_reproducible_with_exact_logprobs(target_dir, close_draft_dir, prompts):
    """Temperature > 0 with top-k/p, min-p, penalties and logprobs: with the rejection rule
    the tokens differ from the plain engine's (the distribution is the same:
    test_spec_sampling.py), but the same seeds give the same tokens run to run, and each
    emitted token's logprob is the target's raw logprob of that token after its prefix
    (the plain engine's prompt logprobs of prompt + output)."""
    params = {
        req_id: SamplingParams(
            temperature=0.9,
            top_k=50,
            top_p=0.95,
            min_p=0.01,
            repetition_penalty=1.2,
            presence_penalty=0.3,
            frequency_penalty=0.2,
            seed=i,
            logprobs=2,
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
        )
        for i, req_id in enumerate(prompts)
    }
    spec = SpecConfig("draft_model", 3, str(close_draft_dir))
    core = spec_engine(target_dir, spec, max_num_batched_tokens=128)
    first = _run_with_logprobs(core, prompts, params)
    stats = core.scheduler.stats().spec_decoding
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    again = spec_engine(target_dir, spec, max_num_batched_tokens=256)
    assert {r: v[0] for r, v in _run_with_logprobs(again, prompts, params).items()} == {
        r: v[0] for r, v in first.items()
    }
    scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    plain = spec_engine(target_dir, None, max_num_batched_tokens=1024)
    for req_id, (tokens, logprobs) in first.items():
        assert len(tokens) == len(logprobs) == MAX_TOKENS
        ids = prompts[req_id] + tokens
        plain.add_request(EngineCoreRequest(req_id, ids, scoring, time.time()))
        scored = None
        while plain.has_unfinished_requests():
            for out in plain.step().outputs:
                scored = out.prompt_logprobs or scored
        expected = [lp.logprobs[0] for lp in scored[-MAX_TOKENS:]]
        assert logprobs == pytest.approx(expected, abs=1e-4), req_id
