"""``bench serve``: random prompts at a Poisson rate and/or a concurrency cap.

The result uses the field names and units of ``vllm bench serve`` (``request_throughput``,
``mean_ttft_ms``, ``p99_itl_ms``, ``request_goodput``, ...), so result files of both tools
compare side by side. Prompts start with a unique request number, so they share no prefix
(no cache hits); with a tokenizer they have exactly the requested number of tokens.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rackserve.bench.client import (
    ENDPOINTS,
    EndpointConfig,
    GenerationRequest,
    RequestTimeline,
    open_client,
    resolve_endpoint,
)
from rackserve.bench.metrics import inter_token_latencies, serve_metrics, time_per_output_token
from rackserve.bench.workloads import VOCABULARY, TokenCounter, make_text
from rackserve.config import ConfigError
from rackserve.spec_decode.stats import SpecDecodingStats, from_prometheus

SERIES = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class ServeConfig:
    """Random-length requests (vLLM's "random" dataset) and how fast to send them.

    ``range_ratio`` r draws lengths uniformly from ``[len * (1 - r), len * (1 + r)]``; 0 gives
    fixed lengths. ``request_rate`` is Poisson arrivals per second (``inf``: all at once);
    ``burstiness`` is the gamma shape of inter-arrival times (1 = Poisson, < 1 burstier).
    """

    num_prompts: int = 1000
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    endpoint: str = "chat"
    fixed_output: bool = True
    request_timeout_s: float = 600.0
    percentiles: tuple[float, ...] = (99,)
    save_detailed: bool = False
    progress: bool = True
    # vllm bench serve's flags (issue 15)
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
    goodput: tuple[tuple[str, float], ...] = ()  # (metric, SLO in ms): ttft, tpot, e2el
    num_warmups: int = 0
    label: str | None = None
    tokenizer_id: str | None = None

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ConfigError("num_prompts, input_len and output_len must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ConfigError("range_ratio must be in [0, 1)")
        if self.request_rate <= 0 or self.burstiness <= 0:
            raise ConfigError("request_rate and burstiness must be > 0 (inf for no pacing)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ConfigError("max_concurrency must be >= 1 (leave it unset for no cap)")
        if self.endpoint not in ENDPOINTS:
            raise ConfigError(f"endpoint must be one of {ENDPOINTS}")
        if any(not 0 < p < 100 for p in self.percentiles):
            raise ConfigError("percentiles must be in (0, 100)")
        if not set(self.percentile_metrics) <= set(SERIES):
            raise ConfigError(f"percentile metrics must be among {', '.join(SERIES)}")
        for name, slo in self.goodput:
            if name not in GOODPUT_METRICS or slo <= 0:
                raise ConfigError(
                    f"goodput takes {'/'.join(GOODPUT_METRICS)}:MS with MS > 0, got {name}:{slo}"
                )
        if self.num_warmups < 0:
            raise ConfigError("num_warmups must be >= 0")


def random_requests(
    config: ServeConfig, counter: TokenCounter | None = None
) -> list[GenerationRequest]:
    """``num_prompts`` seeded single-message requests with random lengths."""
    rng = random.Random(f"{config.seed}:serve")

    def length(value: int) -> int:
        low = max(1, math.floor(value * (1 - config.range_ratio)))
        return rng.randint(low, max(low, math.ceil(value * (1 + config.range_ratio))))

    requests = []
    for i in range(config.num_prompts):
        num_input, num_output = length(config.input_len), length(config.output_len)
        # The request number leads so prompts diverge at once (no shared prefix).
        text = exact_text(rng, num_input, str(i), counter)
        message = {"role": "user", "content": text}
        requests.append(GenerationRequest((message,), num_output, tag=f"r{i}"))
    return requests


def exact_text(rng: random.Random, num_tokens: int, head: str, counter: TokenCounter | None) -> str:
    """``head`` then seeded words, exactly ``num_tokens`` tokens by ``counter`` (one word is
    one token without a counter) when ``num_tokens`` >= the head's own count. Words are
    added or dropped one at a time at the end until the count matches; a word that
    overshoots is swapped for a short one."""
    if counter is None:
        return " ".join([head, *make_text(rng, max(1, num_tokens - 1), None).split()])
    words = make_text(rng, max(1, num_tokens - counter.count(head)), counter).split()
    for _ in range(4 * num_tokens + 64):
        error = counter.count(" ".join([head, *words])) - num_tokens
        if error == 0:
            break
        if error > 0 and words:
            words.pop()
        elif error < 0:
            words.append(rng.choice(VOCABULARY) if error < -1 else rng.choice(["a", "I", "."]))
        else:
            break  # the head alone is longer than asked
    return " ".join([head, *words])


def goodput_ok(timeline: RequestTimeline, slos: Sequence[tuple[str, float]]) -> bool:
    """Whether a finished request met every SLO (ms), as ``vllm bench serve --goodput``."""
    values = {
        "ttft": timeline.ttft,
        "tpot": time_per_output_token(timeline) or 0.0,
        "e2el": timeline.e2el,
    }
    return all(values[name] * 1e3 <= slo for name, slo in slos)


def max_output_tokens_per_s(timelines: Sequence[RequestTimeline]) -> float:
    """The most output tokens that arrived in any one-second window (from the first send);
    a chunk's tokens are spread evenly over the request's chunks."""
    done = [t for t in timelines if t.success]
    if not done:
        return 0.0
    start = min(t.send_time for t in done)
    per_second: dict[int, float] = {}
    for t in done:
        share = t.completion_tokens / len(t.chunk_times)
        for when in t.chunk_times:
            second = int(when - start)
            per_second[second] = per_second.get(second, 0.0) + share
    return max(per_second.values())


def max_concurrent_requests(timelines: Sequence[RequestTimeline]) -> int:
    """The most requests in flight at once (send to end)."""
    events = sorted(
        [(t.send_time, 1) for t in timelines] + [(t.end_time, -1) for t in timelines],
        key=lambda e: (e[0], e[1]),  # an end before a start at the same instant
    )
    peak = current = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


def arrival_offsets(config: ServeConfig) -> list[float]:
    """Send time of every request (s after start); gamma gaps of mean ``1 / request_rate``."""
    if math.isinf(config.request_rate):
        return [0.0] * config.num_prompts
    rng = random.Random(f"{config.seed}:arrivals")
    scale = 1.0 / (config.request_rate * config.burstiness)
    offsets, now = [], 0.0
    for _ in range(config.num_prompts):
        offsets.append(now)
        now += rng.gammavariate(config.burstiness, scale)
    return offsets


async def run_serve_async(
    config: ServeConfig, endpoint: EndpointConfig, counter: TokenCounter | None = None
) -> tuple[list[RequestTimeline], float]:
    """Send every request at its arrival time (and under the cap); returns timelines, duration."""
    requests = random_requests(config, counter)
    offsets = arrival_offsets(config)
    cap = asyncio.Semaphore(config.max_concurrency or config.num_prompts)
    progress = None
    if config.progress:
        from tqdm import tqdm

        progress = tqdm(total=config.num_prompts, desc="requests", leave=False)

    async with open_client(endpoint, counter) as client:
        for request in requests[: config.num_warmups]:  # not timed, as vllm's --num-warmups
            await client.generate(request)

        async def send(request: GenerationRequest) -> RequestTimeline:
            async with cap:
                timeline = await client.generate(request)
            if progress is not None:
                progress.update(1)
            return timeline

        start = time.perf_counter()
        tasks = []
        for request, offset in zip(requests, offsets, strict=True):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(request)))
        timelines = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    if progress is not None:
        progress.close()
    return list(timelines), duration


def serve_result(
    config: ServeConfig,
    model: str,
    timelines: Sequence[RequestTimeline],
    duration: float,
    date: str,
) -> dict[str, Any]:
    """The result in ``vllm bench serve`` layout, plus a few rackserve fields."""
    backend = "openai-chat" if config.endpoint == "chat" else "openai"
    done = [t for t in timelines if t.success]
    result: dict[str, Any] = {
        "date": date,
        "endpoint_type": backend,
        "backend": backend,
        "label": config.label,
        "model_id": model,
        "tokenizer_id": config.tokenizer_id or model,
        "num_prompts": config.num_prompts,
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "random_input_len": config.input_len,
        "random_output_len": config.output_len,
        "random_range_ratio": config.range_ratio,
        **serve_metrics(timelines, duration, config.percentiles),
        "max_output_tokens_per_s": max_output_tokens_per_s(timelines),
        "max_concurrent_requests": max_concurrent_requests(timelines),
        "failure_examples": sorted({t.error for t in timelines if t.error})[:5],
    }
    if config.goodput:
        good = sum(goodput_ok(t, config.goodput) for t in done)
        result["request_goodput"] = good / duration if duration > 0 else 0.0
    # percentiles only for the metrics asked (vllm's --percentile-metrics)
    for name in set(SERIES) - set(config.percentile_metrics):
        for key in [k for k in result if k.startswith("p") and k.endswith(f"_{name}_ms")]:
            del result[key]
    if config.save_detailed:
        result |= {
            "input_lens": [t.prompt_tokens for t in timelines],
            "output_lens": [t.completion_tokens for t in timelines],
            "ttfts": [t.ttft if t.chunk_times else 0.0 for t in timelines],
            "itls": [inter_token_latencies(t) for t in timelines],
            "generated_texts": [t.text for t in timelines],
            "errors": [t.error or "" for t in timelines],
        }
    return result


def run_serve(
    config: ServeConfig,
    base_url: str,
    *,
    model: str | None = None,
    counter: TokenCounter | None = None,
) -> dict[str, Any]:
    """Run ``bench serve`` against ``base_url`` (blocking) and return the result."""
    endpoint = resolve_endpoint(
        base_url, model, config.endpoint, config.fixed_output, config.request_timeout_s
    )
    model = endpoint.model
    date = datetime.now(UTC).isoformat(timespec="seconds")
    spec_before = scrape_spec_decoding(base_url)
    timelines, duration = asyncio.run(run_serve_async(config, endpoint, counter))
    result = serve_result(config, model, timelines, duration, date)
    spec_after = scrape_spec_decoding(base_url)
    if spec_after is not None:  # the server speculates: acceptance over this run
        result |= spec_after.minus(spec_before or SpecDecodingStats()).report()
    return result


def scrape_spec_decoding(base_url: str) -> SpecDecodingStats | None:
    """The server's speculative-decoding counters from /metrics (None: none, or no page)."""
    import httpx

    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        response = httpx.get(f"{root}/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    return from_prometheus(response.text) if response.status_code == 200 else None
