"""Times the decode-layer fusions of issue 12 (launches per layer) against the unfused ops
they replace, on the GPU at V4-Flash sizes, T in {1, 64, 256}:

- ``attention_prologue`` (q norm + RoPE [T, 64, 512], kv norm + RoPE into the window cache,
  the compressor's raw rows into the state cache, the indexer's q RoPE [T, 64, 128] and head
  weights) vs ``rms_norm_rope`` + ``kv_insert`` + ``apply_rope`` + the weights scaling;
- ``compress_entries`` (both CSA compressors, into the entry cache) vs 2 x ``compress_pool``
  + 2 index_put;
- ``select_entries`` (CSA picks' slots + mask) vs gather / compare / cat;
- ``route_fused`` (router + shared expert pick + expert counts) vs ``route`` + the counts.

Each record: op, impl ("fused" / "unfused"), T, bytes, median time (do_bench) and inside a
CUDA graph, fraction of 4.8 TB/s.

    from benchmarks.fusion_bench import run; records = run()
    python benchmarks/fusion_bench.py --output $OUT/fusion_bench.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from rackserve.ops import reference
from rackserve.ops.triton import attn_prologue, compress, norm_rope, route, select

from bench_timing import stamped, time_us

PEAK_HBM = 4.8e12
TOKENS = (1, 64, 256)
H, DH, HALF, HI, DI, QL = 64, 512, 32, 64, 128, 1024
STATE = 2 * (2 * DH) + 2 * (2 * DI)  # CSA state row: kv compressor + indexer compressor


def _record(op: str, impl: str, t: int, nbytes: int, fn: Callable) -> dict:
    plain, graph = time_us(fn)
    best = graph if graph is not None else plain
    return {
        "kind": "fusion_bench",
        "op": op,
        "impl": impl,
        "T": t,
        "bytes": nbytes,
        "time_us": plain,
        "graph_time_us": graph,
        "roofline_fraction": nbytes / PEAK_HBM / (best * 1e-6),
    }


def _prologue(t: int, dev: str) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(t)
    bf = torch.bfloat16
    x_proj = torch.randn(t, QL + DH + STATE + HI, generator=g, device=dev).to(bf)
    kv, rows = x_proj[:, QL : QL + DH], x_proj[:, QL + DH : QL + DH + STATE]
    head_logits = x_proj[:, QL + DH + STATE :]
    q_proj = torch.randn(t, H * DH + HI * DI, generator=g, device=dev).to(bf)
    q, iq = q_proj[:, : H * DH].view(t, H, DH), q_proj[:, H * DH :].view(t, HI, DI)
    pos = torch.arange(t, device=dev) + 4000
    inv_freq = 1.0 / (10000.0 ** (torch.arange(HALF, device=dev) / HALF))
    cos, sin = reference.rope_cos_sin(pos, inv_freq, 1.0, bf)
    swa = torch.zeros(4 * t + 64, DH, device=dev, dtype=bf)
    state = torch.zeros(4 * t + 64, STATE, device=dev, dtype=bf)
    slots = torch.randperm(4 * t + 63, generator=g, device=dev)[:t] + 1
    w = torch.ones(DH, device=dev)
    args = (q, kv, w, 1e-6, cos, sin, swa, slots, rows, state, slots, iq, head_logits, 0.125)

    def unfused():
        norm_rope.rms_norm_rope(q, None, 1e-6, cos, sin)
        norm_rope.kv_insert(kv, w, 1e-6, cos, sin, swa, slots, rows, state, slots)
        norm_rope.apply_rope(iq, cos, sin)
        return head_logits.float() * 0.125

    nbytes = 2 * (2 * t * H * DH + 2 * t * HI * DI + 2 * t * DH + 2 * t * STATE) + 6 * t * HI
    fused = lambda: attn_prologue.attention_prologue(*args)  # noqa: E731
    return [
        _record("attention_prologue", "fused", t, nbytes, fused),
        _record("attention_prologue", "unfused", t, nbytes, unfused),
    ]


def _compress(t: int, dev: str) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(t)
    r, span, n_slots = 4, 8, 8 * t + 64
    state = torch.randn(n_slots, STATE, generator=g, device=dev).bfloat16()
    src = torch.randperm(n_slots, generator=g, device=dev)[: t * span].view(t, span)
    missing = torch.zeros(t, span, dtype=torch.bool, device=dev)
    dst = torch.arange(t, device=dev) + 1
    entries = torch.zeros(t + 1, DH + DI, device=dev, dtype=torch.bfloat16)
    parts = [
        (0, torch.randn(r, 2 * DH, device=dev), torch.ones(DH, device=dev), 0),
        (4 * DH, torch.randn(r, 2 * DI, device=dev), torch.ones(DI, device=dev), DH),
    ]
    pos = torch.arange(t, device=dev) * r
    inv_freq = 1.0 / (10000.0 ** (torch.arange(HALF, device=dev) / HALF))
    tail = (1e-6, pos, inv_freq, 1.0)

    def unfused():
        for col, ape, nw, out_col in parts:
            new = compress.compress_pool(state, src, missing, col, ape, nw, *tail)
            entries[dst, out_col : out_col + nw.shape[0]] = new

    nbytes = t * span * STATE * 2 + t * (DH + DI) * 2
    fused = lambda: compress.compress_entries(state, src, missing, dst, entries, parts, *tail)  # noqa: E731
    return [
        _record("compress_entries", "fused", t, nbytes, fused),
        _record("compress_entries", "unfused", t, nbytes, unfused),
    ]


def _select(t: int, dev: str) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(t)
    e, k, w = 1024, 512, 128
    ids = torch.stack([torch.randperm(e, generator=g, device=dev)[:k] for _ in range(t)])
    slots = torch.randint(0, 1 << 20, (t, e), generator=g, device=dev)
    nv = torch.full((t,), e, device=dev)
    window = torch.ones(t, w, dtype=torch.bool, device=dev)
    nbytes = t * (k * 8 * 3 + w * 2 + k)
    args = (ids, slots, nv, window)
    return [
        _record("select_entries", "fused", t, nbytes, lambda: select.select_entries(*args)),
        _record("select_entries", "unfused", t, nbytes, lambda: reference.select_entries(*args)),
    ]


def _route(t: int, dev: str) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(t)
    d, e, k = 4096, 64, 6
    x = torch.randn(t, d, generator=g, device=dev).bfloat16()
    w = (torch.randn(e, d, generator=g, device=dev) / 64).bfloat16()
    bias = 0.1 * torch.randn(e, generator=g, device=dev)
    ids = torch.zeros(t, dtype=torch.int64, device=dev)
    counts = torch.zeros(e, dtype=torch.int64, device=dev)
    mask = torch.ones(t, dtype=torch.bool, device=dev)
    args = (x, w, bias, None, ids, k, "sqrtsoftplus", 1.5)

    def unfused():
        picked, weights = route.route(*args)
        ones = torch.ones_like(picked) * mask[:, None]
        counts.index_add_(0, picked.flatten(), ones.flatten())
        return picked, weights

    nbytes = x.numel() * 2 + w.numel() * 2 + t * (k + 1) * 12
    fused = lambda: route.route_fused(*args, e, counts, mask)  # noqa: E731
    return [
        _record("route_fused", "fused", t, nbytes, fused),
        _record("route_fused", "unfused", t, nbytes, unfused),
    ]


def run(device: str = "cuda") -> list[dict]:
    records = []
    for t in TOKENS:
        for part in (_prologue, _compress, _select, _route):
            records += part(t, device)
    return stamped(records, torch.device(device))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--output", default=None)
    out = run()
    for r in out:
        us = r["graph_time_us"] or r["time_us"]
        print(f"{r['op']:20s} {r['impl']:8s} T={r['T']:4d} {us:8.1f} us")
    if p.parse_args().output:
        with open(p.parse_args().output, "w") as f:
            json.dump(out, f, indent=1)
