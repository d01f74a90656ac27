"""What one forward step needs besides the weights: the paged cache tensors and the step
metadata (a flat batch of R requests with T new tokens in all, never a padded [B, S]).

Paging: every cache group (see ``rackserve.kv.spec``) has one tensor per layer,
``[num_blocks, block_tokens // ratio, entry_width]``, and one block table per request.
Block-table slot i of a request covers token positions [i * block_tokens, (i+1) *
block_tokens), absolute. A full-history group's table is linear (slot i in column i); a
sliding group's table is a ring of R columns (slot i in column i % R, R from
``CacheGroupSpec.ring_blocks``): the slots a step reads or writes never share a column, and
older slots, out of the window, are never read. Block 0 is the null block:
padded tokens of a CUDA-graph batch write there, and nothing reads it as data.

Everything in :class:`StepMetadata` is a device tensor except a few host ints that fix
shapes (so one captured CUDA graph serves every step of the same padded size); nothing
in the forward reads a device value back to the host.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from rackserve.kv.spec import CacheGroupSpec


def paged_slots(
    block_tables: torch.Tensor,
    per_block: int,
    req: torch.Tensor,
    index: torch.Tensor,
    ring: bool = False,
) -> torch.Tensor:
    """Cache slots of entries ``index`` (>= 0) of requests ``req`` (broadcast together).

    block_tables: [R, C] (this step's rows); index: token positions for ratio-1 groups,
    entry ids otherwise (``per_block`` entries a block). ``ring``: the table is a ring of C
    columns (sliding groups), table slot j in column j % C. Linear tables clamp columns past
    the table: callers mask such entries, and the clamp keeps the read inside the cache.
    """
    col = index // per_block
    col = col % block_tables.shape[1] if ring else col.clamp_(max=block_tables.shape[1] - 1)
    return block_tables[req, col] * per_block + index % per_block


@dataclass(frozen=True)
class Gather:
    """Rows each query reads from one cache group, shared by every layer of the group.

    ``slots`` [T, M]: cache rows (window positions for the sliding group, entries 0..E-1 of
    the query's request for a compressed group); ``valid`` [T, M]: which are visible to the
    query (causality, window start); ``num_visible`` [T]: compressed groups only, the
    entries the query may see (entry e once position >= r*e + r - 1).
    """

    slots: torch.Tensor
    valid: torch.Tensor
    num_visible: torch.Tensor | None = None


@dataclass(frozen=True)
class Compression:
    """Windows closing this step in one compressed group (same for all its layers).

    Token t at position p closes entry w = (p + 1) / r - 1 of its request when
    (p + 1) % r == 0. The entry pools the state rows of its window (CSA: windows w-1 and w,
    the state group's window being 2r)::

        positions   (w-1)r ........ wr ........ wr + r - 1 = p
                    |- CSA only -|--- window w ---|

    ``src`` [n, span] state slots of the window rows; ``missing`` [n, span] rows before
    position 0 (window -1 of entry 0), None without overlap; ``dst`` [n] entry slots, the
    null block for candidates that do not close (graph padding); ``positions`` [n] w * r.
    """

    src: torch.Tensor
    missing: torch.Tensor | None
    dst: torch.Tensor
    positions: torch.Tensor


@dataclass(frozen=True)
class StepMetadata:
    """Attention metadata of one step, on the model's device.

    Token t belongs to request ``token_req[t]`` (0..R-1, this step's order) and sits at
    absolute position ``positions[t]``::

        positions  0 ........ num_computed ........ num_computed + num_new
                   |-- in cache (paged) --|-- new: this step's tokens --|

    Everything index-shaped is computed once per step by :meth:`build`, for every cache
    group: ``slot_mapping`` (where each new token's row goes, ratio-1 groups), ``gather``
    (the rows each query reads: the sliding window, all compressed entries), and
    ``compression`` (the windows that close). ``max_seq_len`` (host) bounds every request's
    length after the step and sizes the compressed gathers (a CUDA graph uses its context
    bucket). ``token_mask`` is False on padded tokens (None: every token is real).
    """

    positions: torch.Tensor  # [T] int64
    token_req: torch.Tensor  # [T] int64
    slot_mapping: Mapping[str, torch.Tensor]  # ratio-1 group -> [T] int64
    gather: Mapping[str, Gather]  # "swa" and compressed groups
    compression: Mapping[str, Compression]  # compressed group -> its closing windows
    max_seq_len: int
    token_mask: torch.Tensor | None = None  # [T] bool
    # per-step values derived on first use and shared by every layer of the step
    _derived: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    def window_and_entries_valid(self, group: str) -> torch.Tensor:
        """[T, W + E] bool: the sliding window's ``valid`` then compressed ``group``'s (the
        rows an HCA query reads), built once per step rather than once per layer."""
        key = ("valid", group)
        if key not in self._derived:
            self._derived[key] = torch.cat([self.gather["swa"].valid, self.gather[group].valid], 1)
        return self._derived[key]

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
        """Derive every index of the step (device ops only: safe inside a graph).

        block_tables: group -> [R, C] rows of this step's requests (sliding groups: rings
        of C columns, see :func:`paged_slots`); closing: ratio -> [n]
        the tokens that may close a window (eager steps: exactly those with
        (pos + 1) % r == 0; graphs: every token, the rest is masked here).
        """
        slot_mapping = {
            g.name: paged_slots(
                block_tables[g.name], g.block_tokens, token_req, positions, g.is_sliding
            )
            for g in groups
            if g.ratio == 1
        }
        gather: dict[str, Gather] = {}
        compression: dict[str, Compression] = {}
        for g in groups:
            table, per_block = block_tables[g.name], g.entries_per_block
            if g.name == "swa":  # window rows p-W+1 .. p
                window = positions[:, None] - torch.arange(
                    g.window - 1, -1, -1, device=positions.device
                )
                slots = paged_slots(
                    table, per_block, token_req[:, None], window.clamp(min=0), ring=True
                )
                gather[g.name] = Gather(slots, window >= 0)
            elif g.ratio > 1:
                num_entries = max_seq_len // g.ratio
                entry = torch.arange(num_entries, device=positions.device)
                num_visible = (positions + 1) // g.ratio
                slots = paged_slots(table, per_block, token_req[:, None], entry[None, :])
                gather[g.name] = Gather(slots, entry[None, :] < num_visible[:, None], num_visible)
                state = next(
                    s for s in groups if s.window is not None and s.layer_ids == g.layer_ids
                )
                compression[g.name] = _compression(
                    g, state, block_tables, positions, token_req, closing[g.ratio], token_mask
                )
        return cls(positions, token_req, slot_mapping, gather, compression, max_seq_len, token_mask)


def _compression(
    entries: CacheGroupSpec,
    state: CacheGroupSpec,
    block_tables: Mapping[str, torch.Tensor],
    positions: torch.Tensor,
    token_req: torch.Tensor,
    closing: torch.Tensor,
    token_mask: torch.Tensor | None,
) -> Compression:
    r, span = entries.ratio, state.window  # span: r (HCA) or 2r (CSA, overlapping)
    pos, req = positions[closing], token_req[closing]  # [n]
    valid = (pos + 1) % r == 0
    if token_mask is not None:
        valid &= token_mask[closing]
    # a candidate before its first window end (graph padding) pools window 0 as garbage into
    # the null block: clamped, so even garbage is finite (a window with every row missing
    # would be a softmax over -inf: NaN, and 0 * NaN leaks through masks)
    entry = ((pos + 1) // r - 1).clamp_(min=0)
    window_pos = (entry * r - (span - r))[:, None] + torch.arange(span, device=pos.device)
    src = paged_slots(
        block_tables[state.name],
        state.entries_per_block,
        req[:, None],
        window_pos.clamp(min=0),
        ring=True,  # state groups are sliding
    )
    dst = paged_slots(block_tables[entries.name], entries.entries_per_block, req, entry)
    missing = window_pos < 0 if span > r else None
    return Compression(src, missing, torch.where(valid, dst, 0), entry * r)


def compressed_ratios(groups: Sequence[CacheGroupSpec]) -> list[int]:
    """The compression ratios of the model's compressed groups, ascending."""
    return sorted({g.ratio for g in groups if g.ratio > 1})


def closing_tokens(positions: np.ndarray, ratios: Sequence[int]) -> dict[int, np.ndarray]:
    """Host side of an eager step: per ratio r, the flat indices [n] of the tokens whose
    position closes a window ((pos + 1) % r == 0). positions: [T] int64."""
    return {r: np.flatnonzero((positions + 1) % r == 0) for r in ratios}


class KVCacheTensors:
    """The paged cache tensors of every (group, layer), allocated once."""

    def __init__(
        self,
        groups: Sequence[CacheGroupSpec],
        num_blocks: dict[str, int],
        dtype: torch.dtype,
        device: torch.device | str,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """``kv_dtype``: the KV groups' storage (e.g. float8 e4m3; None: ``dtype``); the
        compressor state groups (``*_state``) always hold ``dtype``."""
        self.groups = {g.name: g for g in groups}
        self.tensors: dict[str, dict[int, torch.Tensor]] = {
            g.name: {
                layer: torch.zeros(
                    num_blocks[g.name],
                    g.block_tokens // g.ratio,
                    g.entry_width,
                    dtype=dtype if kv_dtype is None or g.name.endswith("_state") else kv_dtype,
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

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in self.tensors.values() for t in d.values())
