"""The agentic benchmark end to end against our real server (short run, tiny model)."""

from __future__ import annotations

import json

from rackserve.bench.agentic import AgenticRunConfig, run_agentic
from rackserve.bench.report import write_agentic_outputs
from rackserve.bench.workloads import AgenticConfig

from conftest import API_KEY, Server


def test_agentic_run_against_rackserve(server: Server, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    workload = AgenticConfig(
        system_prompt_tokens=48, user_context_tokens=24, first_message_tokens=16,
        tool_output_tokens=24, output_tokens=8, turns=4, think_time_s=0.0, seed=3,
    )  # fmt: skip
    run = AgenticRunConfig(concurrency=(2,), warmup_s=1.0, duration_s=8.0, progress=False)
    result = run_agentic(workload, server.base_url, run)
    (level,) = result["levels"]
    assert level["concurrency"] == 2 and level["num_failed"] == 0
    assert level["num_completed"] > 0
    tokens = level["tokens"]
    assert tokens["output"] > 0 and tokens["uncached_input"] > 0
    # later turns extend earlier ones: the server reports cached prompt tokens
    assert tokens["cached_input"] > 0
    assert 0 < level["prefix_hit_rate"] <= 1
    paths = write_agentic_outputs(result, tmp_path / "agentic.json")
    assert json.loads((tmp_path / "agentic.json").read_text())["levels"]
    assert all(p.exists() for p in paths)
