"""Where an engine step leaves the device idle: the kernels of profiled steps, step by step.

``bench decode --profile`` records each engine step under ``torch.profiler`` and hands the
steps' host intervals and the device kernels to :func:`step_timelines`. A step's window runs
from its start to the next step's start. For each window: its wall time, the time some
kernel ran in it (the union of the kernels' intervals, clipped to the window: side streams
overlap, and with async scheduling a forward runs on into the next step's window), the idle
rest, and the largest idle gaps with the kernels on either side: in a synchronous step a gap
after the kernel that ends a phase (the verify forward, the proposal) and before the next
phase's first kernel is the host's work between them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """A kernel's or a host phase's interval on the profiler's clock (microseconds)."""

    start_us: float
    end_us: float
    name: str


@dataclass(frozen=True)
class Gap:
    us: float
    after: str  # the kernel that ended last before it ("" if none did)
    before: str  # the kernel that ends it ("" at the last step's end)
    start_us: float = 0.0


@dataclass(frozen=True)
class StepTimeline:
    wall_us: float
    busy_us: float
    kernels: int  # started in the window
    gaps: tuple[Gap, ...]  # the largest first
    host: tuple[tuple[str, float], ...] = ()  # (phase, us) in order: ``engine/step_phases.py``
    # the idle time under each host phase, in order (BETWEEN: under none of them)
    idle_in: tuple[tuple[str, float], ...] = ()

    @property
    def idle_us(self) -> float:
        return self.wall_us - self.busy_us


def step_timelines(
    steps: Sequence[tuple[float, float]],
    kernels: Iterable[Span],
    top: int = 4,
    phases: Iterable[Span] = (),
) -> list[StepTimeline]:
    """steps: the host interval (start, end) of each step, in order, in the kernels' clock
    (microseconds). The last window ends at the end of its interval or of the last kernel
    that started in it, whichever is later. phases: the steps' named host ranges, summed
    per name in each window they start in."""
    ordered = sorted(kernels, key=lambda k: k.start_us)
    ranges = sorted(phases, key=lambda p: p.start_us)
    out = []
    for i, (start, end) in enumerate(steps):
        if i + 1 < len(steps):
            stop = steps[i + 1][0]
        else:
            stop = max([end] + [k.end_us for k in ordered if k.start_us >= start])
        before = [k for k in ordered if k.end_us <= start]
        last = max(before, key=lambda k: k.end_us).name if before else ""
        busy, gaps, reached, started = 0.0, [], start, 0
        for k in ordered:
            if k.end_us <= start:
                continue
            if k.start_us >= stop:
                break
            started += k.start_us >= start
            if k.start_us > reached:
                gaps.append(Gap(k.start_us - reached, last, k.name, reached))
            if k.end_us > reached:
                busy += min(k.end_us, stop) - max(k.start_us, reached)
                reached, last = min(k.end_us, stop), k.name
        if stop > reached:
            following = next((k.name for k in ordered if k.start_us >= stop), "")
            following = following if i + 1 < len(steps) else ""
            gaps.append(Gap(stop - reached, last, following, reached))
        gaps.sort(key=lambda g: -g.us)
        window = [p for p in ranges if start <= p.start_us < stop]
        host: dict[str, float] = {}
        for p in window:
            host[p.name] = host.get(p.name, 0.0) + p.end_us - p.start_us
        idle_in = _idle_in(gaps, window) if window else {}
        out.append(
            StepTimeline(
                stop - start, busy, started, tuple(gaps[:top]), tuple(host.items()),
                tuple(idle_in.items()),
            )
        )  # fmt: skip
    return out


BETWEEN = "between phases"


def _idle_in(gaps: Iterable[Gap], phases: Sequence[Span]) -> dict[str, float]:
    """How much of the idle ``gaps`` falls under each host phase (the host was doing that
    while the device waited), in the phases' order; the rest under :data:`BETWEEN`."""
    idle = {p.name: 0.0 for p in phases}
    for g in gaps:
        end, covered = g.start_us + g.us, 0.0
        for p in phases:
            overlap = min(end, p.end_us) - max(g.start_us, p.start_us)
            if overlap > 0:
                idle[p.name] += overlap
                covered += overlap
        if g.us - covered > 0:
            idle[BETWEEN] = idle.get(BETWEEN, 0.0) + g.us - covered
    return idle


def format_timelines(timelines: Sequence[StepTimeline], width: int = 60) -> str:
    """One block a step: wall, kernel time, idle, and the largest idle gaps."""
    lines = []
    for i, t in enumerate(timelines):
        share = t.busy_us / t.wall_us if t.wall_us > 0 else 0.0
        lines.append(
            f"step {i + 1}: wall {t.wall_us / 1e3:.3f} ms, kernels {t.busy_us / 1e3:.3f} ms "
            f"({share:.0%}, {t.kernels} kernels), idle {t.idle_us / 1e3:.3f} ms"
        )
        if t.host:
            lines.append("  host: " + ", ".join(f"{n} {us / 1e3:.3f}" for n, us in t.host) + " ms")
        if t.idle_in:
            idle = ", ".join(f"{n} {us / 1e3:.3f}" for n, us in t.idle_in)
            lines.append(f"  idle during: {idle} ms")
        for g in t.gaps:
            after = g.after[:width] or "(no kernel)"
            before = g.before[:width] or "(step end)"
            lines.append(f"  idle {g.us:9.1f} us  after {after}  before {before}")
    return "\n".join(lines) + "\n"
