"""Times the paged indexer top-k and the norm / rope kernels (Triton) against their torch
references on the GPU, at V4-Flash sizes.

Indexer: Hi=64, Di=128, bf16 keys in columns 512..639 of 640-wide csa_kv rows reached
through shuffled 64-entry pages, top-k 512, every entry visible; S in {1, 64, 256} and E in
{1024 (4K context), 16384 (64K)}. Rows: "triton" (logits + torch.topk), "triton:logits"
(the logits kernel alone), "torch.topk" (the selection alone), "triton:<tiling>" variants,
"reference". Norm / rope at T in {1, 64, 8192}: attention's q (unweighted norm + rope, [T,
64, 512]), kv (weighted, [T, 512]), the indexer q rope ([T, 64, 128]), the inverse rope of
the attention output, the q_lora norm ([T, 1024]).

Selection alone ("select_topk", ``select_topk.topk_packed`` on packed int64 keys): prefill
sizes S in {2048, 8192} x E in {2048, 4096, 8192}, k = 512, rows "full" (every entry a
random logit) and "causal" (row i sees ceil(E (i + 1) / S) entries, the rest -inf, as a
prefill's queries do: rows with fewer than k tie at -inf). Impls: "bitonic" (the
one-program tl.topk up to 2048 entries, chunk-wise levels above: the defaults before the
radix select), "bitonic_one" (one program at every E), "radix" (``topk.py``, one counted
bit a pass) and its digit widths ("radix_b5", "radix_b8") and warps ("radix_w<n>"),
"default" (``default_tiling``), "torch.topk". Records add the keys' GB/s (S * E * 8 bytes
over the time) and whether the ids equal ``torch.topk``'s.

Each record: op, impl, shape, the compulsory bytes (inputs read once, outputs written once)
and flops, the median time with ``triton.testing.do_bench`` (L2 flushed, launch included)
and inside a CUDA graph, the fraction of the H200 roofline (4.8 TB/s, 989 TFLOP/s), and for
Triton rows whether the answer equals the reference (ids) or its max |error|.

    from benchmarks.indexer_bench import run; records = run()      # the lead's one-call script
    python benchmarks/indexer_bench.py --output $OUT/indexer_bench.json
    python benchmarks/indexer_bench.py --select-only --output $OUT/indexer_select.json
    TRITON_INTERPRET=1 python benchmarks/indexer_bench.py --smoke --output /tmp/s.json  # CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable

import torch

from rackserve.ops import reference
from rackserve.ops.triton import indexer, indexer_tiling, norm_rope, select_topk, topk

from bench_timing import stamped, time_us

PEAK_HBM, PEAK_FLOPS = 4.8e12, 989e12
HEADS, DIM, TOPK, KV_DIM, PAGE = 64, 128, 512, 512, 64
QUERIES, ENTRIES = (1, 64, 256), (1024, 16384)
TOKENS = (1, 64, 8192)
EPS = 1e-6
SELECT_QUERIES, SELECT_ENTRIES, SELECT_ROWS = (2048, 8192), (2048, 4096, 8192), ("full", "causal")


def _record(op: str, impl: str, shape: dict, nbytes: int, flops: int, fn: Callable) -> dict:
    plain, graph = time_us(fn)
    best = graph if graph is not None else plain
    roofline_us = max(nbytes / PEAK_HBM, flops / PEAK_FLOPS) * 1e6
    return {
        "kind": "indexer_bench",
        "op": op,
        "impl": impl,
        **shape,
        "bytes": nbytes,
        "flops": flops,
        "time_us": plain,
        "graph_time_us": graph,
        "roofline_us": roofline_us,
        "roofline_fraction": roofline_us / best,
    }


def indexer_case(s: int, e: int, device: str) -> dict:
    """Inputs of ``paged_indexer_topk``: each query its own request, pages shuffled."""
    g = torch.Generator(device=device).manual_seed(s * e)
    pages_per_query = e // PAGE
    num_pages = s * pages_per_query + 1
    cache = torch.randn(
        num_pages * PAGE, KV_DIM + DIM, generator=g, device=device, dtype=torch.bfloat16
    )
    pages = torch.randperm(num_pages - 1, generator=g, device=device)[: s * pages_per_query]
    pages = pages.view(s, pages_per_query) + 1  # page 0: the null block
    entry = torch.arange(e, device=device)
    return {
        "q": torch.randn(s, HEADS, DIM, generator=g, device=device).bfloat16(),
        "key_cache": cache[:, KV_DIM:],
        "slots": pages[:, entry // PAGE] * PAGE + entry % PAGE,
        "weights": torch.randn(s, HEADS, generator=g, device=device) * HEADS**-0.5,
        "scale": DIM**-0.5,
        "num_visible": torch.full((s,), e, device=device),
    }


def _indexer_variants(
    s: int, e: int, device: torch.device
) -> dict[str, indexer_tiling.IndexerTiling]:
    """Tilings around the default, to pick the defaults from the first GPU run."""
    base = indexer_tiling.default_tiling(s, e, device)
    tiles_per_query = -(-e // base.block_e)
    variants = {
        "e32": indexer_tiling.IndexerTiling(32, base.tiles, 4, 3),
        "e128_w8": indexer_tiling.IndexerTiling(128, max(1, base.tiles // 2), 8, 3),
        "tiles1": indexer_tiling.IndexerTiling(base.block_e, 1, 4, 3),
        "tiles4x": indexer_tiling.IndexerTiling(base.block_e, min(64, 4 * base.tiles), 4, 3),
        "stages1": indexer_tiling.IndexerTiling(base.block_e, base.tiles, 4, 1),
        "warps8": indexer_tiling.IndexerTiling(base.block_e, base.tiles, 8, 3),
        "select_torch": dataclasses.replace(base, triton_select_max_entries=0),
        "select_triton": dataclasses.replace(base, triton_select_max_entries=e),
    }
    if e <= topk.RADIX_MAX_ENTRIES:  # the radix select at decode sizes too
        variants["select_radix"] = dataclasses.replace(
            base, select_algorithm="radix", triton_select_max_entries=topk.RADIX_MAX_ENTRIES
        )
    if e > base.triton_select_max_entries:
        # rows over the one-program limit: chunk-wise top-k levels (the default) vs the
        # first M2 path (torch.topk), other chunk sizes and limits
        variants |= {
            "select_long_torch": dataclasses.replace(base, select_chunk=0),
            "select_chunk1024": dataclasses.replace(base, select_chunk=1024),
            "select_chunk4096": dataclasses.replace(base, select_chunk=4096),
            "select_max4096": dataclasses.replace(base, triton_select_max_entries=4096),
        }
    return {k: v for k, v in variants.items() if v.tiles <= max(tiles_per_query, 1)}


def run_indexer(device: str = "cuda", sweep: bool = True) -> list[dict]:
    dev = torch.device(device)
    records = []
    for e in ENTRIES:
        for s in QUERIES:
            case = indexer_case(s, e, device)
            k = min(TOPK, e)
            shape = {"queries": s, "entries": e, "heads": HEADS, "dim": DIM, "k": k}
            nbytes = s * e * (2 * DIM + 8) + s * HEADS * (2 * DIM + 4) + s * k * 8
            flops = 2 * s * e * HEADS * DIM
            expected = reference.paged_indexer_topk(**case, k=k)
            tilings = {"triton": None}
            if sweep:
                tilings |= {f"triton:{n}": t for n, t in _indexer_variants(s, e, dev).items()}
            for impl, tiling in tilings.items():

                def fast(tiling=tiling, case=case, k=k):
                    return indexer.paged_indexer_topk(**case, k=k, tiling=tiling)

                rec = _record("paged_indexer_topk", impl, shape, nbytes, flops, fast)
                rec["tiling"] = str(tiling or indexer_tiling.default_tiling(s, e, dev))
                rec["equal_to_reference"] = bool(torch.equal(fast(), expected))
                records.append(rec)
            packed = indexer.indexer_logits(**case, packed=True)
            records.append(
                _record(
                    "paged_indexer_topk",
                    "triton:logits",
                    shape,
                    nbytes - s * k * 8 + s * e * 8,
                    flops,
                    lambda case=case: indexer.indexer_logits(**case, packed=True),
                )
            )
            records.append(
                _record(
                    "paged_indexer_topk",
                    "torch.topk",
                    shape,
                    s * e * 8 + s * k * 8,
                    0,
                    lambda packed=packed, k=k: packed.topk(k, dim=-1),
                )
            )
            records.append(
                _record(
                    "paged_indexer_topk",
                    "reference",
                    shape,
                    nbytes,
                    flops,
                    lambda case=case, k=k: reference.paged_indexer_topk(**case, k=k),
                )
            )
            del case, packed, expected
            torch.cuda.empty_cache()
    return records


def select_case(s: int, e: int, rows: str, device: str) -> torch.Tensor:
    """[S, E] packed keys (``reference.packed_earliest``) of random logits; "causal": row i
    keeps its first ceil(E (i + 1) / S) entries, the rest -inf."""
    g = torch.Generator(device=device).manual_seed(s + e)
    scores = torch.randn(s, e, generator=g, device=device)
    if rows == "causal":
        visible = (torch.arange(1, s + 1, device=device) * e + s - 1) // s
        hidden = torch.arange(e, device=device)[None, :] >= visible[:, None]
        scores = scores.masked_fill(hidden, float("-inf"))
    return reference.packed_earliest(scores)


def _select_variants(
    s: int, e: int, device: torch.device
) -> dict[str, indexer_tiling.IndexerTiling]:
    """The one-program-per-query selections at (S, E): bitonic as before, radix variants."""
    bitonic = indexer_tiling.IndexerTiling(64, 1, 4, 3)  # the limit 2048 and chunk 2048 defaults
    radix = dataclasses.replace(
        bitonic, select_algorithm="radix", triton_select_max_entries=topk.RADIX_MAX_ENTRIES
    )
    warps = topk.default_warps(e)
    variants = {
        "bitonic": bitonic,
        "bitonic_one": dataclasses.replace(bitonic, triton_select_max_entries=e),
        "radix": radix,
        "radix_b5": dataclasses.replace(radix, radix_bits=5),
        "radix_b8": dataclasses.replace(radix, radix_bits=8),
        f"radix_w{warps // 2}": dataclasses.replace(radix, radix_warps=warps // 2),
        "default": indexer_tiling.default_tiling(s, e, device),
    }
    if warps < 32:
        variants[f"radix_w{2 * warps}"] = dataclasses.replace(radix, radix_warps=2 * warps)
    return variants


def run_select(device: str = "cuda", smoke: bool = False) -> list[dict]:
    """Selection records (the module docstring); ``smoke``: tiny shapes, ids checked, no
    timing (the CPU under the interpreter)."""
    dev = torch.device(device)
    queries, entries, k = ((4,), (64, 96), 16) if smoke else (SELECT_QUERIES, SELECT_ENTRIES, TOPK)
    records = []
    for e in entries:
        for s in queries:
            for rows in SELECT_ROWS:
                packed = select_case(s, e, rows, device)
                expected = packed.topk(k, dim=-1).indices
                shape = {"queries": s, "entries": e, "k": k, "rows": rows}
                key_bytes = s * e * 8
                impls = {"torch.topk": lambda packed=packed: packed.topk(k, dim=-1).indices}
                for name, tiling in _select_variants(s, e, dev).items():
                    impls[name] = lambda packed=packed, t=tiling: select_topk.topk_packed(
                        packed, k, t
                    )
                for impl, fn in impls.items():
                    equal = bool(torch.equal(fn(), expected))
                    if smoke:
                        rec = {"kind": "indexer_bench", "op": "select_topk", "impl": impl, **shape}
                        rec |= {"time_us": None, "graph_time_us": None, "roofline_fraction": 0.0}
                    else:
                        rec = _record("select_topk", impl, shape, key_bytes + s * k * 8, 0, fn)
                        graph = rec["graph_time_us"]
                        rec["keys_gb_per_s"] = key_bytes / rec["time_us"] / 1e3
                        rec["graph_keys_gb_per_s"] = graph and key_bytes / graph / 1e3
                    rec["equal_to_reference"] = equal
                    records.append(rec)
                del packed, expected
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    return records


def _norm_rope_ops(t: int, device: str) -> dict[str, tuple[Callable, Callable, int]]:
    """op name -> (kernel, reference, bytes) on V4-Flash activations of T tokens."""
    g = torch.Generator(device=device).manual_seed(t)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device).bfloat16()

    positions = torch.randint(0, 65536, (t,), generator=g, device=device)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(32, device=device) / 32))
    cos, sin = reference.rope_cos_sin(positions, inv_freq, 1.0, torch.bfloat16)
    neg_sin = -sin
    q, kv, iq, lora = randn(t, 64, 512), randn(t, 512), randn(t, 64, 128), randn(t, 1024)
    w512 = torch.rand(512, device=device) + 0.5
    w1024 = torch.rand(1024, device=device) + 0.5
    trig = 2 * cos.numel() * 2

    def nbytes(x: torch.Tensor, with_trig: bool = True) -> int:
        return 2 * x.numel() * x.element_size() + (trig if with_trig else 0)

    return {
        "q_norm_rope": (
            lambda: norm_rope.rms_norm_rope(q, None, EPS, cos, sin),
            lambda: reference.rms_norm_rope(q, None, EPS, cos, sin),
            nbytes(q),
        ),
        "kv_norm_rope": (
            lambda: norm_rope.rms_norm_rope(kv, w512, EPS, cos, sin),
            lambda: reference.rms_norm_rope(kv, w512, EPS, cos, sin),
            nbytes(kv) + 512 * 4,
        ),
        "index_q_rope": (
            lambda: norm_rope.apply_rope(iq, cos, sin),
            lambda: reference.apply_rope(iq, cos, sin),
            nbytes(iq),
        ),
        "out_inverse_rope": (
            lambda: norm_rope.apply_rope(q, cos, neg_sin),
            lambda: reference.apply_rope(q, cos, neg_sin),
            nbytes(q),
        ),
        "q_lora_norm": (
            lambda: norm_rope.rms_norm(lora, w1024, EPS),
            lambda: reference.rms_norm(lora, w1024, EPS),
            nbytes(lora, with_trig=False) + 1024 * 4,
        ),
    }


def run_norm_rope(device: str = "cuda") -> list[dict]:
    records = []
    for t in TOKENS:
        for op, (kernel, ref, nbytes) in _norm_rope_ops(t, device).items():
            shape = {"tokens": t}
            rec = _record(op, "triton", shape, nbytes, 0, kernel)
            rec["max_abs_err"] = (kernel().float() - ref().float()).abs().max().item()
            records += [rec, _record(op, "reference", shape, nbytes, 0, ref)]
    return records


def run(device: str = "cuda", sweep: bool = True, select_only: bool = False) -> list[dict]:
    """Benchmark records of every part (see the module docstring)."""
    records = run_select(device)
    if not select_only:
        records = run_indexer(device, sweep) + records + run_norm_rope(device)
    dev = torch.device(device)
    return stamped(records, dev)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--no-sweep", action="store_true", help="default tilings only")
    parser.add_argument("--select-only", action="store_true", help="the selection part only")
    parser.add_argument(
        "--smoke", action="store_true", help="selection at tiny sizes, ids checked, no timing"
    )
    args = parser.parse_args()
    if args.smoke:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        records = stamped(run_select(device, smoke=True), torch.device(device))
    else:
        records = run(sweep=not args.no_sweep, select_only=args.select_only)
    with open(args.output, "w") as f:
        json.dump(records, f, indent=1)
    for r in records:
        shape = f"S={r['queries']} E={r['entries']}" if "queries" in r else f"T={r['tokens']}"
        if r["op"] == "select_topk":
            shape += f" k={r['k']} {r['rows']}"
        if r["time_us"] is None:
            print(f"{r['op']:18s} {shape:28s} {r['impl']:22s} equal {r['equal_to_reference']}")
            continue
        graph = r["graph_time_us"]
        rate = f" {r['keys_gb_per_s']:7.1f} GB/s of keys" if "keys_gb_per_s" in r else ""
        print(
            f"{r['op']:18s} {shape:28s} {r['impl']:22s} {r['time_us']:9.1f} us "
            f"graph {graph if graph is None else round(graph, 1)} us "
            f"{100 * r['roofline_fraction']:5.1f}% of roofline{rate}"
        )


if __name__ == "__main__":
    main()
