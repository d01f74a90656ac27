"""``--kv-cache-dtype fp8`` against the model-dtype cache: decode kernels' time and bytes, and
the logit error it costs.

Kernels (V4-Flash decode sizes): the paged sparse attention (H 64, Dh 512, Wa 128 window
rows + Wb 512 CSA picks of 640-wide entry rows, inverse RoPE on) and the paged indexer
(Hi 64, Di 128 keys in columns 512..639, E 1024 entries = 4K context, top-k 512), S in
{1, 8, 64, 256} queries, with bf16 caches ("bf16") and e4m3 caches ("fp8", the same values
cast). Each record: op, cache dtype, S, the compulsory bytes (rows read at the cache's
width + q + out), the median time (``do_bench`` and in a CUDA graph on a GPU; a wall-clock
median on CPU), the fraction of the H200's 4.8 TB/s, and the answer's distance from the
bf16-cache kernel (attention: max |diff|; indexer: the fraction of equal top-k picks).

Accuracy: the tiny model (random weights, seed 2), a 100-token prefill and 40 decode steps
with fp8 caches against the same model with model-dtype caches: mean |logit diff| over the
mean |logit|, max |diff| over the max |logit|, argmax agreement. CPU: the reference ops in
fp32 (the measured statement in docs/serving.md); GPU: the Triton kernels, fp32 and bf16.

    python benchmarks/kv_fp8_bench.py --output $OUT/kv_fp8_bench.json       # GPU
    python benchmarks/kv_fp8_bench.py --smoke --output /tmp/kv_fp8.json     # CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

FP8 = torch.float8_e4m3fn
H, DH, ROPE, WA, WB, ROW_B = 64, 512, 64, 128, 512, 640
HI, DI, ENTRIES, TOPK, PAGE = 64, 128, 1024, 512, 64
QUERIES = (1, 8, 64, 256)
PEAK_HBM = 4.8e12


def _time_us(fn: Callable[[], object], device: torch.device) -> tuple[float, float | None]:
    if device.type == "cuda":
        from bench_timing import time_us

        return time_us(fn)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times), None


def _attention_inputs(s: int, sizes: dict, device: torch.device) -> tuple:
    g = torch.Generator(device=device).manual_seed(s)
    h, dh, wa, wb = sizes["h"], sizes["dh"], sizes["wa"], sizes["wb"]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device)

    na, nb = 4 * s * wa, 4 * s * wb
    kv_a = randn(na, dh).bfloat16()
    kv_b = randn(nb, sizes["row_b"]).bfloat16()
    slots_a = torch.randperm(na, generator=g, device=device)[: s * wa].view(s, wa)
    slots_b = torch.randperm(nb, generator=g, device=device)[: s * wb].view(s, wb)
    valid = torch.ones(s, wa + wb, dtype=torch.bool, device=device)
    angle = torch.rand(s, sizes["rope"] // 2, generator=g, device=device) * 6.3
    q = (2 * randn(s, h, dh)).bfloat16()
    cos, sin = angle.cos().bfloat16(), angle.sin().bfloat16()
    return q, kv_a, slots_a, kv_b, slots_b, valid, randn(h), dh**-0.5, cos, sin


def _indexer_inputs(s: int, sizes: dict, device: torch.device) -> dict:
    g = torch.Generator(device=device).manual_seed(s + 7)
    e, page = sizes["entries"], sizes["page"]
    pages_per_query = e // page
    num_pages = s * pages_per_query + 1
    cache = torch.randn(num_pages * page, sizes["dh"] + sizes["di"], generator=g, device=device)
    pages = torch.randperm(num_pages - 1, generator=g, device=device)[: s * pages_per_query]
    pages = pages.view(s, pages_per_query) + 1
    entry = torch.arange(e, device=device)
    return {
        "q": torch.randn(s, sizes["hi"], sizes["di"], generator=g, device=device).bfloat16(),
        "key_cache": cache.bfloat16()[:, sizes["dh"] :],
        "slots": pages[:, entry // page] * page + entry % page,
        "weights": torch.randn(s, sizes["hi"], generator=g, device=device) * sizes["hi"] ** -0.5,
        "scale": sizes["di"] ** -0.5,
        "num_visible": torch.full((s,), e, device=device),
    }


def _record(op: str, cache: str, s: int, nbytes: int, fn: Callable, device) -> dict:
    plain, graph = _time_us(fn, device)
    best = graph if graph is not None else plain
    return {
        "kind": "kv_fp8_bench",
        "op": op,
        "kv_cache_dtype": cache,
        "queries": s,
        "bytes": nbytes,
        "time_us": plain,
        "graph_time_us": graph,
        "roofline_fraction": nbytes / PEAK_HBM / (best * 1e-6),
    }


def run_kernels(device: torch.device, queries: tuple[int, ...], sizes: dict) -> list[dict]:
    from rackserve.ops.triton import indexer, sparse_attn

    records = []
    for s in queries:
        args = _attention_inputs(s, sizes, device)
        base = sparse_attn.paged_sparse_attention(*args).float()
        for cache, element in (("bf16", 2), ("fp8", 1)):
            a = args if cache == "bf16" else (*args[:1], args[1].to(FP8), args[2],
                                              args[3].to(FP8), *args[4:])  # fmt: skip
            rows = sizes["wa"] + sizes["wb"]
            nbytes = s * rows * sizes["dh"] * element + 2 * s * sizes["h"] * sizes["dh"] * 2
            r = _record("sparse_attention", cache, s, nbytes,
                        lambda a=a: sparse_attn.paged_sparse_attention(*a), device)  # fmt: skip
            r["max_abs_diff_vs_bf16"] = (
                (sparse_attn.paged_sparse_attention(*a).float() - base).abs().max().item()
            )
            records.append(r)
        case = _indexer_inputs(s, sizes, device)
        k: int = sizes["topk"]
        picks = indexer.paged_indexer_topk(**case, k=k)
        for cache, element in (("bf16", 2), ("fp8", 1)):
            c = case if cache == "bf16" else {**case, "key_cache": case["key_cache"].to(FP8)}
            nbytes = s * sizes["entries"] * sizes["di"] * element + s * k * 8
            r = _record("indexer_topk", cache, s, nbytes,
                        lambda c=c, k=k: indexer.paged_indexer_topk(**c, k=k), device)  # fmt: skip
            got = indexer.paged_indexer_topk(**c, k=k)
            same = [
                len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(got, picks, strict=True)
            ]
            r["topk_overlap_vs_bf16"] = min(same)
            records.append(r)
    return records


def logit_error(device: torch.device, dtype: torch.dtype, kernels: str, steps: int) -> dict:
    """The tiny model's logits with fp8 caches against model-dtype caches (module doc)."""
    from rackserve.model.batch import KVCacheTensors
    from rackserve.model.create import init_model_
    from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
    from rackserve.model.generate import ContiguousCache
    from rackserve.model.presets import tiny_config

    cfg = tiny_config(vocab_size=512)
    with torch.device(device):
        model = DeepseekV4ForCausalLM(cfg, with_mtp=False, kernels=kernels)
    init_model_(model, seed=2)
    model = model.cast(dtype).eval()
    prefill = 100
    ids = torch.randint(2, 512, (prefill + steps,), generator=torch.Generator().manual_seed(3))
    ids = ids.to(device)

    def run(kv_dtype: torch.dtype | None) -> torch.Tensor:
        cache = ContiguousCache(model, 1, len(ids))
        blocks = {name: 1 + t.numel() for name, t in cache.block_tables.items()}
        cache.tensors = KVCacheTensors(cache.groups, blocks, dtype, device, kv_dtype)
        logits, done = [], 0
        with torch.inference_mode():
            for n in [prefill] + [1] * steps:
                meta = cache.batch([done], [n], [0])
                hidden, _ = model(ids[done : done + n], meta, cache.tensors)
                logits.append(model.compute_logits(hidden).float())
                done += n
        return torch.cat(logits)

    ref, fp8 = run(None), run(FP8)
    diff = (fp8 - ref).abs()
    return {
        "kind": "kv_fp8_logit_error",
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "kernels": kernels,
        "positions": len(ids),
        "mean_rel": (diff.mean() / ref.abs().mean()).item(),
        "max_rel": (diff.max() / ref.abs().max()).item(),
        "argmax_agreement": (fp8.argmax(-1) == ref.argmax(-1)).float().mean().item(),
    }


SMALL = {"h": 4, "dh": 64, "rope": 16, "wa": 16, "wb": 16, "row_b": 96, "hi": 4, "di": 32,
         "entries": 64, "topk": 16, "page": 16}  # fmt: skip
FULL = {"h": H, "dh": DH, "rope": ROPE, "wa": WA, "wb": WB, "row_b": ROW_B, "hi": HI, "di": DI,
        "entries": ENTRIES, "topk": TOPK, "page": PAGE}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", required=True)
    p.add_argument("--smoke", action="store_true", help="CPU sizes: seconds, checks it runs")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:  # the Triton interpreter (set before rackserve imports Triton)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if cuda else "cpu")
    sizes, queries = (SMALL, (1, 2)) if args.smoke or not cuda else (FULL, QUERIES)
    records = run_kernels(device, queries, sizes)
    if cuda:  # the Triton kernels end to end, as served (bf16) and strict (fp32)
        for dtype in (torch.float32, torch.bfloat16):
            records.append(logit_error(device, dtype, "auto", 40))
    else:  # the reference ops (the spec); --smoke: a few decode steps only
        records.append(logit_error(device, torch.float32, "reference", 4 if args.smoke else 40))
    with open(args.output, "w") as f:
        json.dump(records, f, indent=1)
    for r in records:
        print({k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()})


if __name__ == "__main__":
    main()
