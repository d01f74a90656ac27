"""Asynchronous scheduling (``--async-scheduling``): the host half of step N+1 (schedule,
input packing, block-table deltas, the upload) runs while the device runs step N.

The engine core keeps one step in flight::

    step() call k:   schedule N+1 -> launch N+1 -> collect N (wait for its tokens) -> update N

Schedule N+1 happens before N's tokens are known, so the scheduler is optimistic (as vLLM's
``AsyncScheduler``): every request that samples in a launched step holds one placeholder
(``Request.num_output_placeholders``) and counts it as a token, so it is scheduled again
for one more token whose input id the runner takes from step N's sampled ids on the device.
When N's tokens are read back, :func:`update_after_collect` applies them exactly as the
synchronous engine would, then drops the placeholders.

What differs from the synchronous engine, and why the outputs are still the same:

- a request that N's token finishes (stop token, stop string, length) has a wasted slot in
  N+1: its extra token is discarded (the request is gone when N+1 is collected) and never
  emitted; its blocks are freed at once (N+1's KV write lands in a block nobody keys);
- a request preempted (or aborted) while its token is in flight loses that token; a
  preempted one samples it again after its recompute (sampling noise is keyed by seed and
  position, runner/sampler.py, so it is the same token);
- requests whose next step needs the real token on the host are not scheduled optimistically
  (:func:`needs_host_token`): structured outputs (the grammar must advance first). They
  skip one step in two, as vLLM's requests with a grammar did before it split sampling from
  the forward. Penalties do not wait: the runner writes the in-flight token over its
  placeholder in the penalties' output ids on the device, as it does in the input ids;
- speculative decoding and data/expert parallelism are refused (:func:`check_supported`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rackserve.request import Request, RequestStatus

if TYPE_CHECKING:
    import torch

    from rackserve.config import EngineConfig
    from rackserve.engine.outputs import EngineCoreOutput, RunnerOutput, SchedulerOutput
    from rackserve.engine.scheduler import Scheduler


def unsupported_by(config: EngineConfig) -> str | None:
    """What in ``config`` async scheduling cannot run with yet, and why; or None."""
    if config.speculative is not None:
        return "speculative decoding (the drafts of step N+1 depend on step N's verified tokens)"
    parallel = config.parallel
    if parallel.data_parallel_size > 1 or parallel.enable_expert_parallel:
        return "data/expert parallelism (the DP ranks sync once per step)"
    return None


def is_async(config: EngineConfig, device: torch.device) -> bool:
    """Whether the engine on ``device`` schedules asynchronously: as asked, or (None) on a
    GPU wherever supported. On the CPU the forward runs inline in the launch, so nothing
    overlaps and each output would only come a step later (the CPU demo: TTFT p50 28 ->
    45 ms, 2026-12-06)."""
    asked = config.scheduler.async_scheduling
    if asked is not None:
        return asked
    return device.type == "cuda" and unsupported_by(config) is None


def check_supported(config: EngineConfig) -> None:
    """ValueError naming what an explicit ``--async-scheduling`` cannot be combined with."""
    reason = unsupported_by(config) if config.scheduler.async_scheduling else None
    if reason is not None:
        raise ValueError(f"--async-scheduling does not support {reason} yet: drop one of the two")


def past_last_token(req: Request, num_tokens: int, max_model_len: int) -> bool:
    """Whether a request whose tokens, with the in-flight ones, number ``num_tokens`` will
    have finished by length once they land: scheduling it again would waste a slot."""
    num_output = num_tokens - req.num_prompt_tokens
    return num_output >= req.sampling_params.max_tokens or num_tokens >= max_model_len


def needs_host_token(req: Request) -> bool:
    """Whether the request's next step needs its last token on the host before launch: a
    grammar advances on the host."""
    return req.sampling_params.structured_outputs is not None


def mark_placeholders(scheduler: Scheduler, sched: SchedulerOutput) -> list[Request]:
    """After ``schedule()``: every scheduled request whose step reaches its last token will
    sample one; it gets a placeholder (unless its next step needs the real token). Returns
    the requests marked, to be unmarked when the step is collected."""
    marked: list[Request] = []
    requests = scheduler.requests
    for req_id in sched.num_scheduled_tokens:
        req = requests[req_id]
        if req.num_computed_tokens < req.num_tokens + req.num_output_placeholders:
            continue  # a prefill chunk short of the prompt's end: samples nothing
        if needs_host_token(req):
            continue  # computed == num_tokens: not scheduled again before its token lands
        req.num_output_placeholders += 1
        marked.append(req)
    return marked


@dataclass
class InFlight:
    """A launched step: what was scheduled, the runner's handle, the requests marked."""

    sched: SchedulerOutput
    handle: Any  # runner.model_runner.StepHandle
    marked: list[Request] = field(default_factory=list)


def update_after_collect(
    scheduler: Scheduler, done: InFlight, result: RunnerOutput, later: InFlight | None
) -> list[EngineCoreOutput]:
    """``Scheduler.update`` for a collected step while a ``later`` one is in flight.

    The scheduler already advanced ``num_computed_tokens`` over the later step's tokens;
    the update (its KV commit) must see only what the collected step computed, so those
    tokens are taken off around it and given back to the requests still running."""
    taken: list[tuple[Request, int]] = []
    if later is not None:
        requests = scheduler.requests
        for req_id, n in later.sched.num_scheduled_tokens.items():
            req = requests.get(req_id)
            if req is not None and req.status == RequestStatus.RUNNING:
                req.num_computed_tokens -= n
                taken.append((req, n))
    try:
        outputs = scheduler.update(done.sched, result)
    finally:
        for req, n in taken:
            if req.status == RequestStatus.RUNNING:  # not finished by this update
                req.num_computed_tokens += n
        for req in done.marked:  # the token landed (or was dropped with its request)
            req.num_output_placeholders -= 1
    return outputs


# ---- the "device" a launched step runs on ------------------------------------------------------
class InlineDevice:
    """Runs a step's device work at once on the calling thread: on a GPU the work only
    enqueues kernels (the stream is the queue), on the CPU it is the synchronous device."""

    def submit(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn())
        except BaseException as e:  # raised again by the collect, on the engine's thread
            future.set_exception(e)
        return future

    def close(self) -> None:
        pass


class DelayedDevice:
    """A fake slow device for the CPU tests of asynchronous scheduling: one worker thread
    runs launched steps in order (like a stream), each taking at least ``delay_s``, off the
    engine's thread."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fake-device")

    def submit(self, fn: Callable[[], Any]) -> Future:
        def run() -> Any:
            start = time.perf_counter()
            result = fn()
            rest = self.delay_s - (time.perf_counter() - start)
            if rest > 0:
                time.sleep(rest)
            return result

        return self._worker.submit(run)

    def close(self) -> None:
        self._worker.shutdown(wait=True)
