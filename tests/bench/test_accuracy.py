"""bench/accuracy.py: teacher-forced agreement between implementations (CPU, tiny model)."""

from __future__ import annotations

import torch

from rackserve.bench.accuracy import teacher_forced_agreement
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
    assert r["same_vs_a"] == {"argmax_agreement": 1.0, "median_rel_err": 0.0}
    assert r["other_vs_a"]["median_rel_err"] > 1e-3
    assert r["other_vs_a"]["argmax_agreement"] < 1.0
    assert "fp32_margin_where_first_pair_disagrees" not in r
