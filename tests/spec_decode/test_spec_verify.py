"""Verification rules: the greedy/coupled acceptance and the standard rejection rule on
sampled drafts, with statistical checks (fixed sample budgets, tolerances that a wrong
rule fails)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rackserve.request import SamplingParams
from rackserve.runner.sampler import sample, sampling_noise
from rackserve.runner.sampling_tensors import SamplingTensors
from rackserve.spec_decode.verify import (
    accept_drafts,
    accepted_counts,
    resample_rejected,
    sample_drafts,
    verification_prefixes,
)


def test_accept_drafts_longest_matching_prefix():
    assert accept_drafts([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all + bonus
    assert accept_drafts([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # first mismatch replaced
    assert accept_drafts([4, 6, 7, 8], [5, 6, 7]) == [4]  # none accepted
    assert accept_drafts([3], []) == [3]
    with pytest.raises(ValueError, match="one target token per draft"):
        accept_drafts([1, 2], [1, 2])


@pytest.mark.parametrize("k", [1, 3, 5])
def test_accepted_counts_is_accept_drafts_on_the_device(k):
    """The device route's acceptance (every request at once) is the host rule's, for drafts
    that match a prefix of every length, and ones that match again after a miss."""
    gen = torch.Generator().manual_seed(k)
    target = torch.randint(0, 4, (64, k + 1), generator=gen)
    drafts = torch.where(torch.rand(64, k, generator=gen) < 0.7, target[:, :k], 9)
    drafts[0], drafts[1] = target[0, :k], 9  # all accepted, none accepted
    got = accepted_counts(drafts, target).tolist()
    pairs = zip(target.tolist(), drafts.tolist(), strict=True)
    want = [len(accept_drafts(t, d)) - 1 for t, d in pairs]
    assert got == want
    assert {0, k} <= set(got)
    assert k == 1 or any(0 < a < k for a in got)


def test_verification_prefixes():
    ids = [1, 2, 3, 10, 11]
    prefixes = verification_prefixes(ids, 2)
    assert [list(p) for p in prefixes] == [[1, 2, 3], [1, 2, 3, 10], [1, 2, 3, 10, 11]]
    assert [list(p) for p in verification_prefixes([1, 2], 0)] == [[1, 2]]
    # what the sampling tensors read: lengths, and slices as a list's (views: no copy kept)
    p = prefixes[1]
    assert len(p) == 4 and p[:2] == [1, 2] and p[2:] == [3, 10] and p[-1] == 10 and p[0] == 1
    assert p[1:100] == [2, 3, 10] and p[::-1] == [10, 3, 2, 1] and p[5:] == []
    with pytest.raises(IndexError):
        p[4]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# chi-square critical value, 7 degrees of freedom, p = 0.001: a correct rule fails 1 in 1000
CHI2_7_999 = 24.32


def _random_tensors(seeds: list[int], positions: list[int], vocab: int) -> SamplingTensors:
    """Temperature-1 rows with one seed each, sampling at ``positions``."""
    tensors = _tensors(seeds, 0, vocab)
    return dataclasses.replace(tensors, positions=torch.tensor(positions, dtype=torch.int64))


def test_rejection_rule_matches_target_distribution():
    """The engine's rule, vectorised over 40,000 seeds with V = 8, K = 2: drafts drawn from
    q by sample_drafts, verified by resample_rejected, emitted by accept_drafts. The first
    emitted token follows p_0; the second (rows whose first draft was accepted) p_1; the
    first draft is accepted with probability sum min(p_0, q_0)."""
    g = torch.Generator().manual_seed(0)
    vocab, k, n = 8, 2, 40_000
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, dim=-1)  # [K+1, V]
    draft_logits = torch.randn(k, vocab, generator=g) * 1.5
    seeds = torch.randint(-(2**62), 2**62, (n,), generator=g).tolist()
    base = 17  # the position of draft 1
    drafts, qs = [], []
    for j in range(k):
        tensors = _random_tensors(seeds, [base + j] * n, vocab)
        d, q = sample_drafts(draft_logits[j].expand(n, vocab), tensors, tensors.positions)
        drafts.append(d)
        qs.append(q)
    draft_ids = torch.stack(drafts, dim=1)  # [n, K]
    q = torch.stack(qs, dim=1)  # [n, K, V]
    assert torch.allclose(q[0], torch.softmax(draft_logits, dim=-1))
    # the step's rows: request i has rows i*(K+1) .. i*(K+1)+K at positions base .. base+K
    rows_tensors = _random_tensors(
        [s for s in seeds for _ in range(k + 1)], list(range(base, base + k + 1)) * n, vocab
    )
    probs = p.repeat(n, 1)  # [n*(K+1), V]
    plain = (probs / sampling_noise(rows_tensors.seeds, rows_tensors.positions, vocab)).argmax(1)
    rows = (torch.arange(n)[:, None] * (k + 1) + torch.arange(k)).reshape(-1)  # draft rows
    tokens = resample_rejected(
        plain,
        probs,
        rows_tensors.seeds,
        rows_tensors.positions,
        rows,
        draft_ids.reshape(-1),
        q.reshape(n * k, vocab),
    ).view(n, k + 1)
    emitted = [
        accept_drafts(t, d) for t, d in zip(tokens.tolist(), draft_ids.tolist(), strict=True)
    ]
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=vocab).float()
    assert _chi_square(first, p[0]) < CHI2_7_999
    second_ids = torch.tensor([e[1] for e in emitted if len(e) > 1])
    assert len(second_ids) > 1000
    assert _chi_square(torch.bincount(second_ids, minlength=vocab).float(), p[1]) < CHI2_7_999
    accepted = draft_ids[:, 0] == tokens[:, 0]
    q0 = torch.softmax(draft_logits[0], dim=-1)
    assert abs(float(accepted.float().mean()) - float(torch.minimum(p[0], q0).sum())) < 0.015
    # a rejected row never emits its own draft, and the bonus row keeps the plain draw
    assert not bool((tokens[~accepted, 0] == draft_ids[~accepted, 0]).any())
    assert torch.equal(tokens[:, k], plain.view(n, k + 1)[:, k])


def test_a_draft_equal_to_the_target_gives_the_plain_tokens():
    """q == p: every draft is accepted, and it is the very token the plain engine samples
    at that position (the draft races on the position's own noise)."""
    g = torch.Generator().manual_seed(3)
    vocab, n = 16, 2000
    logits = torch.randn(n, vocab, generator=g)
    seeds = torch.randint(0, 2**62, (n,), generator=g).tolist()
    tensors = _random_tensors(seeds, list(range(n)), vocab)
    drafts, q = sample_drafts(logits, tensors, tensors.positions)
    plain = sample(logits, tensors)
    assert torch.equal(drafts, plain.token_ids)
    everything = torch.arange(n)
    verified = sample(
        logits,
        tensors,
        lambda t, probs: resample_rejected(
            t, probs, tensors.seeds, tensors.positions, everything, drafts, q
        ),
    )
    assert torch.equal(verified.token_ids, drafts)


def test_greedy_rows_draft_the_argmax():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=t) for t in (0.0, 1.0, 0.0, 0.7)]
    tensors = SamplingTensors.from_params(
        params,
        prompt_token_ids=[[2]] * 4,
        output_token_ids=[[]] * 4,
        vocab_size=10,
        eos_token_ids=(1,),
        seeds=[1, 2, 3, 4],
    )
    drafts, q = sample_drafts(logits, tensors, tensors.positions)
    assert q is not None and drafts[0] == logits[0].argmax() and drafts[2] == logits[2].argmax()
    greedy = tensors.select([0, 2], [True, True])
    drafts, q = sample_drafts(logits[[0, 2]], greedy, greedy.positions)
    assert q is None and torch.equal(drafts, logits[[0, 2]].argmax(dim=1))


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
    """The fallback for drafts whose q is unknown: t ~ p by the sampler's own noise, accept
    iff t == d. Over many seeds: P(accept) = p(d), emitted token ~ p, and on rejection ~ p
    without d."""
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
