"""Pure input building: from the scheduled requests to the flat tensors of one step.

Shape legend: R scheduled requests, T = sum of their scheduled tokens.

For request r with ``num_computed`` tokens in the cache and ``n`` scheduled::

    token_ids   [0 ........ num_computed ........ num_computed + n ...... num_tokens)
                 |-- cached --|-- this step's input --|-- (spec / not yet) --|

It needs logits (for sampling) only when the step reaches its last known token.
"""

from __future__ import annotations

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
    counts = np.fromiter((r.num_scheduled_tokens for r in reqs), dtype=np.int64, count=len(reqs))
    starts = np.zeros(len(reqs) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    computed = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int64, count=len(reqs))
    # positions: computed[r] + (0 .. counts[r]-1), vectorised over the flat batch
    total = int(starts[-1])
    owner = np.repeat(np.arange(len(reqs)), counts)
    positions = computed[owner] + np.arange(total) - starts[:-1][owner]
    input_ids = np.empty(total, dtype=np.int64)
    sample_mask = []
    for i, r in enumerate(reqs):
        c, n = r.num_computed_tokens, r.num_scheduled_tokens
        input_ids[starts[i] : starts[i + 1]] = r.token_ids[c : c + n]
        sample_mask.append(c + n >= len(r.token_ids))
    logits_indices = (starts[1:] - 1)[np.asarray(sample_mask, dtype=bool)]
    return StepInputs(
        input_ids=torch.from_numpy(input_ids).to(device),
        positions=torch.from_numpy(positions).to(device),
        query_start_loc=starts.tolist(),
        num_computed_tokens=computed.tolist(),
        rows=[r.row for r in reqs],
        logits_indices=torch.from_numpy(logits_indices).to(device),
        sample_mask=sample_mask,
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
        for name, ids in zip(self.names, new_block_ids, strict=True):
            if ids:
                start = self.lengths[name][row]
                self.tables[name][row, start : start + len(ids)] = torch.tensor(ids)
                self.lengths[name][row] = start + len(ids)

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self._free_rows.append(row)
