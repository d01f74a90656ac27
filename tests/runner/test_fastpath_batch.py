"""The runner's per-step work against fresh computations: persistent sampling rows
(overwritten as requests leave and join, gathered per step in any order) against a fresh
packing of the same requests, and the decode-only input build against the general one."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from rackserve.request import SamplingParams
from rackserve.runner.inputs import build_batch_inputs
from rackserve.runner.sampling_tensors import SamplingParamTable, SamplingTensors

V = 64
EOS = (1, 2)


def random_params(rng: random.Random) -> SamplingParams:
    choice = rng.random
    max_tokens = rng.randrange(1, 8)
    return SamplingParams(
        temperature=rng.choice([0.0, 1e-6, 0.7, 1.0, 1.3]),
        top_p=rng.choice([1.0, 0.95, 0.5, 0.9999999999]),
        top_k=rng.choice([0, -1, 1, 5, V + 3]),
        min_p=rng.choice([0.0, 0.0, 0.1]),
        presence_penalty=rng.choice([0.0, 0.0, 0.5]) if choice() < 0.3 else 0.0,
        frequency_penalty=rng.choice([0.0, -0.3]) if choice() < 0.3 else 0.0,
        repetition_penalty=rng.choice([1.0, 1.0, 1.2]) if choice() < 0.3 else 1.0,
        stop_token_ids=rng.sample(range(3, V), rng.randrange(3)),
        ignore_eos=choice() < 0.3,
        max_tokens=max_tokens,
        min_tokens=rng.randrange(max_tokens + 1) if choice() < 0.3 else 0,
        logprobs=rng.choice([None, None, 0, 3, 7]),
    )


def assert_same(a: SamplingTensors, b: SamplingTensors) -> None:
    for f in dataclasses.fields(SamplingTensors):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype, f.name
            assert torch.equal(x, y), f.name
        else:
            assert x == y, f.name


@pytest.mark.parametrize("seed", range(20))
def test_reused_rows_gather_like_a_fresh_packing(seed):
    rng = random.Random(seed)
    table = SamplingParamTable(8, V)
    rows: dict[int, tuple[SamplingParams, list[int], int, int]] = {}
    for _ in range(6):  # requests leave and join: rows are overwritten
        for row in rng.sample(range(8), rng.randrange(1, 9)):
            params = random_params(rng)
            num_prompt = rng.randrange(1, 6)
            tokens = [rng.randrange(V) for _ in range(num_prompt + rng.randrange(8))]
            seed = rng.randrange(-(2**63), 2**64)
            table.set_row(row, params, num_prompt, seed)
            rows[row] = (params, tokens, num_prompt, seed)
        picked = rng.sample(sorted(rows), rng.randrange(len(rows) + 1))
        expected = SamplingTensors.from_params(
            [rows[r][0] for r in picked],
            prompt_token_ids=[rows[r][1][: rows[r][2]] for r in picked],
            output_token_ids=[rows[r][1][rows[r][2] :] for r in picked],
            vocab_size=V,
            eos_token_ids=EOS,
            seeds=[rows[r][3] for r in picked],
        )
        got = table.gather(
            np.array(picked, dtype=np.int64), [rows[r][1] for r in picked], EOS, "cpu"
        )
        assert_same(got, expected)


@pytest.mark.parametrize("seed", range(5))
def test_decode_inputs_match_the_general_build(seed):
    rng = random.Random(seed)
    token_ids = [[rng.randrange(1000) for _ in range(rng.randrange(2, 40))] for _ in range(9)]
    # one token each: the last known token (samples) or an earlier one (a spec / chunk end)
    computed = [len(t) - rng.choice([1, 1, 2]) for t in token_ids]
    rows = rng.sample(range(20), 9)
    decode = build_batch_inputs(token_ids, computed, [1] * 9, rows)
    # the same batch plus a 0-token request takes the general path; drop that request again
    general = build_batch_inputs([*token_ids, [5]], [*computed, 0], [1] * 9 + [0], [*rows, 0])
    assert np.array_equal(decode.input_ids, general.input_ids)
    assert np.array_equal(decode.positions, general.positions)
    assert np.array_equal(decode.token_req, general.token_req)
    assert decode.max_seq_len == general.max_seq_len
    assert decode.query_start_loc == general.query_start_loc[:-1]
    assert decode.num_computed_tokens == general.num_computed_tokens[:-1]
    assert decode.rows == rows
    assert np.array_equal(decode.logits_indices, general.logits_indices)
    assert decode.sample_mask == general.sample_mask[:-1]
    assert decode.input_ids.tolist() == [t[c] for t, c in zip(token_ids, computed, strict=True)]
