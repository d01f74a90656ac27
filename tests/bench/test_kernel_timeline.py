"""The device timeline of profiled engine steps (``bench decode --profile``)."""

from __future__ import annotations

import pytest

from rackserve.bench.kernel_timeline import BETWEEN, Span, format_timelines, step_timelines


def test_busy_is_the_union_and_gaps_name_their_neighbours():
    kernels = [
        Span(10, 30, "verify_a"),
        Span(20, 40, "side"),  # overlaps verify_a: counted once
        Span(100, 110, "draft"),  # 60 us idle after side
        Span(212, 230, "next_step"),  # the second step's
    ]
    first, second = step_timelines([(0, 50), (200, 240)], kernels)
    assert first.wall_us == 200 and first.kernels == 3
    assert first.busy_us == pytest.approx(40)
    assert first.idle_us == pytest.approx(160)
    assert [(g.us, g.after, g.before) for g in first.gaps] == [
        (90, "draft", "next_step"),  # clipped at the next step's start
        (60, "side", "draft"),
        (10, "", "verify_a"),
    ]
    # the last step runs to the end of its host interval or of its last kernel
    assert second.wall_us == 40 and second.busy_us == pytest.approx(18)
    assert [g.us for g in second.gaps] == [12, 10]


def test_a_kernel_inside_another_adds_nothing():
    (t,) = step_timelines([(0, 100)], [Span(0, 100, "long"), Span(10, 20, "short")])
    assert t.busy_us == pytest.approx(100) and t.gaps == ()
    text = format_timelines([t])
    assert text.startswith("step 1: wall 0.100 ms, kernels 0.100 ms (100%, 2 kernels)")


def test_top_keeps_the_largest_gaps():
    kernels = [Span(10 * i + i * i, 10 * i + i * i + 1, f"k{i}") for i in range(8)]
    (t,) = step_timelines([(0, 1)], kernels, top=2)
    assert len(t.gaps) == 2 and t.gaps[0].us >= t.gaps[1].us
    assert t.gaps[0].before == "k7"


def test_a_kernel_across_steps_counts_in_each_window():
    """Async scheduling: step 1's forward runs on into step 2's window."""
    kernels = [Span(5, 150, "forward_1"), Span(160, 190, "forward_2")]
    first, second = step_timelines([(0, 20), (100, 120)], kernels)
    assert first.busy_us == pytest.approx(95) and first.kernels == 1
    assert second.busy_us == pytest.approx(80) and second.kernels == 1
    assert second.wall_us == 90
    assert [(g.us, g.after, g.before) for g in second.gaps] == [(10, "forward_1", "forward_2")]


def test_host_phases_are_summed_per_window_in_order():
    phases = [
        Span(0, 2, "schedule"),
        Span(2, 5, "launch"),
        Span(5, 40, "wait"),
        Span(41, 42, "update"),
        Span(45, 47, "update"),  # a second range of the same phase adds up
        Span(100, 103, "schedule"),  # the next step's
    ]
    first, second = step_timelines([(0, 50), (100, 110)], [], phases=phases)
    assert first.host == (("schedule", 2), ("launch", 3), ("wait", 35), ("update", 3))
    assert second.host == (("schedule", 3),)
    assert "  host: schedule 0.002, launch 0.003, wait 0.035, update 0.003 ms" in (
        format_timelines([first])
    )


def test_idle_time_is_split_by_the_host_phase_it_falls_under():
    """A synchronous step: the device idles while the host schedules and launches, runs the
    forward while the host waits, idles again through the update and between phases."""
    phases = [
        Span(0, 10, "schedule"),
        Span(10, 30, "launch"),  # the first kernel starts at 25: 15 of it idle
        Span(30, 80, "wait"),
        Span(85, 95, "update"),  # 80-85 and 95-100 under no phase
    ]
    kernels = [Span(25, 60, "forward"), Span(62, 78, "sample")]
    (t,) = step_timelines([(0, 100)], kernels, phases=phases)
    assert t.busy_us == pytest.approx(51) and t.idle_us == pytest.approx(49)
    names = [n for n, _ in t.idle_in]
    assert names == ["schedule", "launch", "wait", "update", BETWEEN]  # the phases' order
    assert [us for _, us in t.idle_in] == pytest.approx([10, 15, 4, 10, 10])
    assert sum(us for _, us in t.idle_in) == pytest.approx(t.idle_us)
    assert [g.start_us for g in t.gaps[:2]] == [0, 78]  # the largest: 25 at 0, 22 at 78
    assert "  idle during: schedule 0.010, launch 0.015, wait 0.004, update 0.010, " in (
        format_timelines([t])
    )
