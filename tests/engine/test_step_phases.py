"""A step's host phases (``engine/step_phases.py``): profiler ranges only while recording."""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import ProfilerActivity, profile

from rackserve.engine import step_phases
from rackserve.engine.step_phases import PREFIX, phase, phased


def test_phase_is_a_noop_unless_a_profile_records():
    assert isinstance(phase("schedule"), contextlib.nullcontext)

    @phased("launch")
    def launch(x: int) -> int:
        """Its docstring stays."""
        return x + 1

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with phase("off"):
            torch.ones(2).sum()
        step_phases.record(True)
        try:
            with phase("schedule"):
                torch.ones(2).sum()
            assert launch(1) == 2
        finally:
            step_phases.record(False)
    names = {e.name for e in prof.events()}
    assert PREFIX + "schedule" in names and PREFIX + "off" not in names
    assert PREFIX + "launch" in names and launch.__doc__ == "Its docstring stays."
    assert isinstance(phase("schedule"), contextlib.nullcontext)
