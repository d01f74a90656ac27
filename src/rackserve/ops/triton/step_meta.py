"""A CUDA-graph decode step's metadata in a few launches (equals ``StepMetadata.build`` with
every token a closing candidate, as ``DecodeGraphs`` calls it).

``StepMetadata.build`` derives the slot of every row a step reads or writes with torch ops:
about 115 small kernels at batch 1 for the v4-flash cache groups (a table gather per group,
~6 ops per ``paged_slots``, the compression plans). Captured in the decode graph they were
most of the difference between the graph's 227 kernels and the eager forward's 100
(2026-12-01-h200-s3-final-graph-gap.json). Here every group takes one launch of one kernel
(``KIND`` picks what it derives), reading the block tables in place through the requests'
table rows: 5 launches for the v4-flash groups, one per group and compression plan, the
compression plans writing their state groups' slot mappings too, and the first the token
mask (padding: the null row) and the zeroed expert counts of the graph.

The slot rule is ``model.batch.paged_slots``'s: ``table[row, c] * per_block + i % per_block``
for a non-negative index i, with c = (i // per_block) % cols in a sliding group's ring and
min(i // per_block, cols - 1) in a linear table. A test compares every
field with ``StepMetadata.build`` (tests/runner/test_graph_launches.py), so a change of
that rule shows there.

Shape legend: T tokens (one per request in a decode graph), W window, E entries per query
(``max_seq_len // ratio``), span state rows pooled per entry (r, or 2r with CSA's overlap).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch
import triton
import triton.language as tl

from rackserve.kv.spec import CacheGroupSpec
from rackserve.model.batch import Compression, Gather, StepMetadata
from rackserve.ops.triton.common import pdl, pdl_wait

WINDOW, ENTRIES, COMPRESS = 0, 1, 2  # what one launch derives (the KIND constexpr)


@triton.jit
def _lookup(table_ptr, stride, cols, per_block, row, idx, RING: tl.constexpr):
    """Slots of non-negative indices ``idx`` in table row ``row`` (paged_slots' rule:
    ``RING``, a sliding group's ring of ``cols`` columns; else a clamped linear table)."""
    col = idx // per_block
    col = col % cols if RING else tl.minimum(col, cols - 1)
    block = tl.load(table_ptr + row * stride + col)
    return block * per_block + idx % per_block


@triton.jit
def _step_meta_kernel(
    pos_ptr,  # [T] int64 positions
    req_ptr,  # [T] int64 request of each token
    rows_ptr,  # [R] int64 table row of each request
    mask_ptr,  # [T] uint8 out: the token mask (STORE_MASK)
    clear_ptr,  # [clear_numel] int64 zeroed (CLEAR)
    clear_numel,
    null_row,  # MASKED: a token on this row is padding
    table_ptr,  # the group's table [rows, cols] (int64)
    stride,
    cols,
    per_block,
    table2_ptr,  # COMPRESS: the entry group's table (dst)
    stride2,
    cols2,
    per_block2,
    slots_ptr,  # [T, M] int64: window / entry / state (src) slots
    flag_ptr,  # [T, M] uint8: window valid / entry valid / missing (STORE_FLAG)
    vec_ptr,  # [T] int64: WINDOW the last slot (slot mapping), ENTRIES num_visible, COMPRESS dst
    vec2_ptr,  # [T] int64: COMPRESS entry positions
    vec3_ptr,  # [T] int64: COMPRESS with STATE_SLOT: the token's own row in the state table
    both_ptr,  # [T, W + M] uint8: ENTRIES with BOTH: [window valid | entry valid]
    M,
    ratio,
    span,
    KIND: tl.constexpr,
    W: tl.constexpr,  # WINDOW: the window (= M); ENTRIES with BOTH: the window width
    STORE_SLOTS: tl.constexpr,
    STORE_FLAG: tl.constexpr,
    STORE_VEC: tl.constexpr,
    MASKED: tl.constexpr,  # padding tokens (on null_row) close no window
    STORE_MASK: tl.constexpr,  # write the token mask (row != null_row)
    CLEAR: tl.constexpr,  # program (0, 0) zeroes clear_ptr's ints (a step's accumulator)
    BOTH: tl.constexpr,
    STATE_SLOT: tl.constexpr,  # COMPRESS: also the state group's slot mapping (vec3)
    RING: tl.constexpr,  # the first table is a ring (sliding groups); table2 never is
    BLOCK: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_CLEAR: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl)
):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m_ok = m < M
    pos = tl.load(pos_ptr + t)
    row = tl.load(rows_ptr + tl.load(req_ptr + t))
    first = tl.program_id(1) == 0
    if STORE_MASK:  # the token's first program
        tl.store(mask_ptr + t, (row != null_row).to(tl.uint8), mask=first)
    if CLEAR:  # program (0, 0)
        for c0 in range(0, tl.where(first & (t == 0), clear_numel, 0), BLOCK_CLEAR):
            c = c0 + tl.arange(0, BLOCK_CLEAR)
            tl.store(clear_ptr + c, tl.zeros([BLOCK_CLEAR], tl.int64), mask=c < clear_numel)
    if KIND == 0:  # window rows pos-W+1 .. pos (M = W; M = 1: the slot mapping)
        idx = pos - (M - 1) + m
        flag = idx >= 0
        slot = _lookup(table_ptr, stride, cols, per_block, row, tl.maximum(idx, 0), RING)
        if STORE_VEC:
            tl.store(vec_ptr + t + m * 0, slot, mask=m_ok & (m == M - 1))
    elif KIND == 1:  # entries 0 .. M-1, visible once pos >= ratio * e + ratio - 1
        visible = (pos + 1) // ratio
        flag = m < visible
        slot = _lookup(table_ptr, stride, cols, per_block, row, m, RING)
        if first:
            tl.store(vec_ptr + t, visible)
        if BOTH:
            tl.store(both_ptr + t * (W + M) + W + m, flag.to(tl.uint8), mask=m_ok)
            if first:
                w = tl.arange(0, BLOCK_W).to(tl.int64)
                window_ok = (pos - (W - 1) + w >= 0).to(tl.uint8)
                tl.store(both_ptr + t * (W + M) + w, window_ok, mask=w < W)
    else:  # the state rows of the window this token would close (missing: before 0)
        entry = tl.maximum((pos + 1) // ratio - 1, 0)
        idx = entry * ratio - (span - ratio) + m
        flag = idx < 0
        slot = _lookup(table_ptr, stride, cols, per_block, row, tl.maximum(idx, 0), RING)
        if first:
            closes = (pos + 1) % ratio == 0
            if MASKED:
                closes = closes & (row != null_row)
            dst = _lookup(table2_ptr, stride2, cols2, per_block2, row, entry, False)
            tl.store(vec_ptr + t, tl.where(closes, dst, 0))
            tl.store(vec2_ptr + t, entry * ratio)
            if STATE_SLOT:  # the WINDOW launch of width 1 on the state table, folded in
                tl.store(vec3_ptr + t, _lookup(table_ptr, stride, cols, per_block, row, pos, RING))
    if STORE_SLOTS:
        tl.store(slots_ptr + t * M + m, slot, mask=m_ok)
    if STORE_FLAG:
        tl.store(flag_ptr + t * M + m, flag.to(tl.uint8), mask=m_ok)


def _launch(
    kind: int,
    width: int,
    positions: torch.Tensor,
    token_req: torch.Tensor,
    rows: torch.Tensor,
    null_row: int | None,
    table: tuple[torch.Tensor, int],
    *,
    store_mask: bool = False,
    clear: torch.Tensor | None = None,
    table2: tuple[torch.Tensor, int] | None = None,
    ratio: int = 1,
    span: int = 0,
    slots: bool = True,
    flag: bool = True,
    vec: bool = True,
    window: int = 0,
    ring: bool = False,
    state_slot: bool = False,
) -> dict[str, torch.Tensor]:
    """One launch over [T, width]; returns the outputs it wrote (slots, flag, vec, vec2,
    vec3, both, mask). ``null_row``: the padding's table row (its tokens close no window;
    None: no padding); ``store_mask``: write the token mask; ``clear``: an int64 buffer
    zeroed by program (0, 0)."""
    n, device = positions.shape[0], positions.device
    out: dict[str, torch.Tensor] = {}
    if slots:
        out["slots"] = torch.empty(n, width, dtype=torch.int64, device=device)
    if flag:
        out["flag"] = torch.empty(n, width, dtype=torch.bool, device=device)
    if vec:
        out["vec"] = torch.empty(n, dtype=torch.int64, device=device)
    if kind == COMPRESS:
        out["vec2"] = torch.empty(n, dtype=torch.int64, device=device)
        if state_slot:
            out["vec3"] = torch.empty(n, dtype=torch.int64, device=device)
    if kind == ENTRIES and window:
        out["both"] = torch.empty(n, window + width, dtype=torch.bool, device=device)
    if store_mask:
        out["mask"] = torch.empty(n, dtype=torch.bool, device=device)
    if n == 0:  # (width 0 still launches: ENTRIES writes num_visible)
        if clear is not None:
            clear.zero_()
        return out
    tab, per_block = table
    tab2, per_block2 = table2 if table2 is not None else table
    dummy = positions
    block = min(1024, triton.next_power_of_2(max(width, 1)))
    _step_meta_kernel[(n, max(1, triton.cdiv(width, block)))](
        positions, token_req, rows,
        out["mask"].view(torch.uint8) if store_mask else dummy,
        clear if clear is not None else dummy, 0 if clear is None else clear.numel(),
        -1 if null_row is None else null_row,
        tab, tab.stride(0), tab.shape[1], per_block,
        tab2, tab2.stride(0), tab2.shape[1], per_block2,
        out.get("slots", dummy), out["flag"].view(torch.uint8) if flag else dummy,
        out.get("vec", dummy), out.get("vec2", dummy), out.get("vec3", dummy),
        out["both"].view(torch.uint8) if "both" in out else dummy,
        width, ratio, span,
        KIND=kind, W=window if kind == ENTRIES else width, STORE_SLOTS=slots,
        STORE_FLAG=flag, STORE_VEC=vec, MASKED=null_row is not None, STORE_MASK=store_mask,
        CLEAR=clear is not None, BOTH="both" in out, STATE_SLOT="vec3" in out, RING=ring,
        BLOCK=block, BLOCK_W=max(2, triton.next_power_of_2(max(window, 1))), BLOCK_CLEAR=1024,
        num_warps=4, **pdl(positions.device),
    )  # fmt: skip
    return out


def _check(tables: Mapping[str, torch.Tensor], groups: Sequence[CacheGroupSpec]) -> None:
    for g in groups:
        t = tables.get(g.name)
        if t is None or t.dim() != 2 or t.dtype != torch.int64 or t.stride(1) != 1:
            raise ValueError(f"step_metadata: group {g.name!r} needs an int64 [rows, cols] table")


def step_metadata(
    groups: Sequence[CacheGroupSpec],
    positions: torch.Tensor,
    token_req: torch.Tensor,
    rows: torch.Tensor,
    tables: Mapping[str, torch.Tensor],
    max_seq_len: int,
    null_row: int | None = None,
    combined: Collection[str] = (),
    clear: torch.Tensor | None = None,
) -> StepMetadata:
    """``StepMetadata.build(groups, positions, token_req, {g: tables[g][rows]}, max_seq_len,
    {r: every token}, token_mask)``, without gathering the tables, where token_mask =
    ``rows[token_req] != null_row`` (the padding's tokens; None: no mask).

    positions, token_req: [T] int64; rows: [R] int64 table row of each request; tables:
    group -> the full [rows, cols] int64 device table. ``combined``: compressed groups
    whose [window | entries] validity (``window_and_entries_valid``, read by HCA layers) is
    written in the same launch. ``clear``: an int64 buffer the first launch zeroes (a
    graph's per-step accumulator, the expert counts: one launch fewer), as the token mask
    is written there (one more fewer).
    """
    _check(tables, groups)
    if any(t.dtype != torch.int64 for t in (positions, token_req, rows)):
        raise ValueError("step_metadata: positions, token_req and rows must be int64")
    if clear is not None and (clear.dtype != torch.int64 or not clear.is_contiguous()):
        raise ValueError("step_metadata: clear must be a contiguous int64 tensor")
    pos, req, rows = positions.contiguous(), token_req.contiguous(), rows.contiguous()
    swa = next(g for g in groups if g.name == "swa")
    common = (pos, req, rows, null_row)
    token_mask = None
    slot_mapping: dict[str, torch.Tensor] = {}
    gather: dict[str, Gather] = {}
    compression: dict[str, Compression] = {}
    derived: dict = {}

    def table(g: CacheGroupSpec) -> tuple[torch.Tensor, int]:
        return tables[g.name], g.entries_per_block

    # each compressed group's state group (its layers' window rows): the COMPRESS launch
    # reads the state's ring at each token's window and writes the state's slot mapping
    # too (one launch fewer a state group)
    states = {
        g.name: next(s for s in groups if s.window is not None and s.layer_ids == g.layer_ids)
        for g in groups
        if g.ratio > 1
    }
    folded = {s.name for s in states.values() if s.is_sliding}
    for g in groups:
        if g.name == "swa":  # the first launch: the token mask and the clear too
            out = _launch(WINDOW, g.window, *common, table(g), ring=True,
                          store_mask=null_row is not None, clear=clear)  # fmt: skip
            gather[g.name] = Gather(out["slots"], out["flag"])
            slot_mapping[g.name] = out["vec"]
            token_mask = out.get("mask")
        elif g.ratio == 1 and g.name in folded:
            continue
        elif g.ratio == 1:
            out = _launch(WINDOW, 1, *common, table(g), flag=False, vec=False,
                          ring=g.is_sliding)  # fmt: skip
            slot_mapping[g.name] = out["slots"].view(-1)
        else:
            num_entries = max_seq_len // g.ratio
            both = swa.window if g.name in combined and num_entries else 0
            out = _launch(ENTRIES, num_entries, *common, table(g), ratio=g.ratio,
                          window=both)  # fmt: skip
            gather[g.name] = Gather(out["slots"], out["flag"], out["vec"])
            if both:
                derived[("valid", g.name)] = out["both"]
            state = states[g.name]
            span = state.window
            assert span is not None
            fold = state.name in folded
            out = _launch(COMPRESS, span, *common, table(state), table2=table(g), ratio=g.ratio,
                          span=span, flag=span > g.ratio, ring=True, state_slot=fold)  # fmt: skip
            compression[g.name] = Compression(
                out["slots"], out.get("flag"), out["vec"], out["vec2"]
            )
            if fold:
                slot_mapping[state.name] = out["vec3"]
    return StepMetadata(
        pos, req, slot_mapping, gather, compression, max_seq_len, token_mask, derived
    )
