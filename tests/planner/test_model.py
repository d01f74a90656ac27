"""Monotonicity and sanity of the cost model, search, calibration and CLI."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest

from rackserve.planner.comm import A2AShape, all_to_all_time, dp_imbalance, ep_balancedness
from rackserve.planner.cost import Efficiency, load_calibration, load_op_calibration
from rackserve.planner.hardware import get_hardware, hardware_presets
from rackserve.planner.models import deepseek_v4_flash
from rackserve.planner.search import SystemConfig, evaluate, pareto, search
from rackserve.planner.simulate import Workload, decode_perf, prefill_perf

EFF = Efficiency()
WORK = Workload(32768, 512, cached_frac=0.9, length_cv=1.0, step_load_cv=0.2)


def _decode(gpu, batch=64, dep=16, depth=0):
    return decode_perf(deepseek_v4_flash(), gpu, dep, batch, WORK, EFF, depth)


def test_every_preset_has_positive_numbers() -> None:
    for gpu in hardware_presets().values():
        assert gpu.hbm_bytes > 0 and gpu.hbm_bw > 0 and gpu.nic_bw > 0
        assert gpu.peak_flops("fp4") >= gpu.peak_flops("fp8") >= gpu.peak_flops("bf16")


@pytest.mark.parametrize("field", ["hbm_bw", "nvlink_bw", "nic_bw"])
def test_more_bandwidth_is_never_slower(field: str) -> None:
    base = get_hardware("h200")
    fast = replace(base, **{field: getattr(base, field) * 2})
    for dep in (8, 32):  # inside and beyond the NVLink domain
        assert _decode(fast, dep=dep).step.total_s <= _decode(base, dep=dep).step.total_s
        slow_p = prefill_perf(deepseek_v4_flash(), base, dep, 8192, WORK, EFF)
        fast_p = prefill_perf(deepseek_v4_flash(), fast, dep, 8192, WORK, EFF)
        assert fast_p.step.total_s <= slow_p.step.total_s


def test_more_flops_is_never_slower() -> None:
    base = get_hardware("b200")
    fast = replace(base, flops=tuple((p, r * 2) for p, r in base.flops))
    assert _decode(fast).step.total_s <= _decode(base).step.total_s


def test_bigger_batch_trades_interactivity_for_throughput() -> None:
    gpu = get_hardware("gb300-nvl72")
    perfs = [_decode(gpu, batch=b) for b in (1, 8, 64, 256)]
    for a, b in itertools.pairwise(perfs):
        assert b.output_tok_s_per_gpu > a.output_tok_s_per_gpu
        assert b.tok_s_per_user <= a.tok_s_per_user


def test_speculation_raises_interactivity_at_small_batch() -> None:
    gpu = get_hardware("gb300-nvl72")
    assert _decode(gpu, batch=4, depth=2).tok_s_per_user > _decode(gpu, batch=4).tok_s_per_user


def test_imbalance_helpers() -> None:
    assert dp_imbalance(1, 0.5) == 1.0
    assert 1.0 < dp_imbalance(2, 0.2) < dp_imbalance(4, 0.2) < dp_imbalance(64, 0.2)
    assert ep_balancedness(100, 8, 1.0) < ep_balancedness(10_000, 8, 1.0) < 1.0
    assert ep_balancedness(100, 1, 0.9) == 1.0


def test_all_to_all_grows_with_tokens_and_crossing_the_nvlink_domain() -> None:
    gpu = get_hardware("h200")
    small, big = A2AShape(64, 8, 7168), A2AShape(512, 8, 7168)
    assert all_to_all_time(gpu, 8, small, EFF) < all_to_all_time(gpu, 8, big, EFF)
    assert all_to_all_time(gpu, 8, big, EFF) < all_to_all_time(gpu, 16, big, EFF)
    assert all_to_all_time(gpu, 1, big, EFF) == 0.0


def test_search_frontier_and_config_names() -> None:
    model, gpu = deepseek_v4_flash(), get_hardware("gb300-nvl72")
    results = search(model, gpu, WORK, EFF, 3.0, 72)
    frontier = pareto(results)
    assert frontier and all(r.config.num_gpus <= 72 for r in results)
    xs = [r.p90_tok_s_per_user for r in frontier]
    ys = [r.tok_s_per_gpu for r in frontier]
    assert xs == sorted(xs) and ys == sorted(ys, reverse=True)
    name = frontier[0].config.name
    assert SystemConfig.parse(name) == frontier[0].config
    again = evaluate(model, gpu, WORK, frontier[0].config, EFF, 3.0)
    assert again.tok_s_per_gpu == pytest.approx(frontier[0].tok_s_per_gpu)


def test_calibration_scales_efficiency(tmp_path) -> None:
    assert load_calibration(tmp_path, "decode", 0.5) == Efficiency()
    rec = {
        "kind": "forward",
        "gpu": "H200",
        "phase": "decode",
        "measured_s": 2.0,
        "roofline_s": 0.5,
    }
    (tmp_path / "r.json").write_text(json.dumps([rec]))
    eff = load_calibration(tmp_path, "decode", 0.5, gpu="H200")
    assert eff.gemm == pytest.approx(0.3) and eff.hbm == pytest.approx(0.4)
    assert load_calibration(tmp_path, "prefill", 0.5) == Efficiency()


def test_plan_cli_writes_table_json_png(tmp_path, capsys) -> None:
    from rackserve.cli import main

    assert (
        main(
            [
                "plan",
                "--hardware",
                "gb200-nvl72",
                "--slo-tok-s",
                "30",
                "--output-dir",
                str(tmp_path),
                "--results-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "P90 tok/s/u" in out
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["frontier"] and (tmp_path / "plan.png").stat().st_size > 0
    config = data["frontier"][0]["config"]
    assert (
        main(
            [
                "plan",
                "--hardware",
                "gb200-nvl72",
                "--explain",
                config,
                "--results-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert "all-to-all" in capsys.readouterr().out


def test_op_calibration_sets_gemm_and_hbm_from_measured_records(tmp_path) -> None:
    def rec(kind: str, shape: str, eff: float, gpu: str = "NVIDIA H200") -> dict:
        return {"kind": "op_efficiency", "op_kind": kind, "shape": shape, "efficiency": eff,
                "gpu": gpu}  # fmt: skip

    records = [
        rec("gemm", "T=64 K=4096 N=1024", 0.05),  # latency-bound: ignored
        rec("gemm", "T=4096 K=4096 N=1024", 0.5),
        rec("gemm", "T=8192 K=4096 N=4096", 0.7),
        rec("hbm", "copy 1GiB", 0.99),  # clipped to the plausible range
        rec("moe", "64 experts x 1 tokens", 0.99),
        rec("gemm", "T=8192 K=1 N=1", 0.01, gpu="B200"),  # another GPU: ignored
    ]
    (tmp_path / "ops.json").write_text(json.dumps(records))
    eff = load_op_calibration(tmp_path)
    assert eff.gemm == pytest.approx(0.6) and eff.hbm == pytest.approx(0.95)
    assert eff.moe == Efficiency().moe  # untouched
    assert load_op_calibration(tmp_path / "missing") == Efficiency()
