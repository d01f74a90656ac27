"""`bench forward` / `bench decode` on the tiny model (CPU)."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from rackserve.bench.forward import BatchSpec, roofline, synthetic_step, time_forward
from rackserve.cli import main
from rackserve.model.create import create_checkpoint
from rackserve.model.loader import load_model
from rackserve.model.presets import tiny_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return create_checkpoint(tiny_config(), tmp_path_factory.mktemp("tiny"), seed=0)


def test_batch_spec_parsing():
    assert BatchSpec.parse("prefill:512") == BatchSpec("prefill", 1, 512, 0)
    assert BatchSpec.parse("prefill:512@4096") == BatchSpec("prefill", 1, 512, 4096)
    assert BatchSpec.parse("decode:64@2048") == BatchSpec("decode", 64, 1, 2048)
    assert BatchSpec.parse("decode:64@2048x4") == BatchSpec("decode", 64, 4, 2048)
    assert BatchSpec.parse("mixed:512@1024+8@4096") == BatchSpec("mixed", 1, 512, 1024, 8, 4096)
    assert BatchSpec.parse("mixed:97+2@64").requests() == [(97, 0), (1, 64), (1, 64)]
    for bad in ("decode:64", "prefill:5x2", "train:3@4", "mixed:5+2", "mixed:5@3"):
        with pytest.raises(ValueError, match=r"--batch|context|suffix"):
            BatchSpec.parse(bad)


def test_synthetic_step_inputs_and_counts(tiny):
    """Decode 2 requests at context 40: positions, window-only tables, planner counts."""
    model = load_model(tiny)
    spec = BatchSpec("decode", 2, 1, 40)
    synthetic = synthetic_step(model, spec, seed=3)
    step = synthetic.step
    assert step.inputs.input_ids.shape == (2,)
    assert step.inputs.positions.tolist() == [40, 40]
    assert len(time_forward(model, synthetic, iters=2, warmup=0)) == 2
    counts = roofline(model, spec, "h200")
    assert counts["flops"] > 0 and counts["bytes"] > 0 and counts["roofline_s"] > 0
    # the sliding groups' tables are rings as wide as one decode step's live slots (3..5):
    # slot j in column j % 3, every column a real block
    swa = synthetic.input_batch.block_tables.tables["swa"]
    window = next(g for g in synthetic.groups if g.name == "swa")
    assert swa.shape[1] == window.ring_blocks(1) == 3
    assert (swa[0] != 0).all() and len(set(swa[0].tolist())) == 3


def test_mixed_step_inputs_and_counts(tiny):
    """A 30-token prefill chunk after 16 cached tokens plus 3 decodes at context 40: one
    eager step; its FLOPs are the sum of both parts, its bytes at most their sum."""
    model = load_model(tiny)
    spec = BatchSpec.parse("mixed:30@16+3@40")
    synthetic = synthetic_step(model, spec, seed=1)
    positions = synthetic.step.inputs.positions.tolist()
    assert positions == [*range(16, 46), 40, 40, 40]
    assert len(time_forward(model, synthetic, iters=1, warmup=0)) == 1
    mixed = roofline(model, spec, "h200")
    prefill = roofline(model, BatchSpec("prefill", 1, 30, 16), "h200")
    decode = roofline(model, BatchSpec("decode", 3, 1, 40), "h200")
    assert mixed["flops"] == pytest.approx(prefill["flops"] + decode["flops"])
    assert max(prefill["bytes"], decode["bytes"]) <= mixed["bytes"]
    assert mixed["bytes"] < prefill["bytes"] + decode["bytes"]  # weights read once


def test_cli_forward_writes_calibration_records(tiny, tmp_path, capsys):
    out = tmp_path / "fwd.json"
    argv = [
        "bench",
        "forward",
        "--model",
        str(tiny),
        "--batch",
        "prefill:64",
        "--batch",
        "decode:4@100",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--hardware",
        "h200",
        "--output",
        str(out),
    ]
    assert main(argv) == 0
    records = json.loads(out.read_text())
    assert [r["phase"] for r in records] == ["prefill", "decode"]
    assert all(r["kind"] == "forward" and r["measured_s"] > 0 for r in records)
    assert all(0 < r["fraction_of_roofline"] < 1 for r in records)
    assert "of roofline" in capsys.readouterr().out


def test_cli_decode_reports_step_and_forward(tiny, tmp_path):
    out = tmp_path / "decode.json"
    argv = [
        "bench",
        "decode",
        "--model",
        str(tiny),
        "--concurrency",
        "4",
        "--context",
        "64",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--output",
        str(out),
    ]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["median_step_ms"] >= result["median_forward_ms"] > 0
    # as serve: unset is sync on the CPU; the record says which ran
    assert result["async_scheduling"] is False
    assert main([*argv, "--async-scheduling"]) == 0
    assert json.loads(out.read_text())["async_scheduling"] is True


def test_cli_decode_speculating_reports_the_proposal(tiny, tmp_path):
    """With speculation the record carries the acceptance and the drafter's device time
    (0 on the CPU: without graphs the host proposes, inside the step minus forward)."""
    out = tmp_path / "decode.json"
    spec = '{"method": "mtp", "num_speculative_tokens": 2}'
    argv = ["bench", "decode", "--model", str(tiny), "--concurrency", "2", "--context", "32",
            "--steps", "3", "--warmup", "1", "--speculative-config", spec,
            "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2}
    assert result["median_propose_ms"] == 0.0
    assert result["median_step_minus_device_ms"] == pytest.approx(
        result["median_step_minus_forward_ms"]
    )


def test_cli_decode_profile_writes_host_kernel_and_timeline_sections(tiny, tmp_path):
    profile = tmp_path / "profile.txt"
    argv = ["bench", "decode", "--model", str(tiny), "--concurrency", "2", "--context", "32",
            "--steps", "1", "--warmup", "1", "--profile", str(profile)]  # fmt: skip
    assert main(argv) == 0
    text = profile.read_text()
    sections = [line for line in text.splitlines() if line.startswith("== ")]
    assert [s.split(" over ")[0].split(" of ")[0] for s in sections] == [
        "== cProfile",
        "== torch.profiler",
        "== device timeline",
    ]
    assert "core.py" in text and "no device kernels (CPU run)" in text
    # the profiled steps but the first, each with its host phases (engine/step_phases.py)
    hosts = [line for line in text.splitlines() if line.startswith("  host: ")]
    assert len(hosts) == 2, text
    for line in hosts:
        assert [part.split()[0] for part in line[8:].split(", ")] == [
            "schedule", "prepare", "enqueue", "wait", "emit", "update"
        ]  # fmt: skip


@pytest.mark.gpu
def test_pipelined_times_hide_the_host():
    """A step of 2 ms on the host and ~5 ms on the GPU: each alone takes both (~7 ms), back
    to back only the GPU's (~5 ms), since the host stages step i while step i - 1 runs."""
    import time

    from rackserve.bench.forward import isolated_times, pipelined_times

    def gpu() -> None:
        torch.cuda._sleep(10_000_000)  # ~5-6 ms at an H100 / H200 SM clock

    def run() -> None:
        time.sleep(2e-3)
        gpu()

    run()
    device = torch.device("cuda")
    kernel = statistics.median(isolated_times(gpu, 8, device))
    alone = statistics.median(isolated_times(run, 8, device))
    back_to_back = statistics.median(pipelined_times(run, 8))
    assert alone > kernel + 1.5e-3  # the host's 2 ms count when the device waits for it
    assert abs(back_to_back - kernel) < 0.5e-3  # and not once it overlaps the previous step
