"""Session 40, call 4: where the graph stage's host time goes. Call 3 (148ded8, H100): the
decode:1 graph step's host time 72-90 us through PinnedStaging against 40-41 with the old
staging, where the upload of twelve arrays differed by ~15 us. The graph's stage uploads
fields only (ids, positions, rows into the static inputs; no table writes). Arms: "new"
(PinnedStaging), "noevent" (its copy events off), "old" (s39_old_upload); the fields-only
upload alone, then the graph step, each arm twice, alternating. Microseconds (medians)."""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
import torch

from rackserve.runner import step_buffers


def arms():
    new = step_buffers.StepBuffers.upload
    import s39_old_upload  # noqa: F401  (patches StepBuffers.upload with the old one)

    old = step_buffers.StepBuffers.upload
    step_buffers.StepBuffers.upload = new
    return new, old


def set_arm(buffers, arm: str) -> None:
    if arm == "noevent":
        buffers._staging._copied = [None, None]


def main() -> None:
    new, old = arms()
    from rackserve.device import PinnedStaging

    class Holder:
        on_host = False
        device = torch.device("cuda")

    into = torch.zeros(64, dtype=torch.int64, device="cuda")
    fields = [
        np.arange(1, dtype=np.int64),
        np.arange(1, dtype=np.int64) + 4000,
        np.zeros(1, np.int64),
    ]
    empty = [np.zeros(0, np.int64), np.zeros(0, np.int64)]
    result: dict = {"fields_only_upload_us": {}, "graph_step": {}}
    for arm in ("new", "noevent", "old") * 2:
        h = Holder()
        h._staging = PinnedStaging("cuda")
        set_arm(h, arm)
        fn = old if arm == "old" else new
        times = []
        for _ in range(2000):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(h, empty, into, fields)
            times.append(time.perf_counter() - t0)
        result["fields_only_upload_us"].setdefault(arm, []).append(
            round(statistics.median(times) * 1e6, 2)
        )
    print(json.dumps(result["fields_only_upload_us"]), flush=True)
    result["graph_step"] = graph_step(new, old)
    print(json.dumps(result["graph_step"]), flush=True)


@torch.inference_mode()
def graph_step(new, old) -> dict:
    from rackserve.bench.forward import BatchSpec, forward_step, synthetic_step
    from rackserve.model.create import init_model_
    from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
    from rackserve.model.presets import preset_config

    with torch.device("cuda"):
        model = DeepseekV4ForCausalLM(preset_config("v4-flash", 4, 64), with_mtp=False)
    init_model_(model.cast(torch.bfloat16), seed=0)
    synthetic = synthetic_step(model, BatchSpec.parse("decode:1@4096"))
    result: dict = {}
    original_init = step_buffers.StepBuffers.__init__
    for arm in ("new", "noevent", "old") * 2:
        step_buffers.StepBuffers.upload = old if arm == "old" else new

        def init(self, *a, arm=arm, **k):
            original_init(self, *a, **k)
            set_arm(self, arm)

        step_buffers.StepBuffers.__init__ = init
        run = forward_step(model, synthetic, graph=True, warmup=3)
        host, isolated = [], []
        for _ in range(100):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            run()
            host.append(time.perf_counter() - t0)
            end.record()
            end.synchronize()
            isolated.append(start.elapsed_time(end) / 1e3)
        result.setdefault(arm, []).append(
            {
                "host_us": round(statistics.median(host) * 1e6, 1),
                "isolated_ms": round(statistics.median(isolated) * 1e3, 4),
            }
        )
    step_buffers.StepBuffers.__init__ = original_init
    return {"decode:1@4096": result}


if __name__ == "__main__":
    main()
