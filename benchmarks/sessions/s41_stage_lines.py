"""Session 41, call 2: the decode:1 graph step's stage, line by line. Call 1 (H100) timed
``_StepGraphs.stage`` at 101 us of host time (the device idle for 120 us before the graph)
against 22 us for a fields-only ``PinnedStaging.upload`` timed alone. This runs the stage's
lines (``cuda_graph._StepGraphs.stage``, then ``PinnedStaging.upload``'s fields-only path)
with a clock between each, the device idle before each step ("idle"), idle with a timing
event recorded first ("timed": as bench forward's isolated step) and busy with the previous
replay ("busy": as the async engine stages), then the same stage as one call. Medians of
300 steps, microseconds; one JSON object a line.
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
import torch
from s41_step_host import build_decode1

from rackserve.runner.step_buffers import _int64, pad_to


def before(mode: str):
    """Each step's start: "idle" a device synchronize; "timed" as bench forward's isolated
    step (a timing event recorded first, the last step's end event synchronized); "busy"
    nothing (the previous replay still runs). Returns what to call after the replay."""
    if mode == "idle":
        torch.cuda.synchronize()
    if mode != "timed":
        return lambda: None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()

    def after() -> None:
        end.record()
        end.synchronize()

    return after


def lines(graphs, key, inputs, empty, graph, mode: str) -> dict:
    buffers = graphs.buffers
    staging = buffers._staging
    into = graphs.static.buffer
    names = ["rows", "pad", "int64", "host_buffer", "concat", "copy", "record", "empties",
             "apply_writes", "replay"]  # fmt: skip
    laps: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(300):
        after = before(mode)
        t = [time.perf_counter()]
        b = key[0]
        rows = np.asarray(inputs.rows, dtype=np.int64)[inputs.token_req]
        t.append(time.perf_counter())
        ids, positions = pad_to(inputs.input_ids, b), pad_to(inputs.positions, b)
        rows = pad_to(rows, b, buffers.null_row)
        fields = [ids, positions, rows]
        t.append(time.perf_counter())
        arrays = [_int64(a) for a in empty]
        fields = [_int64(a) for a in fields]
        t.append(time.perf_counter())
        field_bytes = sum(f.size for f in fields) * 8
        i, buffer, host = staging._host_buffer(field_bytes)
        t.append(time.perf_counter())
        out = host[:field_bytes].view(np.int64)
        np.concatenate(fields, out=out, casting="safe")
        t.append(time.perf_counter())
        into[: out.size].copy_(buffer[:field_bytes].view(into.dtype), non_blocking=True)
        t.append(time.perf_counter())
        staging._copied[i].record()
        t.append(time.perf_counter())
        w_index, w_values = [staging._empty_of(a) for a in arrays]
        t.append(time.perf_counter())
        buffers.apply_writes(w_index, w_values)
        t.append(time.perf_counter())
        graph.replay()
        t.append(time.perf_counter())
        after()
        for name, a, z in zip(names, t[:-1], t[1:], strict=True):
            laps[name].append(z - a)
    torch.cuda.synchronize()
    return {n: round(statistics.median(v) * 1e6, 2) for n, v in laps.items()}


def whole(graphs, key, inputs, empty, graph, mode: str) -> dict:
    stage, replay = [], []
    for _ in range(300):
        after = before(mode)
        t0 = time.perf_counter()
        graphs.stage(key, inputs, empty)
        t1 = time.perf_counter()
        graph.replay()
        t2 = time.perf_counter()
        after()
        stage.append(t1 - t0)
        replay.append(t2 - t1)
    torch.cuda.synchronize()
    return {
        "stage": round(statistics.median(stage) * 1e6, 2),
        "replay": round(statistics.median(replay) * 1e6, 2),
    }


def raw_calls() -> dict:
    """The CUDA calls alone on small tensors, the device idle: a pinned 24-byte copy to the
    device (non_blocking), an event record, a synchronize of a passed event."""
    pinned = torch.zeros(8, dtype=torch.int64, pin_memory=True)
    dev = torch.zeros(8, dtype=torch.int64, device="cuda")
    event = torch.cuda.Event()
    laps: dict[str, list[float]] = {"copy": [], "record": [], "sync_passed": [], "slice": []}
    for _ in range(300):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev[:3].copy_(pinned[:3], non_blocking=True)
        t1 = time.perf_counter()
        event.record()
        t2 = time.perf_counter()
        event.synchronize()
        t3 = time.perf_counter()
        pinned[:3]
        t4 = time.perf_counter()
        for name, a, z in (("copy", t0, t1), ("record", t1, t2), ("sync_passed", t2, t3),
                           ("slice", t3, t4)):  # fmt: skip
            laps[name].append(z - a)
    return {n: round(statistics.median(v) * 1e6, 2) for n, v in laps.items()}


@torch.inference_mode()
def main() -> None:
    built = build_decode1()
    for _ in range(10):
        built[0].run(built[1], built[2], built[3])
    torch.cuda.synchronize()
    print(json.dumps({"raw_calls": raw_calls()}), flush=True)
    for mode in ("idle", "timed", "busy", "idle", "timed"):
        print(json.dumps({f"lines_{mode}": lines(*built, mode=mode)}), flush=True)
        print(json.dumps({f"whole_{mode}": whole(*built, mode=mode)}), flush=True)


if __name__ == "__main__":
    main()
