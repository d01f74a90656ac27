"""Where the host's time goes around the GPU work of a step.

- decode batches (``--decode``): a graph step as ``bench forward`` times it
  (``DecodeGraphs.run``: staging the inputs, then the replay) against the replay alone, and
  the host's time to stage (``DecodeGraphs.stage``, no sync inside);
- prefill batches (``--prefill``): cProfile of one eager forward after warm-up (the host
  issues it while the GPU runs; ``prefill_graph_probe.py`` says whether the GPU waits), the
  functions by own time and by cumulative time; then, without the profiler, the host's time
  per op of the model's kernel table (``ops.Kernels``, each call timed on the host, no sync)
  and the host's time to issue the forward behind a 50 ms GPU sleep: near the plain issue
  time means the host never waits on the GPU inside the forward; 50 ms or more means some
  call blocks until the GPU catches up.

    python3 benchmarks/host_probe.py --decode decode:1@4096 --prefill prefill:2048
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import dataclasses
import io
import json
import pstats
import statistics
import time

import torch

from rackserve.bench.forward import BatchSpec, synthetic_step
from rackserve.runner.cuda_graph import DecodeGraphs
from rackserve.runner.step_buffers import StepBuffers

from bench_timing import bench_model, eager_step, events_ms, host_ms


def _events_ms(fn) -> float:
    return statistics.median(events_ms(fn))


def _host_ms(fn) -> float:
    return statistics.median(host_ms(fn))


@torch.inference_mode()
def decode(model, text: str) -> dict:
    s = synthetic_step(model, BatchSpec.parse(text))
    inputs, writes = s.step.inputs, s.step.table_writes
    buffers = StepBuffers(s.groups, s.input_batch.block_tables, "cuda")
    graphs = DecodeGraphs(
        model, s.caches, buffers, s.groups, [len(inputs.rows)], [inputs.max_seq_len]
    )
    buffers.apply_writes(*buffers.upload(list(writes)))
    graphs.capture(log=False)
    key = graphs.key_for(inputs)
    empty = (writes[0][:0], writes[1][:0])
    graph = graphs.graphs[key][0]
    for _ in range(3):
        graphs.run(key, inputs, empty)
    return {
        "batch": text,
        "run_ms": _events_ms(lambda: graphs.run(key, inputs, empty)),
        "replay_ms": _events_ms(graph.replay),
        "stage_events_ms": _events_ms(lambda: graphs.stage(key, inputs, empty)),
        "stage_host_ms": _host_ms(lambda: graphs.stage(key, inputs, empty)),
        "replay_host_ms": _host_ms(graph.replay),
    }


@torch.inference_mode()
def prefill(model, text: str, top: int) -> dict:
    run, _ = eager_step(model, text)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    run()
    prof.disable()
    profiled_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    out = {"batch": text, "host_ms_profiled": profiled_ms}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
        out[key] = buf.getvalue()
    out.update(ops_host_ms(model, run))
    return out


def ops_host_ms(model, run, iters: int = 10) -> dict:
    """Host milliseconds per op of ``model.kernels`` over one forward (median of ``iters``
    forwards, the GPU idle at each start), the forward's own host time, and its host time
    behind a 50 ms GPU sleep (``torch.cuda._sleep``)."""
    table = model.kernels
    spent: dict[str, list[float]] = collections.defaultdict(list)
    calls: collections.Counter = collections.Counter()
    originals = {f.name: getattr(table, f.name) for f in dataclasses.fields(table)}
    del originals["name"]

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name][-1] += time.perf_counter() - t0
                calls[name] += 1

        return wrapper

    for name, fn in originals.items():
        object.__setattr__(table, name, timed(name, fn))
    try:
        totals = []
        for _ in range(iters):
            for name in originals:
                spent[name].append(0.0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            totals.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    finally:
        for name, fn in originals.items():
            object.__setattr__(table, name, fn)
    per_op = {
        name: round(statistics.median(v) * 1e3, 3) for name, v in spent.items() if calls[name]
    }
    cycles = int(50e-3 * torch.cuda.get_device_properties(0).clock_rate * 1e3)
    behind = []
    for _ in range(5):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        run()
        behind.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return {
        "host_ms": round(statistics.median(totals), 3),
        "ops_host_ms": dict(sorted(per_op.items(), key=lambda kv: -kv[1])),
        "ops_calls": {name: calls[name] // iters for name in per_op},
        "outside_ops_host_ms": round(statistics.median(totals) - sum(per_op.values()), 3),
        "host_ms_behind_50ms_sleep": round(statistics.median(behind), 3),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--decode", action="append", default=[])
    p.add_argument("--prefill", action="append", default=[])
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    model = bench_model()
    records = []
    for text in args.decode:
        r = decode(model, text)
        records.append(r)
        print(
            f"{text}: run {r['run_ms']:.3f} ms, replay {r['replay_ms']:.3f}, stage alone "
            f"{r['stage_events_ms']:.3f} (host {r['stage_host_ms']:.3f}), replay host "
            f"{r['replay_host_ms']:.3f}"
        )
    for text in args.prefill:
        r = prefill(model, text, args.top)
        records.append(r)
        print(f"== {text}: host {r['host_ms_profiled']:.1f} ms under cProfile")
        print(r["tottime"][-6000:])
        print(
            f"{text}: host {r['host_ms']:.2f} ms ({r['host_ms_behind_50ms_sleep']:.2f} behind a "
            f"50 ms GPU sleep), outside the ops {r['outside_ops_host_ms']:.2f}; per op (ms): "
            + ", ".join(f"{k} {v:.2f} x{r['ops_calls'][k]}" for k, v in r["ops_host_ms"].items())
        )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
