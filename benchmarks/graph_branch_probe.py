"""Do two chains of kernels on two streams, captured into one CUDA graph, run side by side
whatever the order they were issued in?

Each kernel is ``torch.cuda._sleep`` (a spin of a fixed number of cycles, ~``--us`` us).
Captured and replayed (events around 200 replays, per replay):

- ``serial``: 2n kernels on one stream (the sum);
- ``side_first``: fork, n on the side stream, then n on the main stream, join;
- ``main_first``: fork, n on the main stream, then n on the side stream, join;
- ``interleaved``: fork, then one kernel on each stream in turn, join;
- ``one_side``: fork, one kernel of n times the spin on the side, n on the main, join.

Side by side, the four two-stream cases take about n kernels; if the graph's launches go
out in issue order and a launch waits for its dependencies (so a chain's second kernel
holds back every kernel issued after it), ``side_first`` and ``main_first`` take about 2n.

    python3 benchmarks/graph_branch_probe.py --n 6 --us 5 --output out.json
"""

from __future__ import annotations

import argparse
import json

import torch


def capture(body) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    body(side)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body(side)
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, iters: int = 200) -> float:
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=6)
    p.add_argument("--us", type=float, default=5.0)
    p.add_argument("--output", default=None)
    a = p.parse_args()
    # cycles a microsecond, timed: one long spin
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    cycles = int(a.us * 10_000_000 / (start.elapsed_time(end) * 1e3))
    n = a.n

    def sleep(k: int = 1) -> None:
        torch.cuda._sleep(cycles * k)

    def on(stream, k: int = 1) -> None:
        with torch.cuda.stream(stream):
            sleep(k)

    def fork(side) -> None:
        side.wait_stream(torch.cuda.current_stream())

    def join(side) -> None:
        torch.cuda.current_stream().wait_stream(side)

    def serial(side) -> None:
        for _ in range(2 * n):
            sleep()

    def side_first(side) -> None:
        fork(side)
        for _ in range(n):
            on(side)
        for _ in range(n):
            sleep()
        join(side)

    def main_first(side) -> None:
        fork(side)
        for _ in range(n):
            sleep()
        for _ in range(n):
            on(side)
        join(side)

    def interleaved(side) -> None:
        fork(side)
        for _ in range(n):
            on(side)
            sleep()
        join(side)

    def one_side(side) -> None:
        fork(side)
        on(side, n)
        for _ in range(n):
            sleep()
        join(side)

    record = {"n": n, "kernel_us": a.us, "device": torch.cuda.get_device_name()}
    for case in (serial, side_first, main_first, interleaved, one_side):
        record[case.__name__] = round(replay_us(capture(case)), 2)
    print(json.dumps(record))
    if a.output:
        with open(a.output, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
