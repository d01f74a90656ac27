"""Session 43: from prefill_bench's attention records (``--attention-only``), the fastest
wgmma tiling within the bf16 rule (at most 0.1% of outputs outside it) on the HCA layer and
on the CSA layer, printed as the statements that make ``prefill_attn_wgmma.default_tiling``
return the HCA one below ``WIDE_MIN_ROWS`` rows a query and the CSA one from it (for
device_env.sh's forward_with). Prints ``pass`` when a layer has no record.

    python benchmarks/sessions/s43_best_switches.py $R/attention.json
"""

from __future__ import annotations

import json
import sys

from prefill_bench import wgmma_variants


def best(records: list[dict], layer: str, names: set[str]) -> str | None:
    """The fastest wgmma variant of ``names`` on ``layer`` within the bf16 rule."""
    times = {
        r["impl"].removeprefix("wgmma:"): r["time_us"]
        for r in records
        if r.get("layer") == layer
        and r.get("impl", "").removeprefix("wgmma:") in names
        and r["impl"].startswith("wgmma:")
        and "time_us" in r
        and (r.get("outside_bf16_rule") or 0.0) <= 1e-3
    }
    return min(times, key=times.get) if times else None


def main() -> None:
    try:
        with open(sys.argv[1]) as f:
            records = json.load(f)
    except (OSError, ValueError):
        records = []
    variants = wgmma_variants()
    narrow, wide = (best(records, layer, set(variants)) for layer in ("hca", "csa"))
    if narrow is None or wide is None:
        print("pass")
        return
    print(f"# {narrow} below WIDE_MIN_ROWS rows a query, {wide} from it")
    print("import rackserve.ops.triton.prefill_attn_wgmma as w")
    print("from rackserve.ops.triton.prefill_attn_wgmma import WgmmaTiling")
    print(f"narrow, wide = {variants[narrow]!r}, {variants[wide]!r}")
    print("w.default_tiling = lambda rows: wide if rows >= w.WIDE_MIN_ROWS else narrow")


if __name__ == "__main__":
    main()
