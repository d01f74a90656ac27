"""What outlives the memory profile's graph capture (``memory_profile.graph_capture_bytes``):
the allocator's live blocks after it, each with the stack that allocated it, and the
runner's graphs against the profile (its memory with graphs less an eager runner's).
Tiny preset, bf16. Usage: python benchmarks/memory_profile_probe.py --output F.json"""

from __future__ import annotations

import argparse
import gc
import json

import torch

from rackserve.kv.spec import cache_groups_for
from rackserve.model.create import init_model_
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.model.presets import preset_config
from rackserve.runner.memory_profile import graph_capture_bytes
from rackserve.runner.model_runner import ModelRunner


def reserved() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def live_blocks(snapshot: dict, since: set[int]) -> list[dict]:
    """Allocated blocks of segments not in ``since`` (addresses), largest first."""
    out = []
    for seg in snapshot["segments"]:
        if seg["address"] in since:
            continue
        for block in seg["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = [f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}"
                      for f in block.get("frames", [])
                      if "python" not in f["filename"] or "rackserve" in f["filename"]]  # fmt: skip
            out.append({"bytes": block["size"], "stream": seg["stream"], "frames": frames[:12]})
    return sorted(out, key=lambda b: -b["bytes"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    with torch.device("cuda"):
        model = DeepseekV4ForCausalLM(preset_config("tiny"), with_mtp=False)
    model = init_model_(model.cast(torch.bfloat16), seed=0).eval()
    size = model.head.weight.element_size()
    groups = cache_groups_for(model.cfg, size, size)
    start = reserved()
    before = {seg["address"] for seg in torch.cuda.memory_snapshot()}
    torch.cuda.memory._record_memory_history(max_entries=100000)
    held, peak = graph_capture_bytes(model, groups, 64, 4096, 2048)
    after = reserved()
    blocks = live_blocks(torch.cuda.memory._snapshot(), before)
    torch.cuda.memory._record_memory_history(enabled=None)
    record = {"held": held, "peak": peak, "left_after_profile": after - start}
    record["live_blocks"] = blocks[:20]
    print(json.dumps({k: v for k, v in record.items() if k != "live_blocks"}))
    for b in blocks[:8]:
        print(b["bytes"] >> 10, "KiB, stream", b["stream"], " <- ".join(b["frames"][:6]))

    def runner_bytes(enforce_eager: bool) -> int:
        before = reserved()
        runner = ModelRunner(
            model, groups, {g.name: 64 for g in groups}, 64, 4096, (0,), log=False,
            enforce_eager=enforce_eager, max_num_batched_tokens=2048,
        )  # fmt: skip
        used = reserved() - before
        del runner
        gc.collect()
        return used

    eager = runner_bytes(True)
    with_graphs = runner_bytes(False)
    eager_again = runner_bytes(True)
    record |= {"runner_eager": eager, "runner_graphs": with_graphs, "runner_eager_2": eager_again}
    print(json.dumps({k: v for k, v in record.items() if k != "live_blocks"}))
    with open(args.output, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
