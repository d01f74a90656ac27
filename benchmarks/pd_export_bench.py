"""Host time of one finished request's KV export (ExportedRows: what the producer's loop
pays) on V4-Flash cache groups, 4 and 43 layers, bf16: idle stream, and with ~20 ms of
work queued on the stream (a step in flight): pageable (the old index upload) vs pinned."""

import statistics
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from pd_transfer_bench import block_tables

import rackserve.runner.kv_transfer as kvt
from rackserve.kv.spec import cache_groups_for
from rackserve.model.batch import KVCacheTensors
from rackserve.model.presets import preset_config

pinned = kvt.device_index


def pageable(ids, tensors):
    index = torch.tensor(ids, dtype=torch.long)
    return index.to(tensors[0].device) if tensors else index


dev = "cuda"
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)


def busy(ms):  # queue about ms of matmuls
    for _ in range(max(1, int(ms / 0.7))):
        torch.mm(a, a)


for L in (4, 43):
    groups = cache_groups_for(preset_config("v4-flash", num_layers=L), dtype_bytes=2)
    num_blocks = {
        g.name: (g.max_blocks_per_request or -(-32768 // g.block_tokens)) + 2 for g in groups
    }
    caches = KVCacheTensors(groups, num_blocks, torch.bfloat16, dev)
    for length in (1024, 8192, 32768):
        table = block_tables(groups, length)
        for name, fn in (("pageable", pageable), ("pinned", pinned)):
            kvt.device_index = fn
            for queued in (0, 20):
                times, kept = [], []
                for _ in range(12):
                    torch.cuda.synchronize()
                    if queued:
                        busy(queued)
                    t = time.perf_counter()
                    kept.append(kvt.ExportedRows(caches, table))
                    times.append(time.perf_counter() - t)
                    if len(kept) > 4:
                        kept.pop(0)
                torch.cuda.synchronize()
                cold, warm = times[0] * 1e3, statistics.median(times[2:]) * 1e3
                print(
                    f"layers={L:2d} tokens={length:6d} {name:8s} queued={queued:2d}ms: "
                    f"host {warm:7.3f} ms (first {cold:7.3f})",
                    flush=True,
                )
    del caches
    torch.cuda.empty_cache()
kvt.device_index = pinned
