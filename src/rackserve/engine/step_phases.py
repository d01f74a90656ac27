"""Named host phases of an engine step, as torch.profiler ranges while a profile records
them (``bench decode --profile``, which sums them per step: ``bench/kernel_timeline.py``);
otherwise :func:`phase` is a no-op context (no profiler call on the engine's hot path).

    schedule   the scheduler's plan of the step
    prepare    the runner's host inputs: deltas, inputs, sampling tensors (their uploads)
    enqueue    the step's device work enqueued (graph replays, eager kernels; the CPU: run)
    wait       until the step's sampled ids are on the host (the forward, synchronous)
    emit       sampled ids (accepted drafts) into the requests
    propose    the next step's drafts: the proposal's inputs, its device work, the read-back
    update     the scheduler's bookkeeping of the step's outputs
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

PREFIX = "rackserve.phase."
_recording = False


def record(on: bool) -> None:
    """Turn the ranges on (a profile starts) or off (it ended)."""
    global _recording
    _recording = on


def phase(name: str) -> AbstractContextManager:
    """``with phase("schedule"): ...``: a profiler range named ``PREFIX + name`` while
    recording."""
    if _recording:
        return torch.profiler.record_function(PREFIX + name)
    return nullcontext()


def phased(name: str) -> Callable[[Callable], Callable]:
    """A method or function whose every call is the phase ``name``."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with phase(name):
                return fn(*args, **kwargs)

        return inner

    return wrap
