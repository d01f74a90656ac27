"""``bench agentic``: closed-loop replay of synthetic coding-agent sessions.

At concurrency C, C workers each run one top-level session after another; a session sends
its turns in order (waiting for each reply and the think time between turns) and, where it
forks, runs its sub-agents in parallel before continuing. So C counts concurrent agent
users; sub-agent fan-out briefly puts more than C requests in flight (reported as
``mean_in_flight``). Each level runs ``warmup_s`` and then a ``duration_s`` window; only
requests that end inside the window are measured, and in-flight ones are cancelled at its
end. Every level draws fresh sessions (new users), so no level replays another's prompts.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from rackserve.bench.client import (
    EndpointConfig,
    GenerationRequest,
    RequestTimeline,
    StreamingClient,
    open_client,
    resolve_endpoint,
)
from rackserve.bench.metrics import agentic_metrics, ended_in_window, prefix_hits, trace_stats
from rackserve.bench.workloads import (
    AgenticConfig,
    Session,
    TokenCounter,
    generate_session,
    plan_requests,
)
from rackserve.config import ConfigError

RESULT_VERSION = 1
FAILURE_BACKOFF_S = 0.1


@dataclass(frozen=True)
class AgenticRunConfig:
    """How to drive the server: the concurrency sweep, timing, and request options."""

    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    warmup_s: float = 10.0
    duration_s: float = 60.0
    num_gpus: int = 1
    endpoint: str = "chat"
    fixed_output: bool = True
    request_timeout_s: float = 600.0
    trace_sessions: int = 64  # sessions planned to compute the theoretical hit rate
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ConfigError("concurrency must be a non-empty list of integers >= 1")
        if self.warmup_s < 0 or self.duration_s <= 0:
            raise ConfigError("warmup_s must be >= 0 and duration_s > 0")
        if self.num_gpus < 1 or self.trace_sessions < 1:
            raise ConfigError("num_gpus and trace_sessions must be >= 1")


Record = Callable[[RequestTimeline], None]


def first_messages(session: Session) -> list[dict[str, str]]:
    """System prompt, then the user's context and first task in one user message."""
    return [
        {"role": "system", "content": session.system_prompt},
        {"role": "user", "content": f"{session.user_context}\n\n{session.turns[0].content}"},
    ]


async def run_session(
    client: StreamingClient,
    session: Session,
    record: Record,
    parent_messages: Sequence[Mapping[str, str]] = (),
) -> str | None:
    """Play one session like an agent; returns its final reply, or None if a request failed.

    The message layout matches :func:`rackserve.bench.workloads.plan_requests`.
    """
    messages: list[Mapping[str, str]] = list(parent_messages)
    subagent_results: list[str] = []
    reply = ""
    for k, turn in enumerate(session.turns):
        if turn.think_time_s:
            await asyncio.sleep(turn.think_time_s)
        if k == 0 and session.parent_id is None:
            messages += first_messages(session)
        else:
            content = "\n\n".join([*subagent_results, turn.content])
            messages.append({"role": "user", "content": content})
        request = GenerationRequest(
            tuple(messages), turn.output_tokens, f"{session.session_id}.t{k}"
        )
        timeline = await client.generate(request)
        record(timeline)
        if not timeline.success:
            return None
        reply = timeline.text
        messages.append({"role": "assistant", "content": reply})
        subagent_results = []
        if turn.subagents:
            results = await asyncio.gather(
                *(run_session(client, sub, record, messages) for sub in turn.subagents)
            )
            if any(result is None for result in results):
                return None
            subagent_results = [r for r in results if r is not None]
    return reply


@dataclass(frozen=True)
class LevelRun:
    """Raw outcome of one concurrency level."""

    concurrency: int
    timelines: tuple[RequestTimeline, ...]
    window_start: float
    window_end: float
    num_sessions_started: int
    next_session: int


async def run_level(
    client: StreamingClient,
    workload: AgenticConfig,
    concurrency: int,
    run: AgenticRunConfig,
    first_session: int,
    counter: TokenCounter | None = None,
) -> LevelRun:
    """Closed loop at ``concurrency`` for ``warmup_s + duration_s`` seconds."""
    timelines: list[RequestTimeline] = []
    indices = itertools.count(first_session)
    started = [0]

    async def worker() -> None:
        while True:
            session = generate_session(workload, next(indices), counter)
            started[0] += 1
            if await run_session(client, session, timelines.append) is None:
                # A failing server answers at once; pausing keeps the loop from spinning.
                await asyncio.sleep(FAILURE_BACKOFF_S)

    start = time.perf_counter()
    window_start = start + run.warmup_s
    window_end = window_start + run.duration_s
    workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
    progress = _progress_bar(run, concurrency)
    try:
        while (now := time.perf_counter()) < window_end:
            await asyncio.sleep(min(0.25, window_end - now))
            if progress is not None:
                progress.n = round(min(now, window_end) - start, 1)
                failed = sum(not t.success for t in timelines)
                progress.set_postfix(requests=len(timelines), failed=failed, refresh=True)
            for task in workers:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # a bug in a worker, not a failed request
    finally:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        if progress is not None:
            progress.close()
    return LevelRun(
        concurrency, tuple(timelines), window_start, window_end, started[0], next(indices)
    )


def _progress_bar(run: AgenticRunConfig, concurrency: int) -> Any:
    if not run.progress:
        return None
    from tqdm import tqdm

    total = round(run.warmup_s + run.duration_s, 1)
    return tqdm(total=total, desc=f"concurrency {concurrency}", unit="s", leave=False)


def level_result(
    level: LevelRun,
    num_gpus: int,
    workload: AgenticConfig | None = None,
    first_session: int = 0,
    counter: TokenCounter | None = None,
) -> dict[str, Any]:
    """The JSON entry of one concurrency level. With ``workload``: also the theoretical
    hit rate of the very requests measured (the trace's rate weighs every turn of whole
    sessions; a short window holds more early turns, whose rate is lower)."""
    result = {
        "concurrency": level.concurrency,
        "num_sessions_started": level.num_sessions_started,
        **agentic_metrics(level.timelines, level.window_start, level.window_end, num_gpus),
    }
    if workload is not None:
        measured = [
            t.tag
            for t in ended_in_window(level.timelines, level.window_start, level.window_end)
            if t.success
        ]
        sessions = range(first_session, level.next_session)
        result["theoretical_prefix_hit_rate_measured"] = measured_requests_hit_rate(
            workload, sessions, measured, counter
        )
    return result


def measured_requests_hit_rate(
    workload: AgenticConfig,
    sessions: range,
    tags: Sequence[str],
    counter: TokenCounter | None = None,
) -> float | None:
    """Infinite-cache hit rate of the requests ``tags`` (``session_id.tK``) of ``sessions``,
    in planned tokens; None when none of them is known."""
    requests = [r for i in sessions for r in plan_requests(generate_session(workload, i, counter))]
    by_tag = {
        f"{r.session_id}.t{r.turn}": (hit, sum(n for _, n in r.prompt))
        for r, hit in zip(requests, prefix_hits(requests), strict=True)
    }
    known = [by_tag[tag] for tag in tags if tag in by_tag]
    total = sum(n for _, n in known)
    return sum(hit for hit, _ in known) / total if total else None


async def run_agentic_async(
    workload: AgenticConfig,
    endpoint: EndpointConfig,
    run: AgenticRunConfig,
    counter: TokenCounter | None = None,
    first_session: int = 0,
) -> list[dict[str, Any]]:
    """All concurrency levels, one after another, each with fresh sessions (numbered from
    ``first_session``: runs against the same engines use disjoint ranges)."""
    levels = []
    next_session = first_session
    async with open_client(endpoint, counter) as client:
        for concurrency in run.concurrency:
            before = await server_hits_by_tier(endpoint.base_url)
            first = next_session
            level = await run_level(client, workload, concurrency, run, first, counter)
            next_session = level.next_session
            levels.append(level_result(level, run.num_gpus, workload, first, counter))
            after = await server_hits_by_tier(endpoint.base_url)
            if before is not None and after:
                # the whole level (warmup included), as the server counts it
                levels[-1]["server_prefix_hits_by_tier"] = {
                    tier: after[tier] - before.get(tier, 0) for tier in after
                }
    return levels


async def server_hits_by_tier(base_url: str, timeout_s: float = 10.0) -> dict[str, int] | None:
    """The server's cumulative prefix-cache hit tokens per tier (device, host KV pool) from
    its Prometheus ``prefix_cache_hits_by_tier`` series ({} before any was counted); None
    when /metrics cannot be read."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
            session.get(f"{root}/metrics") as response,
        ):
            if response.status != 200:
                return None
            text = await response.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    tiers = {}
    for family in text_string_to_metric_families(text):
        if family.name.endswith("prefix_cache_hits_by_tier"):
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    tiers[sample.labels["tier"]] = int(sample.value)
    return tiers


def run_agentic(
    workload: AgenticConfig,
    base_url: str,
    run: AgenticRunConfig = AgenticRunConfig(),
    *,
    model: str | None = None,
    counter: TokenCounter | None = None,
    first_session: int = 0,
) -> dict[str, Any]:
    """Run the agentic benchmark against ``base_url`` and return the JSON-ready result.

    Blocking; call from synchronous code (the CLI, the demo). The result layout is
    documented in docs/bench.md.
    """
    endpoint = resolve_endpoint(
        base_url, model, run.endpoint, run.fixed_output, run.request_timeout_s
    )
    model = endpoint.model
    date = datetime.now(UTC).isoformat(timespec="seconds")
    levels = asyncio.run(run_agentic_async(workload, endpoint, run, counter, first_session))
    return {
        "benchmark": "agentic",
        "version": RESULT_VERSION,
        "date": date,
        "base_url": base_url,
        "model": model,
        "endpoint": run.endpoint,
        "fixed_output": run.fixed_output,
        "num_gpus": run.num_gpus,
        "warmup_s": run.warmup_s,
        "duration_s": run.duration_s,
        "workload": asdict(workload),
        "trace": trace_stats(workload, run.trace_sessions, counter=counter),
        "levels": levels,
    }
