"""Where a decode graph step's time goes beyond its kernels, and which kernels the graph runs
that the eager forward does not.

For one batch: the replay alone (CUDA events around ``graph.replay()``), the same with the
runner's input upload, and the summed kernel time inside the replay (torch.profiler); then
the kernels by name of three runs, diffed: the eager forward + logits (what
``profile_forward.py`` profiles: metadata built outside), the captured region run eagerly
(``DecodeGraphs.forward``: metadata, forward, logits, same padding and bucket) and the
replay. Each is measured twice: with the step metadata kernels (``ops/triton/step_meta.py``,
the default) and with ``StepMetadata.build``'s torch ops (what session 3 captured: 227
kernels against 100, 2026-12-01-h200-s3-final-graph-gap.json).

    python3 benchmarks/graph_gap.py --batch decode:1@4096 --output $OUT/graph_gap.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from rackserve.runner.cuda_graph import DecodeGraphs
from rackserve.runner.step_buffers import StepBuffers

from bench_timing import bench_model, eager_step, events_ms


def _events(fn) -> float:
    """Median milliseconds of ``fn`` between two CUDA events (30 calls)."""
    return statistics.median(events_ms(fn))


def _kernels(fn) -> dict[str, list[float]]:
    """Kernel name -> [calls, microseconds] of one call of ``fn`` (torch.profiler)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name][0] += 1
            totals[e.name][1] += e.device_time_total
    return dict(totals)


def _timeline(fn, runs: int = 5) -> dict:
    """One call of ``fn`` kernel by kernel, in GPU order: name, duration and the idle time
    before it (the median of ``runs`` profiled calls per position), with the totals: the
    span from the first kernel's start to the last one's end, the summed kernel time and
    the summed gaps."""
    per_run: list[list[tuple[str, float, float]]] = []
    for _ in range(runs):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        events = sorted(
            (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
            key=lambda e: e.time_range.start,
        )
        rows, end = [], None
        for e in events:
            gap = 0.0 if end is None else max(0.0, e.time_range.start - end)
            rows.append((e.name, e.time_range.end - e.time_range.start, gap))
            end = e.time_range.end if end is None else max(end, e.time_range.end)
        per_run.append(rows)
    n = min(len(r) for r in per_run)
    kernels = [
        {
            "name": per_run[0][i][0][:100],
            "us": round(statistics.median(r[i][1] for r in per_run), 2),
            "gap_us": round(statistics.median(r[i][2] for r in per_run), 2),
        }
        for i in range(n)
    ]
    busy = sum(k["us"] for k in kernels)
    gaps = sum(k["gap_us"] for k in kernels)
    return {
        "span_us": round(busy + gaps, 1),
        "busy_us": round(busy, 1),
        "gaps_us": round(gaps, 1),
        "kernels": kernels,
    }


def _summary(kernels: dict[str, list[float]]) -> dict:
    return {
        "kernels": int(sum(c for c, _ in kernels.values())),
        "kernel_ms": sum(t for _, t in kernels.values()) / 1e3,
    }


def _diff(a: dict[str, list[float]], b: dict[str, list[float]], top: int = 30) -> list[dict]:
    """The kernels whose calls or time differ between runs ``a`` and ``b``, largest time
    difference first (names cut to 120 characters)."""
    rows = []
    for name in a.keys() | b.keys():
        ca, ta = a.get(name, (0, 0.0))
        cb, tb = b.get(name, (0, 0.0))
        if ca != cb or abs(ta - tb) > 2.0:
            rows.append({"name": name[:120], "calls": [ca, cb], "us": [round(ta, 2), round(tb, 2)]})
    rows.sort(key=lambda r: -abs(r["us"][1] - r["us"][0]))
    return rows[:top]


def _variant(model, s, fast_metadata: bool) -> dict:
    inputs, writes = s.step.inputs, s.step.table_writes
    buffers = StepBuffers(s.groups, s.input_batch.block_tables, "cuda")
    graphs = DecodeGraphs(
        model, s.caches, buffers, s.groups, [len(inputs.rows)], [inputs.max_seq_len]
    )
    graphs.meta.fast = fast_metadata
    buffers.apply_writes(*buffers.upload(list(writes)))
    graphs.capture(log=False)
    key = graphs.key_for(inputs)
    assert key is not None
    empty = (writes[0][:0], writes[1][:0])
    graph, _ = graphs.graphs[key]
    for _ in range(3):
        graphs.run(key, inputs, empty)
    with_upload = _events(lambda: graphs.run(key, inputs, empty))
    replay = _events(graph.replay)
    replay_kernels = _kernels(graph.replay)
    region_kernels = _kernels(lambda: graphs.forward(*key))
    timeline = _timeline(graph.replay) if fast_metadata else None
    busy = _summary(replay_kernels)["kernel_ms"]
    return {
        "fast_metadata": fast_metadata,
        "step_with_upload_ms": with_upload,
        "replay_ms": replay,
        "kernel_ms_in_replay": busy,
        "kernels_in_replay": _summary(replay_kernels)["kernels"],
        "gap_ms": replay - busy,
        "captured_region_eager": _summary(region_kernels),
        "_replay": replay_kernels,
        "_timeline": timeline,
        "_region": region_kernels,
    }


@torch.inference_mode()
def measure(batch: str) -> dict:
    model = bench_model()
    # the eager forward + logits, as profile_forward.py profiles it (metadata built before)
    eager, s = eager_step(model, batch)
    for _ in range(3):
        eager()
    eager_kernels = _kernels(eager)
    variants = [_variant(model, s, fast) for fast in (True, False)]
    main = variants[0]
    record = {
        "batch": batch,
        **{k: v for k, v in main.items() if not k.startswith("_")},
        "eager_forward": _summary(eager_kernels),
        "torch_metadata": {k: v for k, v in variants[1].items() if not k.startswith("_")},
        # kernels by name: [eager forward, replay] and [captured region eagerly, replay]
        "diff_eager_vs_replay": _diff(eager_kernels, main["_replay"]),
        "diff_region_vs_replay": _diff(main["_region"], main["_replay"]),
        "diff_torch_vs_fast_metadata_replay": _diff(variants[1]["_replay"], main["_replay"]),
        "replay_timeline": main["_timeline"],
    }
    return record


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", action="append", required=True)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    records = [measure(b) for b in args.batch]
    if args.output:  # first: a broken pipe on the printing must not lose the record
        with open(args.output, "w") as f:
            json.dump(records, f, indent=1)
    for r in records:
        short = {k: v for k, v in r.items() if not k.startswith(("diff_", "replay_timeline"))}
        print(json.dumps(short))
        for k in ("diff_eager_vs_replay", "diff_region_vs_replay"):
            print(f"== {r['batch']} {k}: calls [a, b], us [a, b]")
            for row in r[k][:15]:
                print(f"  {row['calls']} {row['us']} {row['name'][:90]}")
        t = r["replay_timeline"]
        print(
            f"== {r['batch']} replay timeline: span {t['span_us']} us = kernels "
            f"{t['busy_us']} + gaps {t['gaps_us']} ({len(t['kernels'])} kernels)"
        )
        for k in t["kernels"]:
            print(f"  {k['gap_us']:6.2f} {k['us']:8.2f}  {k['name'][:80]}")


if __name__ == "__main__":
    main()
