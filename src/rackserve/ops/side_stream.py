"""A second CUDA stream for work that need not wait for the main stream's next kernels
(graph-capturable fork and join). The attention runs a CSA layer's indexer on it beside the
q projection (``Attention._indexer_beside_q``), the decode MoE its shared expert beside the
router (``moe_routed``'s ``shared_beside``), the grouped prefill MoE its shared expert beside
the routed experts (``grouped_moe.SHARED_APART``), the mHC of a captured step a block's post
and comb (``mhc_launch.Tiling.comb_beside``)."""

from __future__ import annotations

import contextlib
from typing import ClassVar

import torch


class SideStream:
    """A second stream for work that does not wait for the main stream's next kernels::

        side = SideStream.of(device)
        side.fork()             # the side stream starts after everything issued so far
        y = main_work()         # issued on the current stream
        with side.active():
            z = side_work()     # issued on the side stream: runs beside main_work
        side.join()             # the current stream waits for side_work

    Inside a CUDA graph capture the fork and join are the graph's edges (the side stream
    joins the capture through the fork's event), so the two chains replay as parallel
    branches. Memory is safe without ``record_stream``: a tensor the side stream allocated
    is reused by the side stream only after a later fork, which orders it after every use
    the main stream issued before; one the main stream allocated and the side work reads is
    reused only after the join. The side work must not take ops that keep one workspace per
    device for one stream at a time: the split-K GEMV's and the one-launch mHC's counters.
    Off CUDA every method does nothing: the work runs in the order it was issued."""

    _streams: ClassVar[dict[torch.device, torch.cuda.Stream]] = {}

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self.stream = stream

    @classmethod
    def of(cls, device: torch.device) -> SideStream:
        """The device's side stream (made on first use), or a no-op one off CUDA."""
        if device.type != "cuda":
            return cls(None)
        stream = cls._streams.get(device)
        if stream is None:
            stream = cls._streams[device] = torch.cuda.Stream(device)
        return cls(stream)

    def fork(self) -> None:
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))

    def active(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self.stream is None else torch.cuda.stream(self.stream)

    def join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
