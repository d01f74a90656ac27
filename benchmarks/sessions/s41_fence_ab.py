"""Session 41, call 5: the staging's fence recorded after the replay ("after", the default
since this commit) against right after the copy ("copy": the order before, each upload
followed by its ``fence()``), decode:1@4096's graph step (v4-flash preset, 4 layers, 64
experts) timed as bench forward's isolated step: a timing event, the step, an event, a
synchronize. Per arm and pass: the host's time in the step's call and the isolated time
(medians of 300 steps), four alternating passes; then bench forward's back-to-back time.
One JSON object a line, microseconds."""

from __future__ import annotations

import json
import statistics
import time

import torch
from s41_step_host import build_decode1

from rackserve.device import PinnedStaging

AFTER_UPLOAD = PinnedStaging.upload


def fenced_upload(self, *args, **kwargs):
    out = AFTER_UPLOAD(self, *args, **kwargs)
    self.fence()
    return out


@torch.inference_mode()
def main() -> None:
    graphs, key, inputs, empty, _ = build_decode1()
    for _ in range(10):
        graphs.run(key, inputs, empty)
    torch.cuda.synchronize()
    result: dict = {}
    for arm in ("after", "copy") * 4:
        PinnedStaging.upload = AFTER_UPLOAD if arm == "after" else fenced_upload
        host, isolated = [], []
        for _ in range(300):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            graphs.run(key, inputs, empty)
            host.append(time.perf_counter() - t0)
            end.record()
            end.synchronize()
            isolated.append(start.elapsed_time(end) * 1e3)
        result.setdefault(arm, []).append(
            {
                "host_us": round(statistics.median(host) * 1e6, 2),
                "isolated_us": round(statistics.median(isolated), 2),
            }
        )
        print(json.dumps({arm: result[arm][-1]}), flush=True)
    PinnedStaging.upload = AFTER_UPLOAD
    print(json.dumps({"summary": result}), flush=True)


if __name__ == "__main__":
    main()
