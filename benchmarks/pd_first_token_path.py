"""Where a P/D prefill engine's t1 waits: the time from the sampled token on the host (the
runner's execute / collect returned) to step() returning its outputs ("post"), and the work
the loop does after sending them ("after": flush_kv_exports), per variant:
  agg    aggregated engine
  old    producer, export inside update (as before the fix), pageable index upload
  defer  producer, export after the outputs, pageable index upload
  new    producer, export after the outputs, pinned non-blocking index (the tree as is)
idle: one request at a time; loaded: one long decode running beside it.
usage: python3 benchmarks/pd_first_token_path.py MODEL DEVICE LENGTHS REPS [async]
(session 15, 2026-12-03: the "old" variant re-runs the export inside update by a patch)"""

import statistics
import sys
import time
from dataclasses import replace

import torch

import rackserve.runner.kv_transfer as kvt
from rackserve.config import CacheConfig, DisaggConfig, EngineConfig, ModelConfig, SchedulerConfig
from rackserve.engine.core import EngineCore
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.parallel.groups import free_port_block
from rackserve.request import KVTransferParams, SamplingParams

model, device, lengths, reps = (
    sys.argv[1],
    sys.argv[2],
    [int(x) for x in sys.argv[3].split(",")],
    int(sys.argv[4]),
)
use_async = len(sys.argv) > 5 and sys.argv[5] == "async"
pinned_index = kvt.device_index


def pageable_index(ids, tensors):
    index = torch.tensor(ids, dtype=torch.long)
    return index.to(tensors[0].device) if tensors else index


def make(producer):
    kv = (
        DisaggConfig(kv_role="kv_producer", kv_connector="tcp", kv_port=free_port_block(4))
        if producer
        else None
    )
    mem = (8 << 30) if device == "cuda" else (256 << 20)
    cfg = EngineConfig(
        model=model,
        model_config=ModelConfig.from_pretrained(model),
        cache=CacheConfig(kv_cache_memory=mem),
        scheduler=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=max(lengths) + 16,
            max_model_len=min(
                max(lengths) + 4096, ModelConfig.from_pretrained(model).max_position_embeddings
            ),
            async_scheduling=use_async,
        ),
        device=device,
        enforce_eager=True,
        kv_transfer=kv,
    )
    return EngineCore(cfg, log_stats=False)


def one(core, variant, n, i):
    rid = f"{variant}-{n}-{i}"
    p = SamplingParams(max_tokens=1, temperature=0.0)
    if variant != "agg":
        p = replace(p, kv_transfer_params=KVTransferParams(do_remote_decode=True, transfer_id=rid))
    vocab = core.model.cfg.vocab_size
    ids = torch.randint(2, vocab - 1, (n,), generator=torch.Generator().manual_seed(i)).tolist()
    core.add_request(EngineCoreRequest(rid, ids, p, time.time()))
    runner, t = core.runner, {}
    name = "collect" if use_async else "execute"
    orig = getattr(runner, name)

    def timed(*a):
        out = orig(*a)
        if (
            "sampled" not in t
            and rid in out.req_ids
            and out.sampled_token_ids[out.req_ids.index(rid)]
        ):
            t["sampled"] = time.perf_counter()
        return out

    setattr(runner, name, timed)
    sched_update = core.scheduler.update
    if variant == "old":

        def update_and_export(*a):
            out = sched_update(*a)
            core.kv_connector.export_finished()
            return out

        core.scheduler.update = update_and_export
    post = None
    while post is None:
        out = core.step()
        end = time.perf_counter()
        if any(o.request_id == rid and o.new_token_ids for o in out.outputs):
            post = end - t["sampled"]
    a0 = time.perf_counter()
    core.flush_kv_exports()
    after = time.perf_counter() - a0
    for attr in (name, "update"):
        (runner if attr == name else core.scheduler).__dict__.pop(attr, None)
    while core.scheduler.requests.get(rid) is not None:
        core.step()
    if core.kv_connector is not None:
        core.kv_connector.store.clear()
    return post, after


results = []
for producer in (False, True):
    core = make(producer)
    variants = ("old", "defer", "new") if producer else ("agg",)
    for loaded in (False, True):
        if loaded:  # a long decode beside: every step (and the one in flight) has work
            bg = SamplingParams(max_tokens=100000, temperature=0.0, ignore_eos=True)
            core.add_request(EngineCoreRequest("bg", list(range(2, 66)), bg, time.time()))
            for _ in range(3):
                core.step()
        for variant in variants:
            kvt.device_index = pageable_index if variant in ("old", "defer") else pinned_index
            for n in lengths:
                for i in range(2):
                    one(core, variant, n, 10_000 + i)
                res = [one(core, variant, n, i) for i in range(reps)]
                post = statistics.median(r[0] for r in res) * 1e3
                after = statistics.median(r[1] for r in res) * 1e3
                mode = f"{'async' if use_async else 'sync '} {'loaded' if loaded else 'idle  '}"
                line = (
                    f"{mode} {variant:5s} prompt={n:6d}: post-sample {post:7.3f} ms, "
                    f"after-send {after:7.3f} ms"
                )
                print(line, flush=True)
        if loaded:
            core.abort_requests(["bg"])
            while core.has_unfinished_requests():
                core.step()
    kvt.device_index = pinned_index
    core.shutdown()
    del core
    if device == "cuda":
        torch.cuda.empty_cache()
