"""The runner's device-side step state: block tables that live on the device, updated by
deltas, and the one host-to-device copy that carries a step's inputs.

On a GPU, every array a step needs (token ids, positions, the request of each token, the
rows of the requests, logits indices, closing tokens, block-table writes) is packed into
one pinned buffer and copied with a single non-blocking copy (``device.PinnedStaging``:
three buffers, each refilled only after its fence, recorded once the step's work is
launched: ``fence``); the device views are slices of that copy. A graph's static inputs
(``StaticInputs``) are copied from the same buffer straight to where the graph reads them.
On the CPU the arrays are used in place; everything else is the same path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from rackserve.device import PinnedStaging
from rackserve.kv.spec import CacheGroupSpec
from rackserve.model.batch import StepMetadata, closing_tokens, compressed_ratios
from rackserve.runner.inputs import BlockTables, StepInputs

# writes ids an earlier step left on the device into a step's uploaded input ids (the
# previous step's sampled ids under async scheduling, drafts proposed on the device)
Feed = Callable[[torch.Tensor], None]


def _int64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


class StaticInputs:
    """A graph family's int64 inputs (token ids, positions, table rows, ...) in one device
    buffer that ``StepBuffers.upload`` fills with one host-to-device copy a step.

    The graph of a key reads its fields back to back from the buffer's start (``views``):
    graphs of every size share the memory, as they share the stream, so a step's copy
    writes exactly what its graph reads and nothing else moves them."""

    def __init__(self, capacity: int, device: torch.device | str) -> None:
        self.buffer = torch.zeros(capacity, dtype=torch.int64, device=device)

    def views(self, lengths: Sequence[int]) -> list[torch.Tensor]:
        """The fields of the given lengths, back to back from the start."""
        if sum(lengths) > self.buffer.numel():
            raise ValueError(f"fields of {sum(lengths)} ints past {self.buffer.numel()}")
        return list(self.buffer[: sum(lengths)].split(list(lengths)))


def pad_to(a: np.ndarray, size: int, value: int = 0) -> np.ndarray:
    """int64 ``a`` followed by ``value`` up to ``size`` entries (a graph's padded rows: token
    0 at position 0 on the null table row, so their cache writes land in the null block)."""
    pad = size - len(a)
    return a if not pad else np.concatenate([a, np.full(pad, value, dtype=np.int64)])


class StepBuffers:
    def __init__(
        self,
        groups: Sequence[CacheGroupSpec],
        host_tables: BlockTables,
        device: torch.device | str,
    ) -> None:
        self.groups = list(groups)
        self.device = torch.device(device)
        self.on_host = self.device.type == "cpu"
        # The tables the model reads: every group's [rows + 1, cols] table in one flat buffer
        # (BlockTables.flat_offsets), kept equal to the host tables by replaying their
        # writes; the extra row stays all null blocks for the padded rows of a graph.
        max_num_reqs = host_tables.max_num_reqs
        self.null_row = max_num_reqs
        offsets = host_tables.flat_offsets
        self.flat = torch.zeros(int(offsets[-1]), dtype=torch.int64, device=device)
        self.tables = {
            name: self.flat[offsets[g] : offsets[g + 1]].view(max_num_reqs + 1, -1)
            for g, name in enumerate(host_tables.names)
        }
        self._staging = PinnedStaging(self.device)
        self.ratios = compressed_ratios(self.groups)

    # ---- the one copy -------------------------------------------------------------------------
    def upload(
        self,
        arrays: Sequence[np.ndarray],
        into: torch.Tensor | None = None,
        fields: Sequence[np.ndarray] = (),
    ) -> list[torch.Tensor]:
        """int64 host arrays -> device tensors (views of one copy on a GPU).

        ``fields``: arrays written back to back from the start of the int64 device tensor
        ``into`` (a graph's static inputs, ``StaticInputs``) by a copy of their own from the
        same staging buffer: no device kernel moves them (they used to go through the
        device views and one copy kernel each)."""
        if self.on_host:
            start = 0
            for a in fields:
                into[start : start + len(a)].copy_(torch.from_numpy(_int64(a)))
                start += len(a)
            return [torch.from_numpy(_int64(a)) for a in arrays]
        return self._staging.upload([_int64(a) for a in arrays], into, [_int64(a) for a in fields])

    def fence(self) -> None:
        """The last upload's fence (``PinnedStaging.fence``): call once the work that reads
        it is launched (a graph replay)."""
        self._staging.fence()

    def apply_writes(self, index: torch.Tensor, values: torch.Tensor) -> None:
        """Replay block-table writes (flat indices into :attr:`flat`) on the device copy."""
        if index.numel():
            self.flat[index] = values

    # ---- eager steps --------------------------------------------------------------------------
    def eager_step(
        self, inputs: StepInputs, table_writes: tuple[np.ndarray, np.ndarray]
    ) -> tuple[torch.Tensor, StepMetadata, torch.Tensor]:
        """Upload one step; returns (input_ids [T], metadata, logits_indices [S])."""
        positions = inputs.positions
        closing = list(closing_tokens(positions, self.ratios).values())
        write_index, write_values = table_writes
        arrays = [
            inputs.input_ids,
            positions,
            inputs.token_req,
            np.asarray(inputs.rows, dtype=np.int64),
            inputs.logits_indices,
            write_index,
            write_values,
            *closing,
        ]
        input_ids, pos, token_req, rows, logits_indices, w_index, w_values, *closing_dev = (
            self.upload(arrays)
        )
        self.apply_writes(w_index, w_values)
        meta = StepMetadata.build(
            self.groups,
            pos,
            token_req,
            {name: table[rows] for name, table in self.tables.items()},
            inputs.max_seq_len,
            dict(zip(self.ratios, closing_dev, strict=True)),
        )
        return input_ids, meta, logits_indices
