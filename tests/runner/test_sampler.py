"""Sampler tests on CPU: every filter against a direct reference, plus statistics."""

from __future__ import annotations

import math

import pytest
import torch

from rackserve.request import SamplingParams
from rackserve.runner.sampler import (
    SamplingTensors,
    apply_penalties,
    make_generator,
    sample,
)

V = 50
EOS = 1


def pack(
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
) -> SamplingTensors:
    num_rows = len(params)
    return SamplingTensors.from_params(
        params,
        prompt_token_ids=prompts or [[] for _ in range(num_rows)],
        output_token_ids=outputs or [[] for _ in range(num_rows)],
        vocab_size=V,
        eos_token_ids=[EOS],
    )


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
        out = sample(logits, pack([params] * 8), generator=torch.Generator().manual_seed(seed))
        assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_k_samples_only_from_the_k_best():
    logits = torch.zeros(1, V)  # uniform: anything outside the filter would show up
    logits[0, :3] = torch.tensor([0.3, 0.2, 0.1])
    tensors = pack([SamplingParams(top_k=3)])
    gen = torch.Generator().manual_seed(0)
    seen = {int(sample(logits, tensors, generator=gen).token_ids[0]) for _ in range(300)}
    assert seen == {0, 1, 2}


def test_top_p_keeps_the_smallest_set_over_p():
    # probs 0.5, 0.3, 0.2 (rest ~0): top_p=0.7 needs {0, 1}; 0.8 also just needs {0, 1}.
    logits = torch.full((1, V), -1e9)
    logits[0, :3] = torch.tensor([0.5, 0.3, 0.2]).log()
    gen = torch.Generator().manual_seed(0)
    for top_p, expected in [(0.5, {0}), (0.7, {0, 1}), (0.81, {0, 1, 2})]:
        tensors = pack([SamplingParams(top_p=top_p)])
        seen = {int(sample(logits, tensors, generator=gen).token_ids[0]) for _ in range(300)}
        assert seen == expected, top_p


def test_min_p_masks_tokens_below_the_threshold():
    # probs 0.5, 0.3, 0.2: min_p=0.5 keeps tokens with p >= 0.25 -> {0, 1}.
    logits = torch.full((1, V), -1e9)
    logits[0, :3] = torch.tensor([0.5, 0.3, 0.2]).log()
    tensors = pack([SamplingParams(min_p=0.5)])
    gen = torch.Generator().manual_seed(0)
    seen = {int(sample(logits, tensors, generator=gen).token_ids[0]) for _ in range(300)}
    assert seen == {0, 1}


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


def test_seeded_rows_are_reproducible_and_independent_of_the_batch():
    logits = random_logits(6, seed=3)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    other = SamplingParams(temperature=0.7, top_k=10)

    def run_alone(steps: int) -> list[int]:
        gen = make_generator(1234)
        tensors = pack([seeded])
        return [int(sample(logits[2:3], tensors, {0: gen}).token_ids[0]) for _ in range(steps)]

    def run_in_batch(steps: int, shared_seed: int) -> list[int]:
        gen = make_generator(1234)
        tensors = pack([other, other, seeded, other, other, other])
        shared = torch.Generator().manual_seed(shared_seed)
        return [int(sample(logits, tensors, {2: gen}, shared).token_ids[2]) for _ in range(steps)]

    alone = run_alone(30)
    assert alone == run_alone(30)
    assert run_in_batch(30, shared_seed=0) == alone
    assert run_in_batch(30, shared_seed=99) == alone
    assert len(set(alone)) > 1  # it really samples


def test_sampling_matches_a_known_distribution_with_temperature():
    # Target distribution q = softmax(log p / T) for p = [0.6, 0.3, 0.1], T = 0.5.
    p = torch.tensor([0.6, 0.3, 0.1])
    temperature = 0.5
    expected = (p.log() / temperature).softmax(-1)
    num_draws = 20_000
    logits = torch.full((num_draws, V), -1e9)
    logits[:, :3] = p.log()
    tensors = pack([SamplingParams(temperature=temperature)] * num_draws)
    out = sample(logits, tensors, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(out.token_ids, minlength=V)[:3].float() / num_draws
    # 5 standard errors of a binomial proportion.
    tolerance = 5 * (expected * (1 - expected) / num_draws).sqrt()
    assert ((freq - expected).abs() <= tolerance).all(), (freq, expected)
    assert int(torch.bincount(out.token_ids, minlength=V)[3:].sum()) == 0


def test_logprobs_are_raw_log_softmax_with_sampled_token_first():
    logits = random_logits(3, seed=4)
    params = [
        SamplingParams(temperature=0, logprobs=5, presence_penalty=1.0),
        SamplingParams(temperature=0.5, logprobs=2),
        SamplingParams(temperature=1.0),
    ]
    out = sample(logits, pack(params, outputs=[[0], [], []]), generator=torch.Generator())
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
    out = sample(logits, pack(params), generator=torch.Generator().manual_seed(0))
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == logits[2].argmax()
    assert not math.isnan(float(out.token_ids.float().sum()))


def test_packing_skips_unused_work():
    tensors = pack([SamplingParams(temperature=0), SamplingParams(top_k=-1)])
    assert tensors.top_k is None and tensors.top_p is None and tensors.min_p is None
    assert tensors.output_token_ids is None and tensors.blocked_token_ids is None
    assert tensors.num_logprobs is None
    assert not tensors.all_greedy and not tensors.all_random
    assert tensors.temperature.tolist() == [1.0, 1.0]
