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
class ScheduledRequest:
    token_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    row: int  # row in the persistent block tables


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    query_start_loc: list[int]  # [R + 1]
    num_computed_tokens: list[int]  # [R]
    rows: list[int]  # [R]
    logits_indices: torch.Tensor  # [S] flat index of each sampled request's last token
    sample_mask: list[bool]  # [R] whether request r samples this step


def build_step_inputs(reqs: list[ScheduledRequest], device: torch.device | str) -> StepInputs:
    return build_batch_inputs(
        [r.token_ids for r in reqs],
        [r.num_computed_tokens for r in reqs],
        [r.num_scheduled_tokens for r in reqs],
        [r.row for r in reqs],
        device,
    )


def build_batch_inputs(
    token_ids: Sequence[list[int]],
    num_computed_tokens: list[int],
    num_scheduled_tokens: list[int],
    rows: list[int],
    device: torch.device | str,
) -> StepInputs:
    """The flat inputs of R requests, given as columns (request r: ``token_ids[r]``, ...)."""
    num_reqs = len(token_ids)
    counts = np.array(num_scheduled_tokens, dtype=np.int64)  # [R]
    computed = np.array(num_computed_tokens, dtype=np.int64)  # [R]
    lengths = np.fromiter(map(len, token_ids), dtype=np.int64, count=num_reqs)  # [R]
    sample_mask = computed + counts >= lengths  # [R] the step reaches the last known token
    if num_reqs and counts.min() == counts.max() == 1:
        # Pure decode (the common step): one token per request, no per-token index maths.
        starts = np.arange(num_reqs + 1, dtype=np.int64)
        positions = computed
        input_ids = np.fromiter(
            map(operator.getitem, token_ids, num_computed_tokens), dtype=np.int64, count=num_reqs
        )
    else:
        starts = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        # positions: computed[r] + (0 .. counts[r]-1), vectorised over the flat batch
        total = int(starts[-1])
        owner = np.repeat(np.arange(num_reqs), counts)
        positions = computed[owner] + np.arange(total) - starts[:-1][owner]
        input_ids = np.empty(total, dtype=np.int64)
        for i, (c, n) in enumerate(zip(num_computed_tokens, num_scheduled_tokens, strict=True)):
            input_ids[starts[i] : starts[i + 1]] = token_ids[i][c : c + n]
    logits_indices = (starts[1:] - 1)[sample_mask]
    return StepInputs(
        input_ids=torch.from_numpy(input_ids).to(device),
        positions=torch.from_numpy(positions).to(device),
        query_start_loc=starts.tolist(),
        num_computed_tokens=list(num_computed_tokens),
        rows=list(rows),
        logits_indices=torch.from_numpy(logits_indices).to(device),
        sample_mask=sample_mask.tolist(),
    )


class BlockTables:
    """Persistent per-group block tables: one row per running request, appended in place
    from the scheduler's deltas (so a step never rebuilds them)."""

    def __init__(self, group_block_tokens: dict[str, int], max_num_reqs: int, max_len: int):
        self.names = list(group_block_tokens)
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

    def add(self, req_id: str, block_ids: tuple[list[int], ...]) -> int:
        row = self._free_rows.pop()
        self.row_of[req_id] = row
        for name in self.names:
            self.lengths[name][row] = 0
        self.append(req_id, block_ids)
        return row

    def append(self, req_id: str, new_block_ids: tuple[list[int], ...]) -> None:
        row = self.row_of[req_id]
        for name, table, ids in zip(self.names, self._np_tables, new_block_ids, strict=True):
            if ids:
                lengths = self.lengths[name]
                start = lengths[row]
                if len(ids) == 1:  # a decode step's new page: a scalar write costs far less
                    table[row, start] = ids[0]
                else:
                    table[row, start : start + len(ids)] = ids
                lengths[row] = start + len(ids)

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self._free_rows.append(row)
