"""What one forward step needs besides the weights: the paged cache tensors and the batch
metadata (a flat batch of R requests with T new tokens in all, never a padded [B, S]).

Paging: every cache group (see ``rackserve.kv.spec``) has one tensor per layer,
``[num_blocks, block_tokens // ratio, entry_width]``, and one block table per request.
Block-table entry i of a request covers token positions [i * block_tokens, (i+1) *
block_tokens): positions are absolute, so a sliding group's table starts with placeholder
ids for positions that fell out of the window (never read).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rackserve.kv.spec import CacheGroupSpec


@dataclass
class ForwardBatch:
    """Attention metadata of one step.

    ``query_start_loc`` is cu_seqlens_q: request r owns flat tokens
    [query_start_loc[r], query_start_loc[r+1]). It had ``num_computed_tokens[r]`` tokens in
    the cache before this step::

        positions  0 ........ num_computed ........ num_computed + num_new
                   |-- in cache (paged) --|-- new: this step's tokens --|
    """

    positions: torch.Tensor  # [T] int64
    query_start_loc: list[int]  # [R + 1]
    num_computed_tokens: list[int]  # [R]
    block_tables: dict[str, torch.Tensor]  # group name -> [num_rows, max_blocks] int64
    rows: list[int]  # [R] request r's row in the block tables (a persistent batch)

    def block_table(self, group: str, r: int) -> torch.Tensor:
        """[max_blocks] the block table of request r in a cache group."""
        return self.block_tables[group][self.rows[r]]

    @property
    def num_reqs(self) -> int:
        return len(self.num_computed_tokens)

    def seq_len(self, r: int) -> int:
        """Tokens in the cache for request r once this step has run."""
        return self.num_computed_tokens[r] + self.query_start_loc[r + 1] - self.query_start_loc[r]


class KVCacheTensors:
    """The paged cache tensors of every (group, layer), allocated once."""

    def __init__(
        self,
        groups: Sequence[CacheGroupSpec],
        num_blocks: dict[str, int],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.groups = {g.name: g for g in groups}
        self.tensors: dict[str, dict[int, torch.Tensor]] = {
            g.name: {
                layer: torch.zeros(
                    num_blocks[g.name],
                    g.block_tokens // g.ratio,
                    g.entry_width,
                    dtype=dtype,
                    device=device,
                )
                for layer in g.layer_ids
            }
            for g in groups
        }

    def flat(self, group: str, layer: int) -> torch.Tensor:
        """[num_blocks * entries_per_block, entry_width] view, addressed by slot."""
        t = self.tensors[group][layer]
        return t.view(-1, t.shape[-1])

    def slots(self, group: str, block_table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Slots of entries ``index`` (token positions for ratio 1, entry ids otherwise).

        block_table: [max_blocks] one request's row; index: [n] -> [n] slots.
        """
        g = self.groups[group]
        per_block = g.block_tokens // g.ratio
        return block_table[index // per_block] * per_block + index % per_block

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in self.tensors.values() for t in d.values())
