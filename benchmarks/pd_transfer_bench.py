"""P/D KV transfer bandwidth: one request's KV (V4-Flash cache groups, or --preset tiny)
pulled from a producer process to a consumer process through the connector's own path
(ExportedRows.pack on the producer, the named transport, import_blocks on the consumer),
for request lengths 1K..128K tokens.

    python benchmarks/pd_transfer_bench.py --transport nccl --out pd_transfer.json
    (producer on cuda:0, consumer on cuda:1 when two GPUs are visible, else both on cuda:0)

CPU smoke run: ``--device cpu --transport tcp --lengths 1024,4096 --preset tiny``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import time
from pathlib import Path

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup(preset: str, max_tokens: int, device: str, dtype: torch.dtype):
    from rackserve.kv.spec import cache_groups_for
    from rackserve.model.batch import KVCacheTensors
    from rackserve.model.presets import preset_config

    cfg = preset_config(preset)
    groups = cache_groups_for(cfg, dtype_bytes=torch.tensor([], dtype=dtype).element_size())
    num_blocks = {
        g.name: (g.max_blocks_per_request or -(-max_tokens // g.block_tokens)) + 2 for g in groups
    }
    return groups, KVCacheTensors(groups, num_blocks, dtype, device)


def block_tables(groups, num_tokens: int) -> tuple[list[int], ...]:
    """One request's tables at ``num_tokens`` computed: full groups every block, sliding
    groups the live window pages (null before), block ids from 1."""
    tables = []
    for g in groups:
        num = -(-num_tokens // g.block_tokens)
        if g.is_sliding:
            first = g.first_live_slot(num_tokens)
            tables.append([0] * first + list(range(1, num - first + 1)))
        else:
            tables.append(list(range(1, num + 1)))
    return tuple(tables)


def producer(args, port: int, queue) -> None:
    from rackserve.disagg.store import KVStore
    from rackserve.disagg.transports import Fault, KVServer
    from rackserve.runner.kv_transfer import ExportedRows

    device = args.producer_device
    dtype = getattr(torch, args.dtype)
    groups, caches = _setup(args.preset, max(args.lengths), device, dtype)
    for tensors in caches.tensors.values():
        for t in tensors.values():
            t.normal_()
    store = KVStore(lease_s=600)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    server = KVServer(store, "127.0.0.1", port, Fault(), backend)
    for length in args.lengths:
        rows = ExportedRows(caches, block_tables(groups, length))
        store.put(f"len{length}", rows, num_consumers=args.repeats + 1)
    queue.put("ready")
    queue.get()  # the consumer is done
    server.close()


def consumer(args, port: int, queue, results) -> None:
    from rackserve.disagg.transports import FetchJob, KVClient
    from rackserve.runner.kv_transfer import import_blocks, packed_numel

    device = torch.device(args.consumer_device)
    dtype = getattr(torch, args.dtype)
    groups, caches = _setup(args.preset, max(args.lengths), str(device), dtype)
    backend = "nccl" if device.type == "cuda" else "gloo"
    client = KVClient(args.transport, lease_s=600, local_ip="127.0.0.1", backend=backend)
    assert queue.get() == "ready"
    records = []
    for length in args.lengths:
        tables = block_tables(groups, length)
        slots = [[i for i, b in enumerate(t) if b] for t in tables]
        ids = tuple([b for b in t if b] for t in tables)
        layout = ()  # whole: the region in one piece after the prefill (shm, and --whole)
        if args.transport in ("tcp", "nccl") and not args.whole:  # as serving pulls: in pieces
            tensors = [list(caches.tensors[name].values()) for name in caches.groups]
            layout = tuple((len(ts), ts[0][0].numel()) for ts in tensors)
        job = FetchJob("127.0.0.1", port, f"len{length}", slots, packed_numel(caches, ids),
                       dtype, device, layout)  # fmt: skip
        times = []
        for i in range(args.repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            region = client.fetch(job)
            import_blocks(caches, ids, region)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:  # the first pull builds the pair group
                times.append(time.perf_counter() - start)
        nbytes = region.numel() * region.element_size()
        best, median = min(times), statistics.median(times)
        records.append({
            "tokens": length, "bytes": nbytes, "best_s": best, "median_s": median,
            "gb_per_s": nbytes / median / 1e9, "transport": args.transport,
            "producer": args.producer_device, "consumer": args.consumer_device,
            "preset": args.preset, "dtype": args.dtype, "streamed": bool(layout),
        })  # fmt: skip
        print(f"{length:>7} tokens {nbytes / 2**20:9.1f} MiB  {nbytes / median / 1e9:7.2f} GB/s",
              flush=True)  # fmt: skip
    queue.put("done")
    results.put(records)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transport", default="nccl", choices=("tcp", "shm", "nccl"))
    p.add_argument("--preset", default="v4-flash")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--lengths", default="1024,4096,16384,32768,65536,131072")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--whole", action="store_true", help="tcp/nccl: the region in one piece (serving streams)"
    )
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    if args.device == "cuda":
        n = torch.cuda.device_count()
        args.producer_device, args.consumer_device = "cuda:0", f"cuda:{1 if n > 1 else 0}"
    else:
        args.producer_device = args.consumer_device = "cpu"
    ctx = mp.get_context("spawn")
    port, queue, results = _free_port(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=producer, args=(args, port, queue)),
        ctx.Process(target=consumer, args=(args, port, queue, results)),
    ]
    for proc in procs:
        proc.start()
    records = results.get(timeout=3600)
    for proc in procs:
        proc.join(60)
    if args.out:
        args.out.write_text(json.dumps(records, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
