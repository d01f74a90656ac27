"""Counting: parameter counts against a built reference model, op costs, KV bytes."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from rackserve.model.presets import tiny_config, v4_flash_config
from rackserve.planner.counting import (
    BatchShape,
    expert_union,
    kv_bytes_per_token,
    param_counts,
    step_ops,
)
from rackserve.planner.models import deepseek_v3, deepseek_v4_flash, deepseek_v41_flash


def _reference_count(cfg) -> int:
    # Built on the meta device: shapes only, no memory even at full V4-Flash size.
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(DeepseekV4Config(**cfg.to_hf_dict()))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "cfg",
    [tiny_config(), v4_flash_config(num_layers=4, num_experts=16), v4_flash_config()],
    ids=["tiny", "v4-flash-small", "v4-flash"],
)
def test_param_counts_match_built_model(cfg) -> None:
    assert param_counts(cfg)["total"] == _reference_count(cfg)


def test_v4_flash_sizes_match_published() -> None:
    counts = param_counts(v4_flash_config())
    assert counts["total"] == pytest.approx(284e9, rel=0.02)  # "284B total"
    assert counts["active"] == pytest.approx(13e9, rel=0.05)  # "13B active"


def test_v3_param_counts_match_published() -> None:
    counts = param_counts(deepseek_v3().cfg)
    assert counts["total"] == pytest.approx(671e9, rel=0.01)  # 671B without MTP
    assert counts["total"] + counts["mtp"] == pytest.approx(685e9, rel=0.01)
    assert counts["active"] == pytest.approx(37e9, rel=0.03)


def test_v41_kv_bytes_per_token_matches_mission() -> None:
    model = deepseek_v41_flash()
    assert kv_bytes_per_token(model.cfg, model.formats) == pytest.approx(890, rel=0.05)


def test_expert_union() -> None:
    assert expert_union(256, 8, 1) == pytest.approx(8)
    assert expert_union(256, 8, 0) == 0
    assert expert_union(256, 8, 10_000) == pytest.approx(256)
    assert expert_union(256, 8, 10) < expert_union(256, 8, 20)


def test_decode_flops_match_active_params() -> None:
    # One decode token at tiny context: GEMM FLOPs ~ 2 x active parameters.
    model = deepseek_v4_flash()
    ops = step_ops(model.cfg, BatchShape(1, 1, 0), model.formats)
    gemm = sum(op.flops for op in ops if op.kind in ("gemm", "moe"))
    assert gemm == pytest.approx(2 * param_counts(model.cfg)["active"], rel=0.05)


def test_expert_weight_bytes_read_grow_with_batch_then_saturate() -> None:
    model = deepseek_v4_flash()

    def expert_bytes(batch: int, ep: int = 1) -> float:
        ops = step_ops(model.cfg, BatchShape(batch, 1, 1024), model.formats, ep_size=ep)
        return next(op.bytes_read for op in ops if op.name == "moe.experts")

    assert expert_bytes(1) < expert_bytes(8) < expert_bytes(4096)
    # With EP 8 a rank holds 1/8 of the experts: far fewer weight bytes at the same batch.
    assert expert_bytes(512, 8) < expert_bytes(512) / 4


def test_prefill_logits_only_for_last_token_and_costs_scale() -> None:
    model = deepseek_v4_flash()
    one = step_ops(model.cfg, BatchShape(1, 4096, 0), model.formats)
    two = step_ops(model.cfg, BatchShape(2, 4096, 0), model.formats)
    head = {op.name: op for op in one}["lm_head"]
    assert head.flops == 2 * model.cfg.hidden_size * model.cfg.vocab_size
    assert sum(o.flops for o in two) == pytest.approx(2 * sum(o.flops for o in one), rel=0.01)


def test_longer_context_costs_more_attention() -> None:
    for model in (deepseek_v4_flash(), deepseek_v3()):
        short = step_ops(model.cfg, BatchShape(8, 1, 1024), model.formats)
        long = step_ops(model.cfg, BatchShape(8, 1, 65536), model.formats)
        core = lambda ops: next(op for op in ops if op.name == "attn.core")  # noqa: E731
        assert core(long).flops > core(short).flops
        assert core(long).bytes > core(short).bytes


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError):
        BatchShape(1, 0, 0)
    with pytest.raises(ValueError):
        step_ops(v4_flash_config(), BatchShape(1, 1, 0), ep_size=0)
