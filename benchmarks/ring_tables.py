"""Device block-table memory, linear vs sliding groups as rings (no GPU needed).

Every group's table is int64 [max_num_seqs + 1, columns] on the device (runner/step_buffers.py).
Linear: ceil(max_model_len / block_tokens) + 1 columns. Sliding groups as rings:
``CacheGroupSpec.ring_blocks(max_num_batched_tokens)`` columns, whatever max_model_len is.

Also the host cost of a decode step's table deltas (``BlockTables.append`` + ``drain_writes``)
with every request taking one new block, linear vs rings.

Usage: python benchmarks/ring_tables.py [--preset v4-flash] [--max-model-len 1048576 ...]
"""

from __future__ import annotations

import argparse
import time

from rackserve.kv.spec import cache_groups_for
from rackserve.model.presets import preset_config
from rackserve.runner.inputs import BlockTables, ring_widths, table_widths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="v4-flash")
    p.add_argument("--max-model-len", type=int, nargs="+", default=[4096, 65536, 1 << 20])
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    args = p.parse_args()
    groups = cache_groups_for(preset_config(args.preset))
    block_tokens = {g.name: g.block_tokens for g in groups}
    rings = ring_widths(groups, args.max_num_batched_tokens)
    rows = args.max_num_seqs + 1
    print(f"{args.preset}, {args.max_num_seqs} requests, steps of {args.max_num_batched_tokens}")
    for max_len in args.max_model_len:
        linear = table_widths(block_tokens, max_len)
        ring = table_widths(block_tokens, max_len, rings)
        cells = ", ".join(
            f"{name} {a}->{b}"
            for name, (a, _), (b, _) in zip(block_tokens, linear, ring, strict=True)
        )
        before = sum(rows * cols * 8 for cols, _ in linear)
        after = sum(rows * cols * 8 for cols, _ in ring)
        print(
            f"max_model_len {max_len}: columns {cells}; "
            f"{before / 1e6:.1f} MB linear -> {after / 1e6:.1f} MB with rings"
        )

    # host cost of one decode step's deltas: every request takes a page of the group with
    # the smallest blocks (csa_state on v4-flash: 8 tokens), the worst case
    small = min(range(len(groups)), key=lambda g: groups[g].block_tokens)
    delta = tuple([5] if g == small else [] for g in range(len(groups)))
    for label, widths in (("linear", None), ("rings", rings)):
        tables = BlockTables(block_tokens, args.max_num_seqs, 65536, widths)
        for i in range(args.max_num_seqs):
            tables.add(f"r{i}", tuple([1] for _ in groups))
        tables.drain_writes()
        per_step = float("inf")
        for _ in range(5):  # best of 5: the host may be shared
            steps, start = 100, time.perf_counter()
            for _ in range(steps):
                for i in range(args.max_num_seqs):
                    tables.append(f"r{i}", delta)
                tables.drain_writes()
            per_step = min(per_step, (time.perf_counter() - start) / steps)
        print(
            f"{label}: {per_step * 1e6:.0f} us per step of {args.max_num_seqs} one-block "
            "appends + drain_writes (best of 5)"
        )


if __name__ == "__main__":
    main()
