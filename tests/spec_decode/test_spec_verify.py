"""Verification rules: the greedy/coupled acceptance and the standard rejection sampler,
with statistical checks (fixed sample budgets, tolerances that a wrong rule fails)."""

from __future__ import annotations

import pytest
import torch

from rackserve.request import SamplingParams
from rackserve.runner.sampler import sample, sampling_noise
from rackserve.runner.sampling_tensors import SamplingTensors
from rackserve.spec_decode.verify import accept_drafts, rejection_sample, verification_prefixes


def test_accept_drafts_longest_matching_prefix():
    assert accept_drafts([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all + bonus
    assert accept_drafts([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # first mismatch replaced
    assert accept_drafts([4, 6, 7, 8], [5, 6, 7]) == [4]  # none accepted
    assert accept_drafts([3], []) == [3]
    with pytest.raises(ValueError, match="one target token per draft"):
        accept_drafts([1, 2], [1, 2])


def test_verification_prefixes():
    assert verification_prefixes([1, 2, 3, 10, 11], 2) == [
        [1, 2, 3],
        [1, 2, 3, 10],
        [1, 2, 3, 10, 11],
    ]
    assert verification_prefixes([1, 2], 0) == [[1, 2]]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# chi-square critical value, 7 degrees of freedom, p = 0.001: a correct rule fails 1 in 1000
CHI2_7_999 = 24.32


@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sampler_matches_target_distribution(one_hot):
    """Marginal of the first emitted token = p_0; given the first draft accepted, the second
    emitted token = p_1 (its target distribution given d_1). V = 8, K = 2."""
    g = torch.Generator().manual_seed(0)
    vocab, k, n = 8, 2, 40_000
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, dim=-1)
    if one_hot:  # greedy drafts: the draft's argmax, q one-hot
        drafts = q.argmax(dim=-1).expand(n, k)
        draft_probs = None
    else:  # drafts sampled from q
        drafts = torch.multinomial(q, n, replacement=True, generator=g).T  # [n, K]
        draft_probs = q.expand(n, k, vocab)
    uniform = torch.rand(n, k, generator=g)
    noise = -torch.rand(n, k + 1, vocab, generator=g).clamp_(min=1e-12).log()
    tokens, accepted = rejection_sample(
        p.expand(n, k + 1, vocab), drafts, draft_probs, uniform, noise
    )
    first = torch.bincount(tokens[:, 0], minlength=vocab).float()
    assert _chi_square(first, p[0]) < CHI2_7_999
    # second token: rows whose first draft was accepted emit it at column 1
    second_rows = accepted >= 1
    assert second_rows.sum() > 1000
    second = torch.bincount(tokens[second_rows, 1], minlength=vocab).float()
    assert _chi_square(second, p[1]) < CHI2_7_999
    # acceptance of the first draft: sum_x min(p, q) (one-hot: p(d))
    expected = p[0][drafts[0, 0]] if one_hot else torch.minimum(p[0], q[0]).sum()
    assert abs(float((accepted >= 1).float().mean()) - float(expected)) < 0.015


def test_a_wrong_rule_fails_the_check():
    """The test's power: accepting every draft (no rejection) is caught."""
    g = torch.Generator().manual_seed(1)
    vocab, n = 8, 40_000
    p = torch.softmax(torch.randn(vocab, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(vocab, generator=g) * 1.5, dim=-1)
    drafts = torch.multinomial(q, n, replacement=True, generator=g)
    assert _chi_square(torch.bincount(drafts, minlength=vocab).float(), p) > CHI2_7_999


def _tensors(seeds: list[int], position: int, vocab: int) -> SamplingTensors:
    """Rows sampling at temperature 1 after ``position`` tokens, one noise seed each."""
    rows = len(seeds)
    return SamplingTensors.from_params(
        [SamplingParams(temperature=1.0)] * rows,
        prompt_token_ids=[[2] * position] * rows,
        output_token_ids=[[]] * rows,
        vocab_size=vocab,
        eos_token_ids=(1,),
        seeds=seeds,
    )


def test_coupled_verification_is_the_rejection_rule_for_greedy_drafts():
    """What the engine runs: t ~ p by the sampler's own noise, accept iff t == d. Over many
    seeds: P(accept) = p(d), emitted token ~ p, and on rejection ~ p without d."""
    g = torch.Generator().manual_seed(2)
    vocab, n = 8, 40_000
    logits = torch.randn(vocab, generator=g) * 1.5
    p = torch.softmax(logits, dim=-1)
    draft = int(p.argsort()[-2])  # a draft that is not the mode
    seeds = torch.randint(0, 2**62, (n,), generator=g).tolist()
    target = sample(logits.expand(n, vocab).contiguous(), _tensors(seeds, 17, vocab)).token_ids
    accepted = target == draft
    assert abs(float(accepted.float().mean()) - float(p[draft])) < 0.01
    assert _chi_square(torch.bincount(target, minlength=vocab).float(), p) < CHI2_7_999
    residual = p.clone()
    residual[draft] = 0
    rejected = torch.bincount(target[~accepted], minlength=vocab).float()
    assert _chi_square(rejected, residual / residual.sum()) < CHI2_7_999
    # the noise really is per (seed, position): another position draws other tokens
    some = torch.tensor(seeds[:100])
    other = sampling_noise(some, torch.full((100,), 18), vocab)
    assert not torch.equal(other, sampling_noise(some, torch.full((100,), 17), vocab))


def test_stats_interval_total_and_report():
    from rackserve.spec_decode.stats import SpecDecodingStats, from_prometheus

    s = SpecDecodingStats(3)
    s.observe(3, 2)
    then = s.copy()
    s.observe(3, 0)
    s.observe(2, 1)
    assert s.num_accepted_tokens_per_pos == [2, 1, 0]
    interval = s.minus(then)
    assert (interval.num_drafts, interval.num_draft_tokens, interval.num_accepted_tokens) == (
        2,
        5,
        1,
    )
    assert interval.num_accepted_tokens_per_pos == [1, 0, 0]
    report = interval.report()
    assert report["spec_decode_acceptance_rate"] == 20.0
    assert report["spec_decode_acceptance_length"] == 1.5
    assert report["spec_decode_per_position_acceptance_rates"] == [0.5, 0.0, 0.0]
    total = SpecDecodingStats.total([s, None, then])
    assert total.num_drafts == 4 and total.num_accepted_tokens_per_pos == [3, 2, 0]
    assert SpecDecodingStats.total([None]) is None
    page = (
        'vllm:spec_decode_num_drafts_total{model_name="m"} 4.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0\n'
    )
    parsed = from_prometheus(page)
    assert parsed.num_drafts == 4 and parsed.num_accepted_tokens_per_pos == [0, 2]
    assert from_prometheus("other_metric 1.0\n") is None
