"""Sampler tests on CPU: every filter against a direct reference, the noise against a
pure-Python hash, batch and position invariance, and statistics."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from rackserve.request import SamplingParams
from rackserve.runner.sampler import (
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    sample,
    sampling_noise,
)
from rackserve.runner.sampling_tensors import SamplingTensors, noise_seed

V = 50
EOS = 1


def pack(
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    seeds: list[int] | None = None,
) -> SamplingTensors:
    """Unseeded rows get seed = their row index unless `seeds` says otherwise, so a batch
    of identical params draws independent tokens."""
    num_rows = len(params)
    return SamplingTensors.from_params(
        params,
        prompt_token_ids=prompts or [[] for _ in range(num_rows)],
        output_token_ids=outputs or [[] for _ in range(num_rows)],
        vocab_size=V,
        eos_token_ids=[EOS],
        seeds=list(range(num_rows)) if seeds is None else seeds,
    )


def draws(logits: torch.Tensor, params: SamplingParams, num_draws: int) -> torch.Tensor:
    """[num_draws] tokens sampled from one logits row [1, V], one seed per draw."""
    return sample(logits.expand(num_draws, -1), pack([params] * num_draws)).token_ids


def random_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_leaves_logits_untouched():
    logits = random_logits(4)
    before = logits.clone()
    out = sample(logits, pack([SamplingParams(temperature=0.0)] * 4))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert torch.equal(logits, before)
    assert out.logprobs is None


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_k=1),
        SamplingParams(temperature=1.5, top_p=1e-4),
        SamplingParams(temperature=1.0, min_p=1.0),
    ],
    ids=["top_k=1", "tiny top_p", "min_p=1"],
)
def test_filters_that_keep_one_token_match_greedy(params: SamplingParams):
    logits = random_logits(8, seed=1)
    for seed in range(5):
        out = sample(logits, pack([params] * 8, seeds=[seed] * 8))
        assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_k_samples_only_from_the_k_best():
    logits = torch.zeros(1, V)  # uniform: anything outside the filter would show up
    logits[0, :3] = torch.tensor([0.3, 0.2, 0.1])
    assert set(draws(logits, SamplingParams(top_k=3), 300).tolist()) == {0, 1, 2}


def test_top_p_keeps_the_smallest_set_over_p():
    # probs 0.5, 0.3, 0.2 (rest ~0): top_p=0.7 needs {0, 1}; 0.8 also just needs {0, 1}.
    logits = torch.full((1, V), -1e9)
    logits[0, :3] = torch.tensor([0.5, 0.3, 0.2]).log()
    for top_p, expected in [(0.5, {0}), (0.7, {0, 1}), (0.81, {0, 1, 2})]:
        assert set(draws(logits, SamplingParams(top_p=top_p), 300).tolist()) == expected, top_p


def test_min_p_masks_tokens_below_the_threshold():
    # probs 0.5, 0.3, 0.2: min_p=0.5 keeps tokens with p >= 0.25 -> {0, 1}.
    logits = torch.full((1, V), -1e9)
    logits[0, :3] = torch.tensor([0.5, 0.3, 0.2]).log()
    assert set(draws(logits, SamplingParams(min_p=0.5), 300).tolist()) == {0, 1}


def reference_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompts: list[list[int]],
    outputs: list[list[int]],
) -> torch.Tensor:
    """The obvious per-row, per-token loop."""
    result = logits.clone()
    for row, p in enumerate(params):
        for token in set(prompts[row]) | set(outputs[row]):
            value = result[row, token]
            rp = p.repetition_penalty
            result[row, token] = value / rp if value > 0 else value * rp
        for token in set(outputs[row]):
            count = outputs[row].count(token)
            result[row, token] -= p.frequency_penalty * count + p.presence_penalty
    return result


def test_penalties_match_a_per_row_loop():
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(presence_penalty=0.7, frequency_penalty=0.2),
        SamplingParams(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.1),
        SamplingParams(),
    ]
    prompts = [[3, 4, 4, 9], [5, 6], [7, 7, 2], [1, 2, 3]]
    outputs = [[4, 10, 10], [6, 6, 6, 11], [], [8, 8]]
    logits = random_logits(4, seed=2)
    got = apply_penalties(logits, pack(params, outputs, prompts))
    expected = reference_penalties(logits, params, prompts, outputs)
    torch.testing.assert_close(got, expected)
    # Rows without penalties, and tokens never seen, are bit-identical.
    assert torch.equal(got[3], logits[3])
    seen = {3, 4, 9, 10}
    untouched = [t for t in range(V) if t not in seen]
    assert torch.equal(got[0, untouched], logits[0, untouched])


def test_presence_and_frequency_ignore_prompt_tokens():
    params = [SamplingParams(presence_penalty=1.0, frequency_penalty=1.0)]
    logits = random_logits(1)
    got = apply_penalties(logits, pack(params, outputs=[[]], prompts=[[0, 1, 2]]))
    assert torch.equal(got, logits)


def test_greedy_sees_penalties():
    logits = torch.zeros(1, V)
    logits[0, 5] = 2.0
    logits[0, 6] = 1.9
    out = sample(logits, pack([SamplingParams(temperature=0, presence_penalty=0.5)], [[5]]))
    assert int(out.token_ids[0]) == 6


# Chi-square critical values at p = 0.001 (the tests are deterministic: these only say how
# far from the target distribution a pass may be).
CHI2_CRITICAL_0_001 = {7: 24.32, 8: 26.12}


def chi_square(counts: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((counts.double() - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("across", ["positions", "seeds"])
def test_sampled_distribution_matches_the_probabilities(across: str):
    """One request over 20,000 positions, or 20,000 requests (seeds 0..) at one position:
    the tokens follow softmax(log p / T) on a small vocabulary (chi-square, 7 dof)."""
    p = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02])
    temperature = 0.8
    target = (p.log() / temperature).softmax(-1).double()
    num_draws = 20_000
    logits = torch.full((num_draws, V), float("-inf"))
    logits[:, :8] = p.log()
    params = SamplingParams(temperature=temperature)
    if across == "positions":
        tensors = dataclasses.replace(
            pack([params] * num_draws, seeds=[7] * num_draws),
            positions=torch.arange(num_draws),
        )
    else:
        tensors = pack([params] * num_draws)
    counts = torch.bincount(sample(logits, tensors).token_ids, minlength=V)
    assert int(counts[8:].sum()) == 0
    assert chi_square(counts[:8], num_draws * target) < CHI2_CRITICAL_0_001[7]


def test_consecutive_positions_are_independent():
    """Pairs (token at t, token at t + 1) of one seeded request: the joint frequencies are
    the product of the marginals (chi-square on 3 x 3 cells, 8 dof)."""
    p = torch.tensor([0.5, 0.3, 0.2])
    num_draws = 30_001
    logits = torch.full((num_draws, V), float("-inf"))
    logits[:, :3] = p.log()
    tensors = dataclasses.replace(
        pack([SamplingParams()] * num_draws, seeds=[2**40 + 3] * num_draws),
        positions=torch.arange(num_draws),
    )
    tokens = sample(logits, tensors).token_ids
    pairs = torch.bincount(tokens[:-1] * 3 + tokens[1:], minlength=9)
    expected = (num_draws - 1) * torch.outer(p, p).flatten().double()
    assert chi_square(pairs, expected) < CHI2_CRITICAL_0_001[8]


def lowbias32(x: int) -> int:
    """The hash the sampler's noise uses, on Python ints (the specification)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def reference_noise(seed: int, position: int, vocab_id: int) -> float:
    seed %= 2**64
    key = lowbias32((seed & 0xFFFFFFFF) ^ 0x9E3779B9)
    key = lowbias32(key ^ (seed >> 32))
    key = lowbias32(key ^ position)
    bits = lowbias32(key ^ ((vocab_id * 0x9E3779B1) & 0xFFFFFFFF))
    return -math.log(((bits >> 9) + 0.5) / 2**23)


def test_noise_is_the_integer_hash_of_seed_position_and_token():
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 2**70 + 5, 1234]
    positions = [0, 1, 5, 100_000, 7, 2**31 + 9, 64]
    vocab_size = 129_280  # the largest multiplier product must not overflow int64
    noise = sampling_noise(
        torch.tensor([noise_seed(s) for s in seeds]), torch.tensor(positions), vocab_size
    )
    assert noise.dtype == torch.float32 and noise.shape == (len(seeds), vocab_size)
    assert bool((noise > 0).all()) and bool(noise.isfinite().all())
    for row, (seed, position) in enumerate(zip(seeds, positions, strict=True)):
        for vocab_id in [0, 1, 2, 77, 65_535, 65_536, vocab_size - 1]:
            expected = reference_noise(seed, position, vocab_id)
            assert float(noise[row, vocab_id]) == pytest.approx(expected, rel=1e-6)
    assert noise_seed(2**64 + 5) == 5 and noise_seed(-1) == -1 and noise_seed(2**63) == -(2**63)


def test_seeded_tokens_are_the_same_alone_and_in_a_batch_of_64():
    """Each row of a mixed batch of 64 (greedy, filters, penalties, min_tokens, logprobs)
    samples the same token, with the same logprobs, as the row alone."""
    rng = random.Random(0)
    num_rows = 64
    logits = random_logits(num_rows, seed=6)
    params = [
        SamplingParams(
            temperature=rng.choice([0.0, 0.5, 1.0, 1.7]),
            top_k=rng.choice([0, 3, 20]),
            top_p=rng.choice([1.0, 0.9]),
            min_p=rng.choice([0.0, 0.05]),
            presence_penalty=rng.choice([0.0, 0.4]),
            repetition_penalty=rng.choice([1.0, 1.2]),
            min_tokens=rng.choice([0, 3]),
            logprobs=rng.choice([None, 2]),
            seed=rng.choice([None, rng.randrange(-(2**63), 2**63)]),  # SamplingParams: int64
        )
        for _ in range(num_rows)
    ]
    outputs = [[rng.randrange(V) for _ in range(rng.randrange(6))] for _ in range(num_rows)]
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(1, 9))] for _ in range(num_rows)]
    seeds = [rng.randrange(-(2**63), 2**63) for _ in range(num_rows)]
    batch = sample(logits, pack(params, outputs, prompts, seeds))
    assert batch.logprobs is not None
    for row in range(num_rows):
        one = slice(row, row + 1)
        alone = sample(logits[one], pack(params[one], outputs[one], prompts[one], seeds[one]))
        assert int(alone.token_ids[0]) == int(batch.token_ids[row]), row
        if params[row].logprobs is not None:
            assert alone.logprobs is not None
            assert torch.equal(alone.logprobs.token_ids[0, :3], batch.logprobs.token_ids[row, :3])
            assert torch.equal(alone.logprobs.logprobs[0, :3], batch.logprobs.logprobs[row, :3])
    assert len(set(batch.token_ids.tolist())) > 10  # it really samples


def test_the_token_depends_on_seed_and_position_only():
    logits = random_logits(1, seed=7).expand(200, -1)
    params = [SamplingParams(temperature=1.5)] * 200
    base = pack(params, seeds=[42] * 200)
    same = sample(logits, base).token_ids
    assert len(set(same.tolist())) == 1  # same seed, same position: the same token 200 times
    by_position = dataclasses.replace(base, positions=torch.arange(200))
    tokens = sample(logits, by_position).token_ids
    assert torch.equal(tokens, sample(logits, by_position).token_ids)  # reproducible
    assert len(set(tokens.tolist())) > 10
    by_seed = sample(logits, pack(params)).token_ids  # seeds 0..199, one position
    assert len(set(by_seed.tolist())) > 10 and not torch.equal(by_seed, tokens)


def test_random_rows_without_a_seed_are_refused():
    with pytest.raises(ValueError, match="seed"):
        SamplingTensors.from_params(
            [SamplingParams(temperature=1.0)],
            prompt_token_ids=[[1]],
            output_token_ids=[[]],
            vocab_size=V,
            eos_token_ids=[EOS],
        )


def test_logprobs_are_raw_log_softmax_with_sampled_token_first():
    logits = random_logits(3, seed=4)
    params = [
        SamplingParams(temperature=0, logprobs=5, presence_penalty=1.0),
        SamplingParams(temperature=0.5, logprobs=2),
        SamplingParams(temperature=1.0),
    ]
    out = sample(logits, pack(params, outputs=[[0], [], []]))
    assert out.logprobs is not None
    log_softmax = logits.log_softmax(-1)
    assert out.logprobs.token_ids.shape == (3, 6)
    assert torch.equal(out.logprobs.token_ids[:, 0], out.token_ids)
    torch.testing.assert_close(out.logprobs.logprobs, log_softmax.gather(1, out.logprobs.token_ids))
    top_values, top_ids = log_softmax.topk(5, dim=-1)
    assert torch.equal(out.logprobs.token_ids[:, 1:], top_ids)
    torch.testing.assert_close(out.logprobs.logprobs[:, 1:], top_values)
    for row in range(3):
        chosen = log_softmax[row, out.token_ids[row]]
        assert int(out.logprobs.ranks[row]) == int((log_softmax[row] > chosen).sum()) + 1


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(2, V)
    logits[:, EOS] = 10.0
    logits[:, 7] = 9.0
    logits[:, 3] = 8.0
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[7])
    early = sample(logits, pack([params, params], outputs=[[], [5]]))
    assert early.token_ids.tolist() == [3, 3]
    reached = sample(logits[:1], pack([params], outputs=[[5, 5]]))
    assert reached.token_ids.tolist() == [EOS]


def test_ignore_eos_leaves_eos_samplable_under_min_tokens():
    logits = torch.zeros(1, V)
    logits[0, EOS] = 10.0
    params = SamplingParams(temperature=0, min_tokens=4, ignore_eos=True)
    assert sample(logits, pack([params])).token_ids.tolist() == [EOS]


def test_mixed_batch_keeps_greedy_rows_greedy():
    logits = random_logits(4, seed=5)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=2.0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=2.0, top_p=0.9),
    ]
    out = sample(logits, pack(params))
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == logits[2].argmax()
    assert not math.isnan(float(out.token_ids.float().sum()))


def test_packing_skips_unused_work():
    tensors = pack([SamplingParams(temperature=0), SamplingParams(top_k=-1)])
    assert tensors.top_k is None and tensors.top_p is None and tensors.min_p is None
    assert tensors.output_token_ids is None and tensors.blocked_token_ids is None
    assert tensors.num_logprobs is None
    assert not tensors.all_greedy and not tensors.all_random
    assert tensors.temperature.tolist() == [1.0, 1.0]


def test_off_filter_values_leave_logits_bit_identical():
    """top_k = V, top_p = 1 and min_p = 0 change nothing, bit for bit, also where a
    token's probability underflows to 0 (a wide logit range, -inf entries): a batch in
    which one row filters leaves the others as they were alone, and the decode graphs
    pass these values for rows without a filter (runner/graph_sampling.py)."""
    logits = random_logits(6, seed=9) * 40
    logits[1, :7] = float("-inf")
    top_k = torch.full((6,), V, dtype=torch.int64)
    top_p, min_p = torch.ones(6), torch.zeros(6)
    assert torch.equal(apply_top_k_top_p(logits, top_k, top_p), logits)
    assert torch.equal(apply_top_k_top_p(logits, None, top_p), logits)
    assert torch.equal(apply_min_p(logits, min_p), logits)
    # a row at the off values beside a row that filters: as when no row filters
    top_p[0], top_k[2] = 0.5, 3
    both = apply_top_k_top_p(logits, top_k, top_p)
    assert torch.equal(both[1], logits[1]) and torch.equal(both[3:], logits[3:])
    assert not torch.equal(both[0], logits[0]) and not torch.equal(both[2], logits[2])
