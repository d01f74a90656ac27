"""A launched step (``ModelRunner.launch`` -> ``collect``): its handle, its device
results, the timer around its device work, and the feed of the previous step's sampled ids
into its input ids (async scheduling, engine/async_scheduling.py).

On a GPU the device work only enqueues kernels: the sampled ids are copied into pinned host
memory behind an event, and the collect waits on that event (never on the whole device, so
the host work of the next step can be enqueued meanwhile).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from rackserve.device import PinnedStaging
from rackserve.runner.sampler import LogprobsTensors, SamplerOutput
from rackserve.runner.step_buffers import Feed

if TYPE_CHECKING:
    from rackserve.engine.outputs import TokenLogprobs
    from rackserve.runner.input_batch import PreparedStep


class StepTimer:
    """How long a step's device work took: CUDA events on a GPU (the device time, also
    when the stream was still busy with the previous step), wall time on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.start = self.end = None
        self.start_s = time.perf_counter()
        self.seconds = 0.0
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.start.record()

    def stop(self) -> StepTimer:
        if self.cuda:
            assert self.end is not None
            self.end.record()  # after the copy of the sampled ids: the collect waits on it
        else:
            self.seconds = time.perf_counter() - self.start_s
        return self

    def wait_for(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` (the sampled ids' host copy) once the copy has landed."""
        if self.cuda:
            assert self.end is not None
            self.end.synchronize()
        return host

    def elapsed_s(self) -> float:
        if self.cuda:
            assert self.start is not None and self.end is not None
            # a step that sampled nothing (prefill chunks only) was never waited on
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1e3
        return self.seconds


@dataclass
class DeviceStep:
    """What a step's device work produced."""

    out: SamplerOutput | None  # None: nothing sampled (prefill chunks only); on the host
    host_token_ids: torch.Tensor | None  # [S'] sampled ids on the host (pinned on a GPU)
    # [S'] the same on the device, for the next step's feed; after sampling in the decode
    # graphs a view of their static output, which the next step's run reads (feed) before
    # its replay overwrites it
    device_token_ids: torch.Tensor | None
    num_rows: list[int]  # logits rows per sampled request (1, or 1 + drafts)
    prompt_logprobs: dict[str, list[TokenLogprobs | None]]
    expert_counts: torch.Tensor  # [L, E]
    streams: torch.Tensor | None  # [T, N, D] final streams (eager steps; the drafter)
    timer: StepTimer
    # [R, K] the next drafts, proposed on the device behind a uniform verify step (greedy;
    # None: the collect proposes): on the device (fed into the next step's input ids), and
    # their host copy once ``proposal`` (the timer around that work) has stopped
    device_drafts: torch.Tensor | None = None
    host_drafts: torch.Tensor | None = None
    proposal: StepTimer | None = None

    drafts_list: list[list[int]] | None = None  # host_drafts as lists, once read

    def drafts_on_host(self, row: int, num: int) -> list[int]:
        """The first ``num`` drafts of request ``row``, from the host copy (landed already
        where the runner reads them: behind a later step's ids), read once for all rows."""
        if self.drafts_list is None:
            assert self.host_drafts is not None and self.proposal is not None
            self.drafts_list = self.proposal.wait_for(self.host_drafts).tolist()
        return self.drafts_list[row][:num]


@dataclass
class StepHandle:
    """A launched step. ``future`` resolves to its DeviceStep (at once, but for a fake
    delayed device); ``sample_index``: request id -> its row in the sampled ids."""

    step: PreparedStep | None  # None: an empty step
    future: Future | None
    sample_index: dict[str, int] = field(default_factory=dict)


def to_host(token_ids: torch.Tensor) -> torch.Tensor:
    """[S'] sampled ids -> a host copy, without waiting on a GPU (pinned, non-blocking).
    Always a copy: the ids may live in a decode graph's static output, which the next step
    overwrites before this one is collected (async scheduling)."""
    if token_ids.device.type != "cuda":
        return token_ids.clone()
    host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
    host.copy_(token_ids, non_blocking=True)
    return host


def output_to_host(out: SamplerOutput) -> SamplerOutput:
    """The sampler's output with its logprobs copied to the host behind the same event as
    the ids (read later without a sync that would wait for the next step's forward)."""
    lp = out.logprobs
    if lp is None or lp.logprobs.device.type != "cuda":
        return out
    host = LogprobsTensors(to_host(lp.token_ids), to_host(lp.logprobs), to_host(lp.ranks))
    return SamplerOutput(out.token_ids, host)


def feeder(
    source: Callable[[], torch.Tensor],
    index: np.ndarray,
    rows: np.ndarray,
    staging: PinnedStaging,
) -> Feed:
    """Writes ids an earlier step left on the device (``source()``: flat, read when the feed
    runs; rows ``rows`` [F] of it) into a step's uploaded input ids at flat ``index`` [F],
    on the device: no host round-trip. The earlier step ran first on the same device, so
    its ids are there. ``staging``: the pinned buffers the index pairs go up through (one
    copy that does not sync the stream: a pageable copy could wait for step N)."""

    def feed(input_ids: torch.Tensor) -> None:
        tokens = source()
        at, src = staging.upload([index, rows])  # where, from which row
        input_ids[at] = tokens[src].to(input_ids.dtype)

    return feed


def sampled_ids(prev: Future | None) -> Callable[[], torch.Tensor]:
    """A :func:`feeder` source: the sampled ids [S'] of the step behind ``prev``."""
    assert prev is not None

    def ids() -> torch.Tensor:
        result = prev.result()
        assert result.device_token_ids is not None, "a placeholder's step sampled nothing"
        return result.device_token_ids

    return ids
