"""The agentic runner: message layout, a short sweep against the fake server, outputs."""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, field

import pytest

from rackserve.bench.agentic import AgenticRunConfig, run_agentic, run_session
from rackserve.bench.client import GenerationRequest, RequestTimeline
from rackserve.bench.report import format_agentic_report, write_agentic_outputs
from rackserve.bench.workloads import AgenticConfig, generate_session, iter_sessions, plan_requests
from rackserve.config import ConfigError

WORKLOAD = AgenticConfig(
    system_prompt_tokens=200,
    user_context_tokens=50,
    first_message_tokens=20,
    tool_output_tokens=30,
    output_tokens=8,
    turns=4,
    think_time_s=0.005,
    subagent_probability=0.3,
)
FAST = AgenticRunConfig(concurrency=(1, 3), warmup_s=0.2, duration_s=0.8, progress=False)


@dataclass
class EchoClient:
    """Replies with exactly ``max_tokens`` words and records every request it gets."""

    requests: list[GenerationRequest] = field(default_factory=list)

    async def generate(self, request: GenerationRequest) -> RequestTimeline:
        self.requests.append(request)
        text = " ".join(["word"] * request.max_tokens)
        return RequestTimeline(request.tag, 0.0, 1.0, (0.5,), text=text)


def test_sessions_send_what_the_plan_says() -> None:
    """The runner's messages and the planner's segments describe the same requests."""
    session = next(s for s in iter_sessions(WORKLOAD) if any(t.subagents for t in s.turns))
    client = EchoClient()
    records: list[RequestTimeline] = []
    reply = asyncio.run(run_session(client, session, records.append))  # type: ignore[arg-type]
    assert reply == " ".join(["word"] * session.turns[-1].output_tokens)
    planned = plan_requests(session)
    # Sub-agents run in parallel, so their requests interleave: match them by tag.
    sent = {r.tag: r for r in client.requests}
    assert sorted(sent) == sorted(f"{p.session_id}.t{p.turn}" for p in planned)
    for plan in planned:
        request = sent[f"{plan.session_id}.t{plan.turn}"]
        words = sum(len(m["content"].split()) for m in request.messages)
        assert words == sum(num for _, num in plan.prompt)
        assert request.max_tokens == plan.output[1]
        roles = [m["role"] for m in request.messages]
        assert roles[0] == "system" and roles[-1] == "user"
        assert all(a != b for a, b in itertools.pairwise(roles[1:]))  # alternate


def test_a_failed_request_ends_the_session() -> None:
    @dataclass
    class FailingClient(EchoClient):
        async def generate(self, request: GenerationRequest) -> RequestTimeline:
            self.requests.append(request)
            return RequestTimeline(request.tag, 0.0, 1.0, error="HTTP 500")

    client = FailingClient()
    reply = asyncio.run(run_session(client, generate_session(WORKLOAD, 0), lambda t: None))  # type: ignore[arg-type]
    assert reply is None and len(client.requests) == 1


def test_short_sweep_against_the_fake_server(fake_server, tmp_path) -> None:
    run = AgenticRunConfig(**{**FAST.__dict__, "num_gpus": 2})
    result = run_agentic(WORKLOAD, fake_server.base_url, run)
    assert result["model"] == "fake-model"
    assert [level["concurrency"] for level in result["levels"]] == [1, 3]
    theoretical = result["trace"]["theoretical_prefix_hit_rate"]
    for level in result["levels"]:
        assert level["num_completed"] > 5 and level["num_failed"] == 0
        tokens, per_gpu = level["tokens"], level["throughput_per_gpu"]
        assert per_gpu["total"] == pytest.approx(tokens["total"] / 0.8 / 2)
        assert tokens["output"] >= 4 * level["num_completed"]  # 8 tokens with jitter 0.5
        # The fake server's infinite cache sees the trace's structure plus role markers.
        assert level["prefix_hit_rate"] == pytest.approx(theoretical, abs=0.06)
        assert level["interactivity_tok_s"] > 0 and level["ttft_ms"]["p99"] > 0
        assert len(level["ttft_cdf_ms"]) == 101
    payload = fake_server.state.payloads[-1]
    assert payload["stream_options"] == {"include_usage": True} and payload["ignore_eos"]
    assert fake_server.state.max_in_flight >= 3

    paths = write_agentic_outputs(result, tmp_path / "agentic.json")
    assert [p.name for p in paths] == ["agentic.json", "agentic_pareto.png", "agentic_ttft_cdf.png"]
    assert json.loads(paths[0].read_text())["levels"][1]["concurrency"] == 3
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths[1:])
    table = format_agentic_report(result)
    assert "tok/s/GPU" in table and len(table.splitlines()) == 2 + 2 + 2


def test_failures_are_reported(fake_server_factory) -> None:
    server = fake_server_factory(fail_every=4)
    run = AgenticRunConfig(concurrency=(2,), warmup_s=0.0, duration_s=0.6, progress=False)
    (level,) = run_agentic(WORKLOAD, server.base_url, run, model="fake-model")["levels"]
    assert level["num_failed"] > 0 and level["num_completed"] > 0
    assert level["failure_examples"][0].startswith("HTTP 500")


def test_completions_endpoint(fake_server) -> None:
    run = AgenticRunConfig(
        concurrency=(2,), warmup_s=0.0, duration_s=0.5, endpoint="completions", progress=False
    )
    (level,) = run_agentic(WORKLOAD, fake_server.base_url, run)["levels"]
    assert level["num_completed"] > 0 and level["prefix_hit_rate"] > 0.5
    assert "prompt" in fake_server.state.payloads[-1]


def test_run_config_validation() -> None:
    with pytest.raises(ConfigError, match="concurrency"):
        AgenticRunConfig(concurrency=(0,))
    with pytest.raises(ConfigError, match="duration"):
        AgenticRunConfig(duration_s=0)
