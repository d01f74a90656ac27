"""Where an engine step leaves the device idle: the kernels of profiled steps, step by step.

``bench decode --profile`` records each engine step under ``torch.profiler`` and hands the
steps' host intervals and the device kernels to :func:`step_timelines`. A kernel belongs to
the step during whose host interval it started (the engine is synchronous, or with async
scheduling one step ahead: either way a kernel starts after its launch). For each step:
the wall time of its host interval, the kernel time (the union of the kernels' intervals:
side streams overlap), the idle rest, and the largest idle gaps with the kernels on either
side: a gap after a kernel that ends a phase (the verify forward, the proposal) and before
the next one's first kernel is the host's work between them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Kernel:
    start_us: float
    end_us: float
    name: str


@dataclass(frozen=True)
class Gap:
    us: float
    after: str  # the kernel that ended last before it ("" at the step's start)
    before: str  # the kernel that starts it ("" at the step's end)


@dataclass(frozen=True)
class StepTimeline:
    wall_us: float
    busy_us: float
    kernels: int
    gaps: tuple[Gap, ...]  # the largest first

    @property
    def idle_us(self) -> float:
        return self.wall_us - self.busy_us


def step_timelines(
    steps: Sequence[tuple[float, float]], kernels: Iterable[Kernel], top: int = 4
) -> list[StepTimeline]:
    """steps: the host interval (start, end) of each step, in order, in the kernels' clock
    (microseconds). A step's window runs from its start to the next step's start (the last
    one's to the end of its interval or of its last kernel)."""
    ordered = sorted(kernels, key=lambda k: k.start_us)
    out = []
    for i, (start, end) in enumerate(steps):
        stop = steps[i + 1][0] if i + 1 < len(steps) else None
        mine = [k for k in ordered if k.start_us >= start and (stop is None or k.start_us < stop)]
        window_end = stop if stop is not None else max([end] + [k.end_us for k in mine])
        busy, gaps, reached, last = 0.0, [], start, ""
        for k in mine:
            if k.start_us > reached:
                gaps.append(Gap(k.start_us - reached, last, k.name))
            if k.end_us > reached:
                busy += k.end_us - max(k.start_us, reached)
                reached, last = k.end_us, k.name
        if window_end > reached:
            gaps.append(Gap(window_end - reached, last, ""))
        gaps.sort(key=lambda g: -g.us)
        out.append(StepTimeline(window_end - start, busy, len(mine), tuple(gaps[:top])))
    return out


def format_timelines(timelines: Sequence[StepTimeline], width: int = 60) -> str:
    """One block a step: wall, kernel time, idle, and the largest idle gaps."""
    lines = []
    for i, t in enumerate(timelines):
        share = t.busy_us / t.wall_us if t.wall_us > 0 else 0.0
        lines.append(
            f"step {i + 1}: wall {t.wall_us / 1e3:.3f} ms, kernels {t.busy_us / 1e3:.3f} ms "
            f"({share:.0%}, {t.kernels} kernels), idle {t.idle_us / 1e3:.3f} ms"
        )
        for g in t.gaps:
            after = g.after[:width] or "(step start)"
            before = g.before[:width] or "(step end)"
            lines.append(f"  idle {g.us:9.1f} us  after {after}  before {before}")
    return "\n".join(lines) + "\n"
