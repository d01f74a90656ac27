"""``rackserve bench agentic|serve`` from argv to files."""

from __future__ import annotations

import argparse
import json

import pytest

from rackserve.bench import cli


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rackserve")
    cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_registrars_build_the_bench_family() -> None:
    assert cli.register_agentic in cli.BENCH_REGISTRARS
    args = parse(["bench", "agentic", "--base-url", "http://x", "--concurrency", "1,4,16"])
    assert args.concurrency == (1, 4, 16) and args.think_time_s == 0.5
    args = parse(["bench", "serve", "--base-url", "http://x", "--random-input-len", "64"])
    assert args.input_len == 64 and args.max_concurrency is None
    with pytest.raises(SystemExit):
        parse(["bench", "agentic", "--concurrency", "1,x"])


def test_trace_only_prints_statistics(capsys) -> None:
    args = parse(["bench", "agentic", "--trace-only", "--trace-sessions", "4", "--turns", "3"])
    assert args.func(args) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["num_sessions"] == 4 and 0 < stats["theoretical_prefix_hit_rate"] < 1


def test_agentic_command_writes_json_and_plots(fake_server, tmp_path, capsys) -> None:
    output = tmp_path / "out" / "run.json"
    argv = ["bench", "agentic", "--base-url", fake_server.base_url, "--output", str(output)]
    argv += ["--concurrency", "2", "--warmup", "0", "--duration", "0.5", "--no-progress"]
    argv += ["--system-prompt-tokens", "64", "--user-context-tokens", "16", "--turns", "3"]
    argv += ["--tool-output-tokens", "16", "--output-tokens", "4", "--think-time", "0"]
    args = parse(argv)
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "theoretical prefix-hit rate" in printed and "run_pareto.png" in printed
    result = json.loads(output.read_text())
    assert result["workload"]["system_prompt_tokens"] == 64
    assert (tmp_path / "out" / "run_ttft_cdf.png").is_file()


def test_serve_command_writes_vllm_fields(fake_server, tmp_path) -> None:
    output = tmp_path / "serve.json"
    argv = ["bench", "serve", "--base-url", fake_server.base_url, "--num-prompts", "5"]
    argv += ["--input-len", "10", "--output-len", "3", "--output", str(output), "--no-progress"]
    argv += ["--metric-percentiles", "90,99"]
    args = parse(argv)
    assert args.func(args) == 0
    result = json.loads(output.read_text())
    assert result["completed"] == 5 and "p90_itl_ms" in result and "p99_ttft_ms" in result


def test_agentic_without_base_url_is_a_clear_error() -> None:
    args = parse(["bench", "agentic"])
    with pytest.raises(ValueError, match="--base-url"):
        args.func(args)
