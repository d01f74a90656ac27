"""Sampling with speculation: the tokens' distribution is the target's, for drafts that
differ from the target (MTP and a draft model), and seeds are honoured (run to run, alone
or in a batch).

The distribution check is vectorised: one engine run samples 3 tokens for N seeds, one
plain forward of the N sequences gives the target's distribution p(. | prefix) at each
position, and each token becomes its randomised probability-integral transform over the
tokens sorted by p (u = mass of the likelier tokens + U * p(token)), uniform on (0, 1)
exactly when the token follows p. A chi-square over 10 bins of u per position (the first
sampled after prefill, then the first and second positions of a verify step) checks it;
tokens from another distribution shift u towards 1.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from rackserve.config import SpecConfig
from rackserve.model.generate import ContiguousCache
from rackserve.model.loader import load_model
from rackserve.request import SamplingParams
from rackserve.runner.sampler import sampling_probs
from rackserve.runner.sampling_tensors import SamplingTensors

from spec_utils import close_draft_dir, run, spec_engine, target_dir

PROMPT = [7, 99, 23, 310, 45, 6]
NUM_TOKENS = 3
BINS = 10
# chi-square, 9 degrees of freedom, p = 0.001 / 3 (Bonferroni over the 3 positions): a
# correct rule fails one run of the three checks in 1000
CHI2_9_CRITICAL = 30.70


def target_probs(model_dir, samples: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """p of every sampled position: samples [N, T] -> [N, T, V] (the target's logits of
    PROMPT + sample, through the sampler's own temperature/top-k/top-p/min-p)."""
    model = load_model(model_dir)
    num, length = samples.shape[0], len(PROMPT) + NUM_TOKENS - 1
    ids = torch.cat([torch.tensor(PROMPT).expand(num, -1), samples[:, :-1]], dim=1)  # [N, L]
    cache = ContiguousCache(model, num, length)
    with torch.inference_mode():
        meta = cache.batch([0] * num, [length] * num, list(range(num)))
        hidden, _ = model(ids.reshape(-1), meta, cache.tensors)
        logits = model.compute_logits(hidden).view(num, length, -1)[:, len(PROMPT) - 1 :]
    flat = logits.reshape(num * NUM_TOKENS, -1)
    tensors = SamplingTensors.from_params(
        [params] * flat.shape[0],
        prompt_token_ids=[[]] * flat.shape[0],
        output_token_ids=[[]] * flat.shape[0],
        vocab_size=flat.shape[1],
        eos_token_ids=(1,),
        seeds=[0] * flat.shape[0],
    )
    return sampling_probs(flat, tensors).view(num, NUM_TOKENS, -1)


def pit_chi_square(probs: torch.Tensor, tokens: torch.Tensor, seed: int = 0) -> float:
    """probs [N, V], tokens [N] -> chi-square of the randomised PIT over BINS equal bins."""
    order = probs.argsort(dim=1, descending=True)
    sorted_probs = probs.gather(1, order)
    rank = (order == tokens[:, None]).float().argmax(dim=1)  # [N]
    below = sorted_probs.cumsum(dim=1).gather(1, rank[:, None]).squeeze(1)  # includes token
    p_token = sorted_probs.gather(1, rank[:, None]).squeeze(1)
    assert bool((p_token > 0).all()), "a token of probability 0 was sampled"
    jitter = torch.rand(len(tokens), generator=torch.Generator().manual_seed(seed))
    u = (below - p_token + jitter * p_token).clamp(0, 1 - 1e-7)
    counts = torch.bincount((u * BINS).long(), minlength=BINS).float()
    expected = len(tokens) / BINS
    return float(((counts - expected) ** 2 / expected).sum())


def sample_with(model_dir, spec: SpecConfig, params: SamplingParams, num: int):
    """[N, NUM_TOKENS] tokens for seeds 0..N-1 and the acceptance counters."""
    core = spec_engine(model_dir, spec, max_num_seqs=512, max_num_batched_tokens=4096)
    per_seed = {f"s{s}": dataclasses.replace(params, seed=s) for s in range(num)}
    outputs = run(core, {req_id: PROMPT for req_id in per_seed}, per_seed)
    samples = torch.tensor([outputs[f"s{s}"] for s in range(num)])
    return samples, core.scheduler.stats().spec_decoding


SETTINGS = {
    "mtp": SamplingParams(temperature=1.0, max_tokens=NUM_TOKENS, ignore_eos=True),
    "draft_model": SamplingParams(
        temperature=0.8, top_k=60, top_p=0.95, max_tokens=NUM_TOKENS, ignore_eos=True
    ),
}


def check_distribution(model_dir, spec, params, num):
    samples, stats = sample_with(model_dir, spec, params, num)
    # drafts both accepted and rejected: the rule is exercised, not bypassed
    assert 0.1 < stats.acceptance_rate < 0.9, stats.acceptance_rate
    probs = target_probs(model_dir, samples, params)
    for t in range(NUM_TOKENS):
        assert pit_chi_square(probs[:, t], samples[:, t], seed=t) < CHI2_9_CRITICAL, t
    return probs


def _spec(method: str, k: int, draft_dir) -> SpecConfig:
    if method == "mtp":
        return SpecConfig("mtp", k)
    return SpecConfig("draft_model", k, str(draft_dir))


@pytest.mark.parametrize("method", ["mtp", "draft_model"])
def test_sampled_tokens_follow_the_target(target_dir, close_draft_dir, method):
    spec = _spec(method, 2, close_draft_dir)
    probs = check_distribution(target_dir, spec, SETTINGS[method], 1500)
    # the check's power, on the same p: tokens drawn from p at another temperature fail
    flatter = (probs[:, 1].log() / 1.6).softmax(dim=1).nan_to_num(0.0)
    wrong = torch.multinomial(flatter, 1, generator=torch.Generator().manual_seed(1))[:, 0]
    assert pit_chi_square(probs[:, 1], wrong) > CHI2_9_CRITICAL


@pytest.mark.slow
@pytest.mark.parametrize("method", ["mtp", "draft_model"])
@pytest.mark.parametrize("k", [1, 4])
def test_sampled_tokens_follow_the_target_long(target_dir, close_draft_dir, method, k):
    check_distribution(target_dir, _spec(method, k, close_draft_dir), SETTINGS[method], 8000)


def test_seeds_are_honoured_alone_and_in_a_batch(target_dir, close_draft_dir):
    """Same seed, same tokens: run to run, and alone vs among 63 others (seeded and not,
    other temperatures, top-k, top-p)."""
    spec = SpecConfig("draft_model", 3, str(close_draft_dir))
    probe = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = run(spec_engine(target_dir, spec), {"probe": PROMPT}, probe)["probe"]
    params = {"probe": probe}
    prompts = {"probe": PROMPT}
    for i, (t, k) in enumerate(itertools.product([0.0, 0.5, 1.3], [0, 5, 40] * 7)):
        seed = None if i % 2 else 1000 + i
        params[f"o{i}"] = SamplingParams(
            temperature=t, top_k=k, top_p=0.8 if i % 3 else 1.0, seed=seed, max_tokens=16
        )
        prompts[f"o{i}"] = [(7 * i + j) % 500 + 2 for j in range(3 + i % 9)]
    assert len(params) == 64
    core = spec_engine(target_dir, spec, max_num_seqs=64)
    batch = run(core, prompts, params)
    assert batch["probe"] == alone
    assert run(spec_engine(target_dir, spec), {"probe": PROMPT}, probe)["probe"] == alone
    assert core.scheduler.stats().spec_decoding.num_accepted_tokens > 0
