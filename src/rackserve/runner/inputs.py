"""Pure input building: from the scheduled requests to the flat tensors of one step.

Shape legend: R scheduled requests, T = sum of their scheduled tokens.

For request r with ``num_computed`` tokens in the cache and ``n`` scheduled::

    token_ids   [0 ........ num_computed ........ num_computed + n ...... num_tokens)
                 |-- cached --|-- this step's input --|-- (spec / not yet) --|

It needs logits (for sampling) only when the step reaches its last known token.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rackserve.kv.spec import CacheGroupSpec


@dataclass(frozen=True)
class StepInputs:
    """Host arrays of one step; the runner uploads them in one copy."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    token_req: np.ndarray  # [T] int64 index of each token's request in this step
    query_start_loc: list[int]  # [R + 1]
    num_computed_tokens: list[int]  # [R]
    rows: list[int]  # [R]
    logits_indices: np.ndarray  # [S'] flat index of each sampled request's last 1 + drafts tokens
    sample_mask: list[bool]  # [R] whether request r samples this step
    max_seq_len: int  # the longest request after this step

    @property
    def is_uniform_decode(self) -> bool:
        """One new token per request, every request sampling: a CUDA-graph step."""
        return len(self.input_ids) == len(self.rows) and all(self.sample_mask)


def build_batch_inputs(
    token_ids: Sequence[list[int]],
    num_computed_tokens: list[int],
    num_scheduled_tokens: list[int],
    rows: list[int],
    num_draft_tokens: list[int] | None = None,
) -> StepInputs:
    """The flat inputs of R requests, given as columns (request r: ``token_ids[r]``, ...).

    ``num_draft_tokens[r]`` = m: the last m scheduled tokens are drafts to verify
    (``token_ids[r]`` ends with them); the request then needs logits at its last 1 + m
    tokens, in order (spec_decode/verify.py)."""
    num_reqs = len(token_ids)
    counts = np.array(num_scheduled_tokens, dtype=np.int64)  # [R]
    computed = np.array(num_computed_tokens, dtype=np.int64)  # [R]
    lengths = np.fromiter(map(len, token_ids), dtype=np.int64, count=num_reqs)  # [R]
    sample_mask = computed + counts >= lengths  # [R] the step reaches the last known token
    if num_reqs and counts.min() == counts.max() == 1:
        # Pure decode (the common step): one token per request, no per-token index maths.
        starts = np.arange(num_reqs + 1, dtype=np.int64)
        positions = computed
        token_req = starts[:-1]
        input_ids = np.fromiter(
            map(operator.getitem, token_ids, num_computed_tokens), dtype=np.int64, count=num_reqs
        )
    else:
        starts = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        # positions: computed[r] + (0 .. counts[r]-1), vectorised over the flat batch
        total = int(starts[-1])
        token_req = np.repeat(np.arange(num_reqs), counts)
        positions = computed[token_req] + np.arange(total) - starts[:-1][token_req]
        input_ids = np.empty(total, dtype=np.int64)
        for i, (c, n) in enumerate(zip(num_computed_tokens, num_scheduled_tokens, strict=True)):
            input_ids[starts[i] : starts[i + 1]] = token_ids[i][c : c + n]
    logits_indices = (starts[1:] - 1)[sample_mask]
    if num_draft_tokens is not None and any(num_draft_tokens):
        drafts = np.array(num_draft_tokens, dtype=np.int64)[sample_mask]  # [S]
        # request s: indices end_s - m_s .. end_s, flattened in order
        offsets = np.arange(int(drafts.sum()) + len(drafts)) - np.repeat(
            np.cumsum(drafts + 1) - 1, drafts + 1
        )  # -m_s .. 0 per request
        logits_indices = np.repeat(logits_indices, drafts + 1) + offsets
    return StepInputs(
        input_ids=input_ids,
        positions=positions,
        token_req=token_req,
        query_start_loc=starts.tolist(),
        num_computed_tokens=list(num_computed_tokens),
        rows=list(rows),
        logits_indices=logits_indices,
        sample_mask=sample_mask.tolist(),
        max_seq_len=int((computed + counts).max()) if num_reqs else 0,
    )


class BlockTables:
    """Persistent per-group block tables: one row per running request, appended in place
    from the scheduler's deltas (so a step never rebuilds them).

    A full-history group's row is linear: slot j (token positions [j*T, (j+1)*T)) is column
    j, ``ceil(max_len / T) + 1`` columns. A sliding group named in ``ring_widths`` keeps
    only its last R slots: slot j lives in column ``j % R`` (``CacheGroupSpec.ring_blocks``
    sizes R so that one step's slots never share a column), so its width does not grow
    with max_len::

        slots    0  1  2  3  4  5  6  7  8      (R = 4; slots 0-4 left the window)
        columns  0  1  2  3  0  1  2  3  0      row: [8, 5, 6, 7]

    Every write is also queued (:meth:`drain_writes`) as (flat index, block id) pairs into
    the layout of one flat buffer holding every group's table, row-major, group after group
    (:attr:`flat_offsets`): the runner replays them into its device copy, so a step moves a
    few bytes instead of whole tables.
    """

    def __init__(
        self,
        group_block_tokens: dict[str, int],
        max_num_reqs: int,
        max_len: int,
        ring_widths: Mapping[str, int] | None = None,
    ):
        """``ring_widths``: sliding group -> R (:func:`ring_widths`); others are linear."""
        self.names = list(group_block_tokens)
        self.max_num_reqs = max_num_reqs
        widths = table_widths(group_block_tokens, max_len, ring_widths)
        self.num_cols = [cols for cols, _ in widths]
        self.is_ring = [ring for _, ring in widths]
        self.tables = {
            name: torch.zeros(max_num_reqs, cols, dtype=torch.int64)
            for name, cols in zip(self.names, self.num_cols, strict=True)
        }
        # numpy views of the same (CPU) memory: writing a few ids through them costs far
        # less than building a torch.tensor per append.
        self._np_tables = [self.tables[name].numpy() for name in self.names]
        self.lengths = {name: [0] * max_num_reqs for name in self.names}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.row_of: dict[str, int] = {}
        # where group g's [rows, cols] table starts in the flat layout (rows: max_num_reqs
        # + 1, the last one a null row that padded rows of a CUDA graph point to)
        self.flat_offsets = np.cumsum([0] + [(max_num_reqs + 1) * c for c in self.num_cols])
        # per group, for append() (runs per request per step): Python ints and lists
        self._lengths = [self.lengths[name] for name in self.names]
        self._shape = list(zip(self.is_ring, self.num_cols, strict=True))
        self._flat_base = [int(o) for o in self.flat_offsets[:-1]]
        self._has_ring = any(self.is_ring)
        # writes since the last drain_writes(), in order: flat index, block id
        self._write_index: list[int] = []
        self._write_values: list[int] = []

    def add(self, req_id: str, block_ids: tuple[list[int], ...]) -> int:
        row = self._free_rows.pop()
        self.row_of[req_id] = row
        for name in self.names:
            self.lengths[name][row] = 0
        self.append(req_id, block_ids)
        return row

    def append(self, req_id: str, new_block_ids: tuple[list[int], ...]) -> None:
        row = self.row_of[req_id]
        if len(new_block_ids) != len(self._shape):
            raise ValueError(f"{len(new_block_ids)} groups of block ids, tables have {self.names}")
        write_index, write_values = self._write_index, self._write_values
        for g, ids in enumerate(new_block_ids):
            if not ids:  # most groups, most steps
                continue
            table, lengths, ring, cols = self._np_tables[g], self._lengths[g], *self._shape[g]
            start = lengths[row]
            lengths[row] = start + len(ids)
            base = self._flat_base[g] + row * cols
            if len(ids) == 1:  # a decode step's new page: scalar writes cost far less
                col = start % cols if ring else start
                table[row, col] = ids[0]
                write_index.append(base + col)
                write_values.append(ids[0])
                continue
            if ring:
                if len(ids) > cols:  # slots before the last R left the window: not written
                    start, ids = start + len(ids) - cols, ids[-cols:]
                columns = [(start + k) % cols for k in range(len(ids))]
                table[row, columns] = ids
                write_index.extend([base + c for c in columns])
            else:
                table[row, start : start + len(ids)] = ids
                write_index.extend(range(base + start, base + start + len(ids)))
            write_values.extend(ids)

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self._free_rows.append(row)

    def drain_writes(self) -> tuple[np.ndarray, np.ndarray]:
        """The writes since the last call: flat indices [n] and block ids [n] (int64).

        Indices are unique (a device scatter with repeated indices keeps an arbitrary
        value): where two writes hit one ring column, the later one stands."""
        if not self._write_index:
            return _EMPTY, _EMPTY
        index = np.array(self._write_index, dtype=np.int64)
        values = np.array(self._write_values, dtype=np.int64)
        self._write_index.clear()
        self._write_values.clear()
        if self._has_ring and len(index) > 1:
            # the last write of every index: unique over the reversed order
            unique, last = np.unique(index[::-1], return_index=True)
            if len(unique) < len(index):
                index, values = unique, values[::-1][last]
        return index, values


def table_widths(
    group_block_tokens: Mapping[str, int],
    max_len: int,
    ring_widths: Mapping[str, int] | None = None,
) -> list[tuple[int, bool]]:
    """(columns, is a ring) of every group's block table, in ``group_block_tokens`` order:
    linear ``ceil(max_len / block_tokens) + 1``, or the group's ring width where one is
    given and narrower (a ring at least as wide as the linear table would never wrap)."""
    rings = dict(ring_widths or {})
    if unknown := set(rings) - set(group_block_tokens):
        raise ValueError(f"ring_widths names unknown groups {sorted(unknown)}")
    widths = []
    for name, block_tokens in group_block_tokens.items():
        linear = -(-max_len // block_tokens) + 1
        ring = name in rings and rings[name] < linear
        widths.append((rings[name] if ring else linear, ring))
    return widths


def ring_widths(groups: Sequence[CacheGroupSpec], max_step_tokens: int) -> dict[str, int]:
    """Sliding group -> the width R of its block-table ring for steps of at most
    ``max_step_tokens`` new positions per request (scheduled tokens + lookahead)."""
    return {g.name: g.ring_blocks(max_step_tokens) for g in groups if g.is_sliding}


_EMPTY = np.zeros(0, dtype=np.int64)
