"""Session 41: where bench forward's isolated decode:1 step spends the time before its graph
runs. Session 40's call 4 (H100) timed the graph step's host call at 130-240 us against a
replay of ~1.4 ms, and its isolated time followed the host time one for one. This splits the
step (v4-flash preset, 4 layers, 64 experts, decode:1@4096, as ``bench.forward``'s graph
step) into its stage (upload, table writes, static inputs) and the replay's launch:

- ``split``: host microseconds of ``stage`` and of ``graph.replay()``, and the device's
  milliseconds from the start event to an event recorded after ``stage`` and from there to
  the end (medians of 200 steps);
- ``whole``: the step as bench forward times it (isolated) and back to back;
- ``trace``: 20 steps under torch.profiler: per step, the host's stage time up to the
  ``cudaGraphLaunch`` call, that call's duration, from its start to the first kernel's start
  (the launch latency) and the graph's device span (medians, microseconds).

Prints one JSON object per part. Usage on a GPU: python3 benchmarks/sessions/s41_step_host.py
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from rackserve.bench.forward import BatchSpec, isolated_times, synthetic_step
from rackserve.model.create import init_model_
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.model.presets import preset_config
from rackserve.runner.cuda_graph import DecodeGraphs
from rackserve.runner.step_buffers import StepBuffers


def med(values: list[float], scale: float) -> float:
    return round(statistics.median(values) * scale, 2)


def build_decode1():
    """decode:1@4096's graph as bench forward's graph step builds it: (graphs, key, inputs,
    the empty table writes, the captured graph)."""
    with torch.device("cuda"):
        model = DeepseekV4ForCausalLM(preset_config("v4-flash", 4, 64), with_mtp=False)
    init_model_(model.cast(torch.bfloat16), seed=0)
    synthetic = synthetic_step(model, BatchSpec.parse("decode:1@4096"))
    inputs, caches = synthetic.step.inputs, synthetic.caches
    buffers = StepBuffers(synthetic.groups, synthetic.input_batch.block_tables, "cuda")
    writes = synthetic.step.table_writes
    graphs = DecodeGraphs(model, caches, buffers, synthetic.groups, [1], [inputs.max_seq_len])
    buffers.apply_writes(*buffers.upload(list(writes)))
    graphs.capture(log=False)
    key = graphs.key_for(inputs)
    assert key is not None and key in graphs.graphs
    return graphs, key, inputs, (writes[0][:0], writes[1][:0]), graphs.graphs[key][0]


@torch.inference_mode()
def main() -> None:
    device = torch.device("cuda")
    graphs, key, inputs, empty, graph = build_decode1()

    def run() -> None:
        graphs.run(key, inputs, empty)

    for _ in range(10):
        run()
    torch.cuda.synchronize()

    stage_us, replay_us, before_ms, after_ms = [], [], [], []
    for _ in range(200):
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        e0.record()
        t0 = time.perf_counter()
        graphs.stage(key, inputs, empty)
        t1 = time.perf_counter()
        e1.record()
        t2 = time.perf_counter()
        graph.replay()
        t3 = time.perf_counter()
        e2.record()
        e2.synchronize()
        stage_us.append(t1 - t0)
        replay_us.append(t3 - t2)
        before_ms.append(e0.elapsed_time(e1))
        after_ms.append(e1.elapsed_time(e2))
    print(json.dumps({"split": {
        "stage_host_us": med(stage_us, 1e6), "replay_host_us": med(replay_us, 1e6),
        "start_to_staged_ms": med(before_ms, 1), "staged_to_end_ms": med(after_ms, 1),
    }}), flush=True)  # fmt: skip

    isolated = isolated_times(run, 200, device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        run()
    torch.cuda.synchronize()
    print(json.dumps({"whole": {
        "isolated_ms": med(isolated, 1e3), "isolated_min_ms": round(min(isolated) * 1e3, 4),
        "back_to_back_ms": round((time.perf_counter() - t0) / 200 * 1e3, 4),
    }}), flush=True)  # fmt: skip

    print(json.dumps({"trace": trace(run)}), flush=True)


def trace(run) -> dict:
    """Per-step phases from a torch.profiler trace of 20 isolated steps (microseconds)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            with torch.profiler.record_function("s41_step"):
                run()
            torch.cuda.synchronize()
    events = prof.events()
    steps = sorted(
        (e for e in events if e.name == "s41_step" and e.device_type.name == "CPU"),
        key=lambda e: e.time_range.start,
    )
    launches = sorted(
        (e for e in events if e.name == "cudaGraphLaunch"), key=lambda e: e.time_range.start
    )
    kernels = sorted(
        (e for e in events if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start
    )
    phases: dict[str, list[float]] = {
        "stage": [], "launch_call": [], "launch_to_first_kernel": [], "graph_span": [],
        "kernels": [],
    }  # fmt: skip
    for step in steps:
        launch = next((e for e in launches if e.time_range.start >= step.time_range.start), None)
        if launch is None:
            continue
        mine = [k for k in kernels if k.time_range.start >= launch.time_range.start]
        following = [s for s in steps if s.time_range.start > step.time_range.start]
        if following:
            mine = [k for k in mine if k.time_range.start < following[0].time_range.start]
        if not mine:
            continue
        phases["stage"].append(launch.time_range.start - step.time_range.start)
        phases["launch_call"].append(launch.time_range.end - launch.time_range.start)
        phases["launch_to_first_kernel"].append(mine[0].time_range.start - launch.time_range.start)
        phases["graph_span"].append(mine[-1].time_range.end - mine[0].time_range.start)
        phases["kernels"].append(len(mine))
    return {name: med(values, 1) for name, values in phases.items() if values} | {
        "steps": len(phases["stage"])
    }


if __name__ == "__main__":
    main()
