"""``rackserve bench ...``: the benchmark command family.

Every entry of ``BENCH_REGISTRARS`` adds one ``bench`` sub-command to the sub-parsers it is
given and sets ``func``. Benchmarks that live elsewhere (``forward``, ``decode``, ...) add
their registrar to the tuple. Heavy imports happen inside the handlers, so ``--help`` and
the other commands stay fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from rackserve.bench.balance import register_balance
from rackserve.bench.engine_bench import register_scheduler, register_throughput
from rackserve.bench.forward_cli import register_decode, register_forward
from rackserve.bench.replay import register_replay
from rackserve.bench.workloads import AgenticConfig

BenchRegistrar = Callable[[Any], None]  # argument: the `bench` sub-parsers action

_WORKLOAD_HELP = {
    "system_prompt_tokens": "system prompt shared by every session",
    "user_context_tokens": "per-user context (the salt): shared only by one user's sessions",
    "first_message_tokens": "first task message of a session or sub-agent",
    "tool_output_tokens": "mean tool output appended per turn",
    "output_tokens": "mean reply length (max_tokens)",
    "turns": "mean turns per session",
    "think_time_s": "mean pause between turns (exponential), seconds",
    "subagent_probability": "chance that a turn forks sub-agents",
    "subagent_fanout": "sub-agents per fork",
    "subagent_turns": "mean turns per sub-agent",
    "sessions_per_user": "consecutive sessions that share one user (and its context)",
    "length_jitter": "lengths are uniform in [x(1-j), x(1+j)]",
    "scale": "multiplies every token length",
    "seed": "seed of the trace",
}


def _concurrency_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,4,16 (got {text!r})") from None


def _percentile_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 50,99 (got {text!r})") from None


def _add_endpoint_args(parser: argparse.ArgumentParser, base_url_required: bool = True) -> None:
    parser.add_argument(
        "--base-url", required=base_url_required, help="server root, e.g. http://127.0.0.1:8000"
    )
    parser.add_argument("--model", help="model name to send (default: the server's first)")
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    parser.add_argument(
        "--no-fixed-output",
        dest="fixed_output",
        action="store_false",
        help="do not send ignore_eos/min_tokens (for servers that reject them)",
    )
    parser.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS")
    parser.add_argument("--tokenizer", metavar="DIR", help="HF tokenizer to size texts exactly")
    parser.add_argument("--output", metavar="FILE", help="write the JSON result here")
    parser.add_argument("--no-progress", dest="progress", action="store_false")


def register_agentic(bench_subparsers: Any) -> None:
    parser = bench_subparsers.add_parser(
        "agentic",
        help="closed-loop coding-agent sessions over a concurrency sweep",
        description="Replay seeded coding-agent sessions at fixed concurrency levels and "
        "report throughput per GPU, interactivity, TTFT and prefix-hit rate.",
    )
    _add_endpoint_args(parser, base_url_required=False)
    # Defaults (None here) come from AgenticRunConfig, which the parser does not import:
    # it pulls in aiohttp, and building the parser must stay cheap for every command.
    run = parser.add_argument_group("run")
    run.add_argument(
        "--concurrency", type=_concurrency_list, help="sweep, e.g. 1,4,16,64 (the default)"
    )
    run.add_argument("--warmup", type=float, metavar="SECONDS", help="per level (default 10)")
    run.add_argument("--duration", type=float, metavar="SECONDS", help="window (default 60)")
    run.add_argument("--num-gpus", type=int, help="GPUs behind the server (default 1)")
    run.add_argument("--trace-sessions", type=int, help="sessions for trace stats (default 64)")
    parser.add_argument(
        "--trace-only", action="store_true", help="print the trace's statistics and exit"
    )
    policies = parser.add_argument_group("routing policies (bench/policies.py)")
    policies.add_argument(
        "--compare-policies", metavar="P1,P2,..",
        help="run through `rackserve router` once per policy over --engines, e.g. "
        "kv-aware,round-robin,least-load (instead of --base-url)",
    )  # fmt: skip
    policies.add_argument("--engines", metavar="URL,..", help="engines the routers route over")
    policies.add_argument(
        "--router-arg", action="append", default=[], metavar="ARG",
        help="extra router argument, repeatable (e.g. --router-arg=--kv-events=tcp://..)",
    )  # fmt: skip
    policies.add_argument("--plot", metavar="PNG", help="hit rate and TTFT by policy (PNG)")
    workload = parser.add_argument_group("workload (lengths in approximate tokens)")
    for field in dataclasses.fields(AgenticConfig):
        flag = "--" + field.name.removesuffix("_s").replace("_", "-")
        workload.add_argument(
            flag,
            dest=field.name,
            type=type(field.default),
            default=field.default,
            help=f"{_WORKLOAD_HELP[field.name]} (default {field.default})",
        )
    parser.set_defaults(func=_agentic_main)


def _counter(args: argparse.Namespace) -> Any:
    if not args.tokenizer:
        return None
    from rackserve.bench.workloads import load_token_counter

    return load_token_counter(args.tokenizer)


def _agentic_main(args: argparse.Namespace) -> int:
    import json

    from rackserve.bench.agentic import AgenticRunConfig, run_agentic
    from rackserve.bench.metrics import trace_stats
    from rackserve.bench.report import format_agentic_report, write_agentic_outputs

    workload = AgenticConfig(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(AgenticConfig)}
    )
    counter = _counter(args)
    given = {
        "concurrency": args.concurrency,
        "warmup_s": args.warmup,
        "duration_s": args.duration,
        "num_gpus": args.num_gpus,
        "trace_sessions": args.trace_sessions,
    }
    run = AgenticRunConfig(
        endpoint=args.endpoint,
        fixed_output=args.fixed_output,
        request_timeout_s=args.request_timeout,
        progress=args.progress,
        **{k: v for k, v in given.items() if v is not None},
    )
    if args.trace_only:
        print(json.dumps(trace_stats(workload, run.trace_sessions, counter=counter), indent=2))
        return 0
    if args.compare_policies:
        from rackserve.bench.policies import compare_main

        return compare_main(args, workload, run, counter)
    if not args.base_url:
        raise ValueError("--base-url is required (or pass --trace-only)")
    result = run_agentic(workload, args.base_url, run, model=args.model, counter=counter)
    print(format_agentic_report(result))
    if args.output:
        for path in write_agentic_outputs(result, args.output):
            print(f"wrote {path}")
    # Exit non-zero when nothing succeeded, so scripts notice a dead or wrong server.
    return 0 if any(level["num_completed"] for level in result["levels"]) else 1


def register_serve(bench_subparsers: Any) -> None:
    parser = bench_subparsers.add_parser(
        "serve",
        help="random prompts at a request rate or concurrency (vllm bench serve fields)",
        description="Send random-length prompts (Poisson rate and/or max concurrency); "
        "the result uses the field names of `vllm bench serve`.",
    )
    _add_endpoint_args(parser)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", "--random-input-len", type=int, default=1024)
    parser.add_argument("--output-len", "--random-output-len", type=int, default=128)
    parser.add_argument("--range-ratio", "--random-range-ratio", type=float, default=0.0)
    parser.add_argument(
        "--request-rate", type=float, default=math.inf, help="Poisson requests/s (default inf)"
    )
    parser.add_argument("--burstiness", type=float, default=1.0)
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--metric-percentiles", type=_percentile_list, default=(99.0,), metavar="P,P"
    )
    parser.add_argument("--save-detailed", action="store_true", help="add per-request lists")
    # vllm bench serve's common flags (issue 15)
    vllm = parser.add_argument_group("vllm bench serve flags")
    vllm.add_argument(
        "--backend", choices=("openai-chat", "openai", "vllm"),
        help="openai-chat: /v1/chat/completions; openai, vllm: /v1/completions",
    )  # fmt: skip
    vllm.add_argument("--dataset-name", choices=("random",), default="random")
    vllm.add_argument("--save-result", action="store_true", help="write the JSON result")
    vllm.add_argument("--result-dir", default=".", help="folder of --save-result's file")
    vllm.add_argument("--result-filename", help="file name of --save-result's file")
    vllm.add_argument("--label", help="label of the run in the result")
    vllm.add_argument(
        "--ignore-eos", action="store_true", help="send ignore_eos (the default already)"
    )
    vllm.add_argument(
        "--percentile-metrics", default="ttft,tpot,itl,e2el", help="comma list of those metrics"
    )
    vllm.add_argument(
        "--goodput", nargs="+", default=[], metavar="METRIC:MS",
        help="SLOs for request_goodput, e.g. ttft:500 tpot:50 e2el:2000",
    )  # fmt: skip
    vllm.add_argument("--num-warmups", type=int, default=0, help="untimed requests first")
    parser.set_defaults(func=_serve_main)


def _goodput(items: list[str]) -> tuple[tuple[str, float], ...]:
    slos = []
    for item in items:
        name, _, value = item.partition(":")
        try:
            slos.append((name, float(value)))
        except ValueError:
            raise ValueError(f"--goodput takes METRIC:MS, got {item!r}") from None
    return tuple(slos)


def _result_filename(result: dict, config: Any) -> str:
    """vllm bench serve's default name: {backend}-{rate}qps[-concurrency{c}]-{model}-{date}."""
    rate = result["request_rate"]
    concurrency = f"-concurrency{config.max_concurrency}" if config.max_concurrency else ""
    model = str(result["model_id"]).rstrip("/").split("/")[-1]
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{result['backend']}-{rate}qps{concurrency}-{model}-{date}.json"


def _serve_main(args: argparse.Namespace) -> int:
    from rackserve.bench.report import format_serve_report, write_json
    from rackserve.bench.serve import ServeConfig, run_serve

    endpoint = args.endpoint
    if args.backend is not None:
        endpoint = "chat" if args.backend == "openai-chat" else "completions"
    config = ServeConfig(
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        endpoint=endpoint,
        fixed_output=args.fixed_output or args.ignore_eos,
        request_timeout_s=args.request_timeout,
        percentiles=args.metric_percentiles,
        save_detailed=args.save_detailed,
        progress=args.progress,
        percentile_metrics=tuple(m for m in args.percentile_metrics.split(",") if m),
        goodput=_goodput(args.goodput),
        num_warmups=args.num_warmups,
        label=args.label,
        tokenizer_id=args.tokenizer,
    )
    result = run_serve(config, args.base_url, model=args.model, counter=_counter(args))
    print(format_serve_report(result))
    if args.output:
        print(f"wrote {write_json(result, args.output)}")
    if args.save_result:
        name = args.result_filename or _result_filename(result, config)
        print(f"wrote {write_json(result, Path(args.result_dir) / name)}")
    return 0 if result["completed"] else 1


BENCH_REGISTRARS: tuple[BenchRegistrar, ...] = (
    register_agentic,
    register_serve,
    register_scheduler,
    register_throughput,
    register_forward,
    register_decode,
    register_balance,
    register_replay,
)


def register(subparsers: Any) -> None:
    """Add ``bench`` and its sub-commands (one per entry of ``BENCH_REGISTRARS``)."""
    bench = subparsers.add_parser("bench", help="benchmarks against servers and engines")
    bench_subparsers = bench.add_subparsers(dest="bench_command", required=True)
    for registrar in BENCH_REGISTRARS:
        registrar(bench_subparsers)
