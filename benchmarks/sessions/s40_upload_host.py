"""Session 40: the host time of one step's upload on a GPU machine (pinned buffers, CUDA
events): ``StepBuffers.upload`` through ``device.PinnedStaging`` against session 39's old
staging (``s39_old_upload._upload``), twelve int64 arrays of a decode:1 step's sizes, the
device synchronized between uploads as bench forward's isolated runs leave it. Prints
microseconds per upload (median of 5 rounds of 500); then, on the v4-flash preset (4 layers,
64 experts, random weights), decode:1@4096's graph step as bench forward times it, each arm
twice, alternating: the host's time in the step's call (staging and replay launch) and the
isolated time between CUDA events."""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
import torch

from rackserve.runner import step_buffers

SIZES = (1, 1, 1, 2, 1, 4, 4, 2, 2, 1, 33, 33)  # a decode:1 step's arrays, about


def per_upload_us(upload, obj, arrays, rounds: int = 5, n: int = 500) -> float:
    medians = []
    for _ in range(rounds):
        times = []
        for _ in range(n):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            upload(obj, arrays)
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times) * 1e6)
    return round(statistics.median(medians), 2)


def main() -> None:
    new = step_buffers.StepBuffers.upload
    import s39_old_upload  # noqa: F401  (patches StepBuffers.upload with the old one)

    old = step_buffers.StepBuffers.upload
    step_buffers.StepBuffers.upload = new
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 1000, size=s, dtype=np.int64) for s in SIZES]

    class Holder:  # what both uploads read of a StepBuffers
        on_host = False
        device = torch.device("cuda")

    from rackserve.device import PinnedStaging

    holder = Holder()
    holder._staging = PinnedStaging("cuda")
    result = {}
    for arm in ("new", "old", "new", "old"):
        fn = new if arm == "new" else old
        result.setdefault(arm, []).append(per_upload_us(fn, holder, arrays))
    got_new, got_old = new(holder, arrays), old(holder, arrays)
    assert all(torch.equal(a, b) for a, b in zip(got_new, got_old, strict=True))
    print(json.dumps({"us_per_upload": result, "sizes": SIZES}), flush=True)
    print(json.dumps(event_costs()), flush=True)
    print(json.dumps(graph_step(new, old)), flush=True)


def event_costs(n: int = 2000) -> dict:
    """Host microseconds a call: a new event recorded (the last one dropped), one event
    recorded again, a pair of timing events made and recorded, a recorded event synchronized."""
    kept = torch.cuda.Event()
    state = {"event": None}

    def new_event():
        state["event"] = torch.cuda.Event()
        state["event"].record()

    def timing_pair():
        state["pair"] = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        state["pair"][0].record()
        state["pair"][1].record()

    out = {}
    for name, fn in (("new_event", new_event), ("record_again", kept.record),
                     ("timing_pair", timing_pair), ("synchronize", kept.synchronize)):  # fmt: skip
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out[name] = round((time.perf_counter() - t0) / n * 1e6, 2)
        torch.cuda.synchronize()
    return {"event_us": out}


@torch.inference_mode()
def graph_step(new, old) -> dict:
    def arm(name: str) -> None:
        step_buffers.StepBuffers.upload = new if name == "new" else old

    return time_graph_step({"new": arm, "old": arm}, runs=50)


@torch.inference_mode()
def time_graph_step(arms: dict, runs: int, passes: int = 2) -> dict:
    """decode:1@4096's graph step of the v4-flash preset (4 layers, 64 experts, random
    weights) as bench forward times it, each arm ``passes`` times, alternating; ``arms``:
    name -> a callable of the name that sets the arm up before its step is built. The
    host's time in the step's call (staging and replay launch) and the isolated time
    between CUDA events, medians of ``runs``."""
    from rackserve.bench.forward import BatchSpec, forward_step, synthetic_step
    from rackserve.model.create import init_model_
    from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
    from rackserve.model.presets import preset_config

    with torch.device("cuda"):
        model = DeepseekV4ForCausalLM(preset_config("v4-flash", 4, 64), with_mtp=False)
    init_model_(model.cast(torch.bfloat16), seed=0)
    synthetic = synthetic_step(model, BatchSpec.parse("decode:1@4096"))
    result: dict = {}
    for name in list(arms) * passes:
        arms[name](name)
        run = forward_step(model, synthetic, graph=True, warmup=3)
        host, isolated = [], []
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            run()
            host.append(time.perf_counter() - t0)
            end.record()
            end.synchronize()
            isolated.append(start.elapsed_time(end) / 1e3)
        result.setdefault(name, []).append(
            {
                "host_us": round(statistics.median(host) * 1e6, 1),
                "isolated_ms": round(statistics.median(isolated) * 1e3, 4),
            }
        )
    return {"decode:1@4096": result}


if __name__ == "__main__":
    main()
