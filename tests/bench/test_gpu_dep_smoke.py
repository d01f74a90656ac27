"""benchmarks/gpu_dep.py --smoke: the DEP device call's parts on the CPU (gloo, tiny sizes),
so the script is known to run before a GPU machine is spent on it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_dep


def test_dispatch_part(tmp_path: Path) -> None:
    assert gpu_dep.main(["--smoke", "--out", str(tmp_path), "--parts", "dispatch"]) == 0
    result = json.loads((tmp_path / "dep.json").read_text())["dispatch"]
    for rank in result["ranks"]:
        assert [r["tokens_per_rank"] for r in rank] == list(gpu_dep.SMOKE.dispatch_tokens)
        assert all(r["dispatch_us"] > 0 and r["combine_us"] > 0 for r in rank)
        assert all(0 < r["rows_sent_remote"] <= r["tokens_per_rank"] * 2 for r in rank)


@pytest.mark.slow
def test_every_part(tmp_path: Path) -> None:
    assert gpu_dep.main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "dep.json").read_text())
    assert result["equality"]["all_equal"]  # fp32 on the CPU: exact
    decode = result["decode"]
    assert decode["dep1"]["local_experts"] == 8 and decode["dep2"][0]["local_experts"] == 4
    step = decode["dep2"][0]["step_ms"]
    assert step["total"] == pytest.approx(step["moe"] + step["dispatch_combine"] + step["rest"])
    eplb = result["eplb"]["ranks"][0]
    assert min(eplb["balancedness_after"]) > min(eplb["balancedness_before"])
    assert eplb["rearranging_steps"] >= 1


def test_memory_part(tmp_path: Path) -> None:
    """Each rank holds half the routed experts (the MTP layer's too) and all the rest."""
    assert gpu_dep.main(["--smoke", "--out", str(tmp_path), "--parts", "memory"]) == 0
    result = json.loads((tmp_path / "dep.json").read_text())["memory"]
    whole = result["one_device_counted"]
    for rank in result["ranks"]:
        assert 2 * rank["counted"]["experts"] == whole["experts"] > 0
        assert rank["counted"]["fp8_linears"] == whole["fp8_linears"] > 0
        assert rank["counted"]["other"] == whole["other"]
