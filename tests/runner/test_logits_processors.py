"""logit_bias and the structured-output bitmask on logits (pure tensor functions)."""

from __future__ import annotations

import torch

from rackserve.request import SamplingParams
from rackserve.runner.logits_processors import (
    apply_logit_bias,
    apply_logits_processors,
    apply_token_bitmask,
)


def test_logit_bias_adds_per_row_and_ignores_out_of_vocab() -> None:
    logits = torch.zeros(3, 10)
    apply_logit_bias(logits, [{2: 5.0, 9: -1.5}, None, {0: 100.0, 12: 3.0}])
    expected = torch.zeros(3, 10)
    expected[0, 2], expected[0, 9], expected[2, 0] = 5.0, -1.5, 100.0
    assert torch.equal(logits, expected)


def test_hook_applies_only_biased_rows_and_changes_argmax() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    params = [SamplingParams(logit_bias={0: 100.0}), SamplingParams()]
    out = apply_logits_processors(logits, params)
    assert out.argmax(dim=-1).tolist() == [0, 2]


def test_bitmask_matches_a_reference_loop() -> None:
    torch.manual_seed(0)
    num_rows, vocab_size = 4, 70  # not a multiple of 32: the last word is partial
    allowed = torch.rand(num_rows, vocab_size) < 0.3
    allowed[3] = True  # an unconstrained row
    words = (vocab_size + 31) // 32
    bitmask = torch.zeros(num_rows, words, dtype=torch.int32)
    for s in range(num_rows):
        for v in range(words * 32):
            if v >= vocab_size or allowed[s, v]:
                word = int(bitmask[s, v // 32]) | (1 << (v % 32))
                bitmask[s, v // 32] = word - (1 << 32) if word >= 1 << 31 else word
    logits = torch.randn(num_rows, vocab_size)
    out = apply_token_bitmask(logits.clone(), bitmask)
    assert torch.equal(torch.isinf(out), ~allowed)
    assert torch.equal(out[allowed], logits[allowed])
