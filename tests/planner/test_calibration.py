"""Per-op calibration from fast-path `bench forward` records and their kernel profile: the
group split, the analogy for unprofiled cases, the nearest-point lookup by tokens and
context, which records count, and `plan --explain` naming them (small fixture records)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rackserve.cli import main
from rackserve.model.presets import preset_config
from rackserve.planner.calibration import (
    ATTN,
    MHC,
    REST,
    ROUTED,
    OpSite,
    load_op_calibration_points,
    op_group,
    op_roofline,
    predict_case,
)
from rackserve.planner.counting import BatchShape, step_ops
from rackserve.planner.hardware import get_hardware
from rackserve.planner.models import Formats

MODEL = "v4-flash (2 layers, 16 experts)"
FORWARD_FILE = "2026-12-01-h200-forward-x-t1.json"
H200 = get_hardware("h200")
BF16 = Formats(
    weight_bytes=2, expert_bytes=2, kv_bytes=2, act_bytes=2, dispatch_bytes=2,
    gemm_precision="bf16", expert_precision="bf16", attention_precision="bf16",
    indexer_precision="bf16",
)  # fmt: skip


def _rooflines(requests: int, new: int, context: int) -> dict[str, float]:
    cfg = preset_config("v4-flash", 2, 16)
    ops = step_ops(cfg, BatchShape(requests, new, context), BF16, logits_tokens=requests)
    out = dict.fromkeys((ROUTED, ATTN, MHC, REST), 0.0)
    for op in ops:
        out[op_group(op)] += op_roofline(op, H200)
    return out


def _record(batch: str, shape: tuple[int, int, int], step_eff: float, **extra) -> dict:
    roofline = sum(_rooflines(*shape).values())
    return {
        "kind": "forward", "implementation": "fast", "phase": batch.split(":")[0],
        "batch": batch, "model": MODEL, "gpu": "H200", "measured_s": roofline / step_eff,
        "roofline_s": roofline, "date": "2026-12-01", "commit": "abc1234", **extra,
    }  # fmt: skip


# decode:8@1024 profiled: each group's kernels at a known efficiency; the rest of the
# step (a GEMM in the top list, kernels outside it, launch gaps) at 0.5
EFFS = {ROUTED: 0.6, ATTN: 0.2, MHC: 0.1, REST: 0.5}
ROOF = _rooflines(8, 1, 1024)
KERNELS = [
    {"name": "moe_gate_up_kernel", "calls": 2, "us": 0.7e6 * ROOF[ROUTED] / EFFS[ROUTED]},
    {"name": "moe_down_kernel", "calls": 2, "us": 0.3e6 * ROOF[ROUTED] / EFFS[ROUTED]},
    {"name": "sparse_attn_kernel", "calls": 2, "us": 1e6 * ROOF[ATTN] / EFFS[ATTN]},
    {"name": "prenorm_gemm_kernel", "calls": 5, "us": 1e6 * ROOF[MHC] / EFFS[MHC]},
    {"name": "nvjet_sm90_tst_64x8", "calls": 9, "us": 0.5e6 * ROOF[REST] / EFFS[REST]},
]
PROFILED_S = sum(ROOF[g] / e for g, e in EFFS.items())


@pytest.fixture
def results(tmp_path: Path) -> Path:
    profiled = _record("decode:8@1024", (8, 1, 1024), 0.5)
    profiled["measured_s"] = PROFILED_S
    records = [
        profiled,
        _record("decode:8@8192", (8, 1, 8192), 0.25),  # no profile: split by analogy
        _record("prefill:512", (1, 512, 0), 0.4),  # no prefill profile: the step's level
        _record("decode:8@1024", (8, 1, 1024), 0.9, date="2026-11-01"),  # older: ignored
        {**_record("decode:2@64", (2, 1, 64), 0.5), "roofline_s": 1.0},  # stale counting
        {**_record("decode:4@64", (4, 1, 64), 0.5), "implementation": "reference"},
    ]
    (tmp_path / FORWARD_FILE).write_text(json.dumps(records))
    profile = {"decode:8@1024": {"kernels": 12, "kernel_ms": 0.18, "top": KERNELS}}
    (tmp_path / "2026-12-01-h200-profile-t1.json").write_text(json.dumps(profile))
    (tmp_path / "notes.json").write_text("{not json")  # unreadable files are skipped
    return tmp_path


def _site(requests: int, context: int, new: int = 1) -> OpSite:
    return OpSite.of(BatchShape(requests, new, context), 16, 6, 1)


def test_profiled_case_splits_by_kernel_group(results: Path) -> None:
    cal = load_op_calibration_points(results)
    want = EFFS
    for group, eff in want.items():
        point = cal.lookup(group, _site(8, 1024))
        assert point is not None and point.source.profiled
        assert point.efficiency == pytest.approx(eff, rel=1e-9), group
        assert point.source.case == "decode:8@1024" and point.source.commit == "abc1234"


def test_unprofiled_case_takes_the_nearest_split_at_its_own_level(results: Path) -> None:
    cal = load_op_calibration_points(results)
    near, far = cal.lookup(ATTN, _site(8, 1024)), cal.lookup(ATTN, _site(8, 8192))
    assert far.source.case == "decode:8@8192" and not far.source.profiled
    far_roof = _rooflines(8, 1, 8192)
    far_measured = sum(far_roof.values()) / 0.25
    scale = sum(far_roof[g] / EFFS[g] for g in EFFS) / far_measured  # reproduces its step
    assert far.efficiency == pytest.approx(near.efficiency * scale, rel=1e-9)
    records = json.loads((results / FORWARD_FILE).read_text())
    # its routed experts see the rows per expert of the profiled case: that one's measured
    # efficiency wins the tie; every other group is at this case's own level
    want = sum(far_roof[g] / (EFFS[g] if g == ROUTED else EFFS[g] * scale) for g in EFFS)
    assert predict_case(records[1], cal) == pytest.approx(want, rel=1e-9)
    # context picks the point: 6000 is nearer 8192 than 1024 on a log scale
    assert cal.lookup(ATTN, _site(8, 6000)).source.case == "decode:8@8192"
    assert cal.lookup(ATTN, _site(8, 2000)).source.case == "decode:8@1024"
    # prefill has no profile: every group at the step's own efficiency
    prefill = [cal.lookup(g, _site(1, 0, new=512)).efficiency for g in (ROUTED, ATTN, REST)]
    assert prefill == pytest.approx([0.4] * 3)


def test_routed_experts_are_looked_up_by_rows_per_expert(results: Path) -> None:
    cal = load_op_calibration_points(results)
    # EP8 with 64 experts: 8 tokens x 8 ranks x top-6 / 64 = 6 rows/expert, as the recorded
    # decode:8 (8 x 6 / 16 = 3), whatever the context
    site = OpSite.of(BatchShape(8, 1, 1_000_000), 64, 6, 8)
    assert site.rows_per_expert == 6.0
    assert cal.lookup(ROUTED, site).source.case in ("decode:8@1024", "decode:8@8192")
    assert cal.lookup(ROUTED, OpSite("prefill", 4096, 0, 100.0)).source.case == "prefill:512"


def test_which_records_count(results: Path) -> None:
    cal = load_op_calibration_points(results)
    cases = {p.source.case for p in cal.points}
    assert cases == {"decode:8@1024", "decode:8@8192", "prefill:512"}  # newest, fast only
    assert len(cal.skipped) == 1 and "decode:2@64" in cal.skipped[0]
    assert "the counting now gives" in cal.skipped[0]
    assert not load_op_calibration_points(results / "missing")  # no records: no calibration


def test_recorded_case_is_predicted_from_its_own_and_others_records(results: Path) -> None:
    records = json.loads((results / FORWARD_FILE).read_text())
    cal = load_op_calibration_points(results)
    # in-sample: every group of a profiled case is calibrated -> the measured step exactly
    assert predict_case(records[0], cal) == pytest.approx(PROFILED_S, rel=1e-9)
    # leave one out: decode:8@8192 predicted from decode:8@1024 alone, slower at 8x context
    out = load_op_calibration_points(
        results, exclude=(results.glob("*forward*").__next__().name, "decode:8@8192")
    )
    assert {p.source.case for p in out.points} == {"decode:8@1024", "prefill:512"}
    predicted = predict_case(records[1], out)
    assert predicted != pytest.approx(records[1]["measured_s"], rel=0.01)
    assert predicted > 0


def test_plan_explain_names_the_records(results: Path, capsys) -> None:
    config = "1xDEP2+1xDEP2-t8192-b8-s0"
    args = ["plan", "--explain", config, "--hardware", "h200", "--results-dir", str(results)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "calibration at decode" in out and "calibration at prefill" in out
    assert "2026-12-01-h200-forward-x-t1.json decode:8@" in out and "@abc1234" in out
    assert "skipped: 2026-12-01-h200-forward-x-t1.json decode:2@64" in out
    assert main([*args[:-1], str(results / "missing")]) == 0
    assert "calibration: none" in capsys.readouterr().out
