"""What one forward step needs besides the weights: the paged cache tensors and the step
metadata (a flat batch of R requests with T new tokens in all, never a padded [B, S]).

Paging: every cache group (see ``rackserve.kv.spec``) has one tensor per layer,
``[num_blocks, block_tokens // ratio, entry_width]``, and one block table per request.
Block-table entry i of a request covers token positions [i * block_tokens, (i+1) *
block_tokens): positions are absolute, so a sliding group's table starts with placeholder
ids for positions that fell out of the window (never read). Block 0 is the null block:
padded tokens of a CUDA-graph batch write there, and nothing reads it as data.

Everything in :class:`StepMetadata` is a device tensor except a few host ints that fix
shapes (so one captured CUDA graph serves every step of the same padded size); nothing
in the forward reads a device value back to the host.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from rackserve.kv.spec import CacheGroupSpec


def paged_slots(
    block_tables: torch.Tensor, per_block: int, req: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    """Slots of entries ``index`` of requests ``req`` (broadcast together).

    block_tables: [R, C] (this step's rows); index: token positions for ratio-1 groups,
    entry ids otherwise (``per_block`` entries a block). Columns past the table are clamped:
    callers mask such entries, and the clamp keeps the read inside the cache.
    """
    col = (index // per_block).clamp_(max=block_tables.shape[1] - 1)
    return block_tables[req, col] * per_block + index % per_block


@dataclass(frozen=True)
class StepMetadata:
    """Attention metadata of one step, on the model's device.

    Token t belongs to request ``token_req[t]`` (0..R-1, this step's order) and sits at
    absolute position ``positions[t]``::

        positions  0 ........ num_computed ........ num_computed + num_new
                   |-- in cache (paged) --|-- new: this step's tokens --|

    ``max_seq_len`` (host) bounds every request's length after the step; it sizes the
    compressed-entry gathers (a CUDA graph uses its context bucket). ``closing[r]`` lists
    the tokens that may close a compressor window of ratio r (eager steps: exactly those
    with ``(pos + 1) % r == 0``; graphs: every token, and the layer masks the rest).
    ``token_mask`` is False on padded tokens (None: every token is real).
    """

    positions: torch.Tensor  # [T] int64
    token_req: torch.Tensor  # [T] int64
    block_tables: Mapping[str, torch.Tensor]  # group -> [R, C] int64
    slot_mapping: Mapping[str, torch.Tensor]  # ratio-1 group -> [T] int64 slot of each token
    closing: Mapping[int, torch.Tensor]  # ratio -> [n] int64 token indices
    max_seq_len: int
    token_mask: torch.Tensor | None = None  # [T] bool

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @classmethod
    def build(
        cls,
        groups: Sequence[CacheGroupSpec],
        positions: torch.Tensor,
        token_req: torch.Tensor,
        block_tables: Mapping[str, torch.Tensor],
        max_seq_len: int,
        closing: Mapping[int, torch.Tensor],
        token_mask: torch.Tensor | None = None,
    ) -> StepMetadata:
        """Derive the per-token slot mappings (device ops only: safe inside a graph)."""
        slot_mapping = {
            g.name: paged_slots(block_tables[g.name], g.block_tokens, token_req, positions)
            for g in groups
            if g.ratio == 1
        }
        return cls(
            positions, token_req, block_tables, slot_mapping, closing, max_seq_len, token_mask
        )


def closing_tokens(
    positions: Sequence[int] | torch.Tensor, ratios: Sequence[int], device: torch.device | str
) -> dict[int, torch.Tensor]:
    """Exact closing-token lists for an eager step (host positions -> device indices)."""
    pos = torch.as_tensor(positions, dtype=torch.int64, device="cpu")
    return {r: torch.nonzero((pos + 1) % r == 0).flatten().to(device) for r in set(ratios)}


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

    def per_block(self, group: str) -> int:
        g = self.groups[group]
        return g.block_tokens // g.ratio

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in self.tensors.values() for t in d.values())
