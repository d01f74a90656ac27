"""``StepTimer`` on a GPU times a step by CUDA events; these fake events hold CUDA's rule
(``elapsed_time`` of an event not yet completed raises) without a GPU."""

from __future__ import annotations

import torch

from rackserve.runner import step_handle
from rackserve.runner.step_handle import StepTimer


class FakeEvent:
    """Completes only when synchronized, as an event still queued behind kernels would."""

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.recorded = self.done = False
        self.at_ms = 0.0

    def record(self) -> None:
        self.recorded = True
        self.at_ms = 12.5 if FakeEvent.started else 0.0
        FakeEvent.started = True

    def synchronize(self) -> None:
        assert self.recorded
        self.done = True

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.recorded and end.done):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return end.at_ms - self.at_ms

    started = False


def test_a_step_that_sampled_nothing_still_times(monkeypatch) -> None:
    """A prefill-chunk step samples nothing, so its collect never waits on the timer's end
    event: asking for its time must wait for it, not raise (on the GPU that RuntimeError
    killed the engine core at the first prompt longer than the step's token budget)."""
    monkeypatch.setattr(step_handle.torch.cuda, "Event", FakeEvent)
    FakeEvent.started = False
    timer = StepTimer(torch.device("cuda")).stop()  # no wait_for: nothing was sampled
    assert timer.elapsed_s() == 12.5e-3
    FakeEvent.started = False
    sampled = StepTimer(torch.device("cuda")).stop()
    host = torch.zeros(3)
    assert sampled.wait_for(host) is host and sampled.elapsed_s() == 12.5e-3
