"""Session 43: from prefill_bench's attention records (``--attention-only``), the fastest
variant within the bf16 rule (at most 0.1% of outputs outside it) of the 32-row tiling on the
HCA layer and of the 64-row tiling on the CSA layer, as
the statements that make ``prefill_attn_wgmma.default_tiling`` return them (for
device_env.sh's forward_with). Prints ``pass`` when no record is there.

    python benchmarks/sessions/s43_best_switches.py $R/attention.json
"""

from __future__ import annotations

import dataclasses
import json
import sys

from prefill_bench import wgmma_variants


def best(records: list[dict], layer: str, base: str, names: set[str]) -> str | None:
    """The fastest ``wgmma:<base>...`` variant of ``names`` on ``layer`` within the bf16 rule."""
    times = {
        r["impl"].removeprefix("wgmma:"): r["time_us"]
        for r in records
        if r.get("layer") == layer
        and r.get("impl", "").removeprefix("wgmma:") in names
        and r["impl"].startswith(f"wgmma:{base}")
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
    narrow = best(records, "hca", "bn32_s4_p2", set(variants))
    wide = best(records, "csa", "bn64_s2_p1", set(variants))
    if narrow is None or wide is None:
        print("pass")
        return
    fields = [f.name for f in dataclasses.fields(variants[narrow]) if f.type in (bool, "bool")]
    pick = {n: {k: getattr(variants[n], k) for k in fields} for n in (narrow, wide)}
    print(f"# {narrow} below WIDE_MIN_ROWS rows a query, {wide} from it")
    print("import dataclasses, rackserve.ops.triton.prefill_attn_wgmma as w")
    print("original = w.default_tiling")
    print(
        f"w.default_tiling = lambda rows: dataclasses.replace(original(rows), "
        f"**({pick[wide]!r} if rows >= w.WIDE_MIN_ROWS else {pick[narrow]!r}))"
    )


if __name__ == "__main__":
    main()
