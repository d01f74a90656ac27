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


def graph_step(new, old) -> dict:
    from s40_upload_host import time_graph_step

    original_init = step_buffers.StepBuffers.__init__

    def arm(name: str) -> None:
        step_buffers.StepBuffers.upload = old if name == "old" else new

        def init(self, *a, **k):
            original_init(self, *a, **k)
            set_arm(self, name)

        step_buffers.StepBuffers.__init__ = init

    try:
        return time_graph_step(dict.fromkeys(("new", "noevent", "old"), arm), runs=100)
    finally:
        step_buffers.StepBuffers.__init__ = original_init


if __name__ == "__main__":
    main()
