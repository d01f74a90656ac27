"""``rackserve bench replay``: the cost of DP imbalance, measured as the published system does.

One request set (random prompts of ``--input-len`` tokens, ``--output-len`` each) is
replayed once per DP rank: all copies at once (``mirror``), or copy r delayed by r x
``--lag-s`` (``lag``). Copy r carries the header ``X-data-parallel-rank: r`` (vLLM's
spelling), which our server (like vLLM's) honours: copy r runs whole on rank r, so every
rank holds the same request set. The throughput difference between the modes is the
cost of imbalance::

    mirror:  rank 0 |=====copy 0=====|          lag:  rank 0 |==copy 0==|
             rank 1 |=====copy 1=====|                rank 1      |==copy 1==|
                                                      (the instance waits for its slowest rank)
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

from rackserve.bench.client import (
    EndpointConfig,
    GenerationRequest,
    RequestTimeline,
    open_client,
    resolve_model,
)
from rackserve.bench.workloads import make_text

MODES = ("mirror", "lag")


@dataclass(frozen=True)
class ReplayConfig:
    mode: str = "mirror"
    lag_s: float = 5.0
    num_ranks: int = 2
    num_prompts: int = 32
    input_len: int = 256
    output_len: int = 32
    seed: int = 0
    endpoint: str = "completions"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {MODES}, got {self.mode!r}")
        if self.lag_s < 0 or self.num_ranks < 1 or self.num_prompts < 1:
            raise ValueError("--lag-s must be >= 0, --num-ranks and --num-prompts >= 1")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--input-len and --output-len must be >= 1")

    def start_offset(self, rank: int) -> float:
        """Seconds after the start at which copy ``rank`` is sent."""
        return rank * self.lag_s if self.mode == "lag" else 0.0


def request_set(config: ReplayConfig) -> list[GenerationRequest]:
    """The one request set every rank replays (the same text for every copy)."""
    rng = random.Random(config.seed)
    return [
        GenerationRequest(
            messages=({"role": "user", "content": make_text(rng, config.input_len)},),
            max_tokens=config.output_len,
            tag=f"p{i}",
        )
        for i in range(config.num_prompts)
    ]


def summarize_replay(
    config: ReplayConfig, timelines: list[list[RequestTimeline]], start: float
) -> dict[str, Any]:
    """Per-copy and total throughput (input + output tokens per second of wall time)."""
    flat = [t for copy in timelines for t in copy]
    done = [t for t in flat if t.success]
    end = max((t.end_time for t in flat), default=start)
    tokens = sum(t.prompt_tokens + t.completion_tokens for t in done)
    duration = max(end - start, 1e-9)
    per_copy = []
    for rank, copy in enumerate(timelines):
        ok = [t for t in copy if t.success]
        first = start + config.start_offset(rank)
        last = max((t.end_time for t in copy), default=first)
        per_copy.append(
            {
                "rank": rank,
                "completed": len(ok),
                "duration_s": last - first,
                "tokens": sum(t.prompt_tokens + t.completion_tokens for t in ok),
            }
        )
    return {
        "mode": config.mode,
        "lag_s": config.lag_s if config.mode == "lag" else 0.0,
        "num_ranks": config.num_ranks,
        "completed": len(done),
        "failed": len(flat) - len(done),
        "duration_s": duration,
        "total_tokens": tokens,
        "throughput_tok_s": tokens / duration,
        "copies": per_copy,
    }


async def _replay(config: ReplayConfig, endpoint: EndpointConfig) -> dict[str, Any]:
    requests = request_set(config)
    async with open_client(endpoint) as client:
        start = time.perf_counter()

        async def copy(rank: int) -> list[RequestTimeline]:
            await asyncio.sleep(config.start_offset(rank))
            headers = {"X-data-parallel-rank": str(rank)}
            return await asyncio.gather(*(client.generate(r, headers) for r in requests))

        timelines = await asyncio.gather(*(copy(r) for r in range(config.num_ranks)))
    return summarize_replay(config, list(timelines), start)


def run_replay(config: ReplayConfig, base_url: str, model: str | None = None) -> dict[str, Any]:
    endpoint = EndpointConfig(
        base_url=base_url, model=resolve_model(base_url, model), endpoint=config.endpoint
    )
    return asyncio.run(_replay(config, endpoint))


def format_replay(result: dict[str, Any]) -> str:
    lines = [
        f"replay {result['mode']} (lag {result['lag_s']:g} s) over {result['num_ranks']} copies: "
        f"{result['completed']} ok, {result['failed']} failed, "
        f"{result['throughput_tok_s']:.1f} tok/s in {result['duration_s']:.2f} s"
    ]
    for c in result["copies"]:
        lines.append(
            f"  copy {c['rank']}: {c['completed']} requests, {c['tokens']} tokens, "
            f"{c['duration_s']:.2f} s"
        )
    return "\n".join(lines)


def register_replay(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "replay", help="DP imbalance: one request set per rank, at once (mirror) or lagged"
    )
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name to send (default: the server's first)")
    p.add_argument("--mode", choices=MODES, default="mirror")
    p.add_argument("--lag-s", type=float, default=5.0, help="lag: copy r starts r x this")
    p.add_argument("--num-ranks", type=int, default=2, help="copies (the DP size)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="write the result as JSON here")
    p.set_defaults(func=_main)


def _main(args: Any) -> int:
    from rackserve.bench.report import write_json

    config = ReplayConfig(
        mode=args.mode,
        lag_s=args.lag_s,
        num_ranks=args.num_ranks,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=args.seed,
    )
    result = run_replay(config, args.base_url, args.model)
    print(format_replay(result))
    if args.output:
        print(f"wrote {write_json(result, args.output)}")
    return 0 if result["failed"] == 0 else 1
