"""bench/accuracy.py: teacher-forced agreement between implementations (CPU, tiny model)."""

from __future__ import annotations

import torch

from rackserve.bench.accuracy import argmax_agreement, reference_ties, teacher_forced_agreement
from rackserve.model.create import init_model_
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.model.presets import tiny_config


def _model(seed: int) -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM(tiny_config(), with_mtp=False)
    init_model_(model, seed=seed)
    return model.eval()


def test_identical_models_agree_exactly_and_perturbed_ones_do_not():
    a = _model(0)
    same = _model(0)
    other = _model(0)
    with torch.no_grad():
        other.head.weight.add_(0.05 * torch.randn_like(other.head.weight))
    pairs = [("same", "a"), ("other", "a")]
    r = teacher_forced_agreement({"a": a, "same": same, "other": other}, pairs, 20, 6, 3)
    assert r["same_vs_a"]["argmax_agreement"] == 1.0
    assert r["same_vs_a"]["argmax_agreement_first_index"] == 1.0
    assert r["same_vs_a"]["median_rel_err"] == 0.0
    assert r["other_vs_a"]["median_rel_err"] > 1e-3
    assert r["other_vs_a"]["argmax_agreement"] < 1.0
    assert "fp32_margin_where_first_pair_disagrees" not in r


def test_argmax_agreement_counts_any_tied_maximum_of_the_reference():
    ref = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 1.0, 0.0, 0.0], [0.0, 0.5, 0.25, 0.5]])
    # row 0: the reference ties tokens 1 and 2 (argmax names 1); the candidate picks 2
    # row 1: a clear reference maximum the candidate misses; row 2: a tie, token 3 picked
    cand = torch.tensor([[0.0, 1.0, 2.0, 0.0], [0.0, 5.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    assert argmax_agreement(cand, ref).tolist() == [True, False, True]
    assert (cand.argmax(-1) == ref.argmax(-1)).tolist() == [False, False, False]
    assert reference_ties(ref).tolist() == [True, False, True]


def test_bf16_rounding_makes_ties_that_first_index_agreement_counts_against():
    gen = torch.Generator().manual_seed(0)
    exact = 3.0 + 0.05 * torch.randn(64, 4096, generator=gen)
    rounded = exact.to(torch.bfloat16).float()  # the bf16 reference's logits
    assert reference_ties(rounded).float().mean() > 0.25  # spacing 2^-6 near 3
    assert argmax_agreement(exact, rounded).all()  # the exact argmax is always one of them
    assert (exact.argmax(-1) == rounded.argmax(-1)).float().mean() < 0.9
