"""Is an eager prefill forward bound by the host? One batch through the fast path, timed
three ways on the same inputs:

- ``eager_ms``: CUDA events around the eager forward (what ``bench forward`` reports);
- ``enqueue_ms``: the host's time to issue that forward, GPU idle at its start (no sync
  inside: the launches only queue). Near ``eager_ms`` means the GPU waits on the host;
- ``graph_ms``: the same forward captured once in a CUDA graph and replayed: the GPU time
  without host gaps (a capture error says the forward is not graph-safe, and why).

Prints one line per batch and writes the records as JSON.
Usage: python3 benchmarks/prefill_graph_probe.py --batch prefill:2048 --batch prefill:8192
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.runner.cuda_graph import capture_region

from bench_timing import bench_model, eager_step, events_ms, host_ms


@torch.inference_mode()
def probe(model: DeepseekV4ForCausalLM, text: str, iters: int) -> dict:
    run, _ = eager_step(model, text)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    record: dict = {"batch": text, "eager_ms": events_ms(run, iters)}
    record["enqueue_ms"] = host_ms(run, iters)
    try:
        graph, _ = capture_region(run)
        graph.replay()
        torch.cuda.synchronize()
        record["graph_ms"] = events_ms(graph.replay, iters)
    except Exception as exc:  # the reason is the finding
        record["graph_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    for key in ("eager_ms", "enqueue_ms", "graph_ms"):
        if key in record:
            record[f"{key}_median"] = statistics.median(record[key])
    return record


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", action="append", required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    model = bench_model(args.layers, args.experts)
    records = []
    for text in args.batch:
        r = probe(model, text, args.iters)
        records.append(r)
        graph = f"{r['graph_ms_median']:.2f}" if "graph_ms" in r else r["graph_error"]
        print(
            f"{text}: eager {r['eager_ms_median']:.2f} ms (min {min(r['eager_ms']):.2f}), "
            f"host enqueue {r['enqueue_ms_median']:.2f} ms, graph replay {graph}"
        )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
