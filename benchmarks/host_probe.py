"""Where the host's time goes around the GPU work of a step.

- decode batches (``--decode``): a graph step as ``bench forward`` times it
  (``DecodeGraphs.run``: staging the inputs, then the replay) against the replay alone, and
  the host's time to stage (``DecodeGraphs.stage``, no sync inside);
- prefill batches (``--prefill``): cProfile of one eager forward after warm-up (the host
  issues it while the GPU runs; ``prefill_graph_probe.py`` says whether the GPU waits), the
  functions by own time and by cumulative time.

    python3 benchmarks/host_probe.py --decode decode:1@4096 --prefill prefill:2048
"""

from __future__ import annotations

import argparse
import cProfile
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
    return out


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
    if args.output:
        with open(args.output, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
