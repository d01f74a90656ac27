"""``bench serve``: random prompts at a Poisson rate and/or a concurrency cap.

The result uses the field names and units of ``vllm bench serve`` (``request_throughput``,
``mean_ttft_ms``, ``p99_itl_ms``, ...), so result files of both tools compare side by side.
Prompts start with a unique request number, so they share no prefix (no cache hits).
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
from rackserve.bench.metrics import inter_token_latencies, serve_metrics
from rackserve.bench.workloads import TokenCounter, make_text
from rackserve.config import ConfigError


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
        text = f"{i} " + make_text(rng, max(1, num_input - 1), counter)
        message = {"role": "user", "content": text}
        requests.append(GenerationRequest((message,), num_output, tag=f"r{i}"))
    return requests


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
    result: dict[str, Any] = {
        "date": date,
        "backend": "openai-chat" if config.endpoint == "chat" else "openai",
        "model_id": model,
        "num_prompts": config.num_prompts,
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "random_input_len": config.input_len,
        "random_output_len": config.output_len,
        "random_range_ratio": config.range_ratio,
        **serve_metrics(timelines, duration, config.percentiles),
        "failure_examples": sorted({t.error for t in timelines if t.error})[:5],
    }
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
    timelines, duration = asyncio.run(run_serve_async(config, endpoint, counter))
    return serve_result(config, model, timelines, duration, date)
