"""Pure input building: from the scheduled requests to the flat tensors of one step.

Shape legend: R scheduled requests, T = sum of their scheduled tokens.

For request r with ``num_computed`` tokens in the cache and ``n`` scheduled::

    token_ids   [0 ........ num_computed ........ num_computed + n ...... num_tokens)
                 |-- cached --|-- this step's input --|-- (spec / not yet) --|

It needs logits (for sampling) only when the step reaches its last known token.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


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

    Every write is also queued (:meth:`drain_writes`) as (flat index, block id) pairs into
    the layout of one flat buffer holding every group's table, row-major, group after group
    (:attr:`flat_offsets`): the runner replays them into its device copy, so a step moves a
    few bytes instead of whole tables.
    """

    def __init__(self, group_block_tokens: dict[str, int], max_num_reqs: int, max_len: int):
        self.names = list(group_block_tokens)
        self.max_num_reqs = max_num_reqs
        self.tables = {
            name: torch.zeros(max_num_reqs, -(-max_len // bt) + 1, dtype=torch.int64)
            for name, bt in group_block_tokens.items()
        }
        # numpy views of the same (CPU) memory: writing a few ids through them costs far
        # less than building a torch.tensor per append.
        self._np_tables = [self.tables[name].numpy() for name in self.names]
        self.lengths = {name: [0] * max_num_reqs for name in self.names}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.row_of: dict[str, int] = {}
        self.num_cols = [t.shape[1] for t in self._np_tables]
        # where group g's [rows, cols] table starts in the flat layout (rows: max_num_reqs
        # + 1, the last one a null row that padded rows of a CUDA graph point to)
        self.flat_offsets = np.cumsum([0] + [(max_num_reqs + 1) * c for c in self.num_cols])
        self._writes: list[tuple[int, int, int, list[int]]] = []  # (group, row, col, ids)

    def add(self, req_id: str, block_ids: tuple[list[int], ...]) -> int:
        row = self._free_rows.pop()
        self.row_of[req_id] = row
        for name in self.names:
            self.lengths[name][row] = 0
        self.append(req_id, block_ids)
        return row

    def append(self, req_id: str, new_block_ids: tuple[list[int], ...]) -> None:
        row = self.row_of[req_id]
        for g, (name, table, ids) in enumerate(
            zip(self.names, self._np_tables, new_block_ids, strict=True)
        ):
            if ids:
                lengths = self.lengths[name]
                start = lengths[row]
                if len(ids) == 1:  # a decode step's new page: a scalar write costs far less
                    table[row, start] = ids[0]
                else:
                    table[row, start : start + len(ids)] = ids
                lengths[row] = start + len(ids)
                self._writes.append((g, row, start, ids))

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self._free_rows.append(row)

    def drain_writes(self) -> tuple[np.ndarray, np.ndarray]:
        """The writes since the last call: flat indices [n] and block ids [n] (int64)."""
        if not self._writes:
            return _EMPTY, _EMPTY
        index, values = [], []
        for g, row, col, ids in self._writes:
            first = self.flat_offsets[g] + row * self.num_cols[g] + col
            index.append(np.arange(first, first + len(ids), dtype=np.int64))
            values.append(np.asarray(ids, dtype=np.int64))
        self._writes.clear()
        return np.concatenate(index), np.concatenate(values)


_EMPTY = np.zeros(0, dtype=np.int64)
