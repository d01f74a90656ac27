"""`rackserve bench balance`: real vs uniform vs EPLB balancedness from a routing trace."""

import json

import pytest
import torch

from rackserve.bench.balance import BalanceConfig, default_num_slots, evaluate, load_trace
from rackserve.cli import main
from rackserve.moe.skew import synthetic_trace


def test_default_slots():
    assert default_num_slots(256, 8, None) == 264
    assert default_num_slots(256, 72, None) == 288
    assert default_num_slots(256, 72, 32) == 288
    with pytest.raises(ValueError, match="do not split"):
        default_num_slots(256, 72, 10)


def test_eplb_recovers_the_gap_on_skewed_routing():
    trace = synthetic_trace(2, 64, 4, 4096, exponent=1.2, seed=0)
    result = evaluate(trace, 64, BalanceConfig(ep_sizes=(8, 16), tokens_per_rank=32, num_steps=4))
    for ep in result["ep"]:
        assert ep["real"] <= 0.5  # the skew is real
        assert ep["uniform"] > 0.8
        assert ep["eplb"] >= 0.8 and ep["gap_recovered"] >= 0.9
        assert len(ep["layers"]) == 2


def test_cli_writes_json_and_png(tmp_path, capsys):
    trace = synthetic_trace(2, 32, 2, 512, exponent=1.0, seed=1)
    path = tmp_path / "trace.pt"
    torch.save({"topk_ids": trace, "num_experts": 32}, path)
    assert load_trace(path)[1] == 32
    out = tmp_path / "balance.json"
    code = main(
        [
            "bench",
            "balance",
            "--trace",
            str(path),
            "--ep-size",
            "4",
            "--simulate-ep",
            "8",
            "--steps",
            "2",
            "--tokens-per-rank",
            "8",
            "--output",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert [ep["ep_size"] for ep in result["ep"]] == [4, 8]
    assert (tmp_path / "balance.png").stat().st_size > 0
    assert "gap recovered" in capsys.readouterr().out


def test_bad_trace_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "bad.pt"
    torch.save({"topk_ids": torch.tensor([[[0, 40]]]), "num_experts": 8}, path)
    assert main(["bench", "balance", "--trace", str(path)]) == 2
    assert "topk_ids must be" in capsys.readouterr().err
