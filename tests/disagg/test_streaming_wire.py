"""``recv_streamed`` on the ``tcp`` path, against hand-sent pieces over a socket pair: rows
land in the region in place (a run of slots) or through a scratch copy (slots out of
order), the region is laid out as ``export_blocks`` lays it out, and a bad checksum fails
the pull."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from rackserve.disagg.streaming import PieceLog, recv_streamed
from rackserve.disagg.wire import (
    End,
    Rows,
    TransferError,
    crc32,
    host_empty,
    send_message,
    to_host,
)

LAYOUT = [(2, 6), (3, 4)]  # per group: (layers, elements per slot per layer)
SLOTS = [[0, 1, 2, 3], [5, 7, 9]]


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _expected(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.flatten() for v in values])


def _pull(pieces: list[tuple[int, list[int], torch.Tensor]], flip: int = 0) -> torch.Tensor:
    """Send each (group, slots, rows [layers, len(slots), n]) as a Rows piece, then End;
    return what recv_streamed builds."""
    ours, theirs = socket.socketpair()

    def producer() -> None:
        for k, (g, slots, rows) in enumerate(pieces):
            data = _bytes(rows)
            send_message(theirs, Rows(g, slots, len(data), crc32(data) ^ (flip if k == 0 else 0)))
            theirs.sendall(data)
        send_message(theirs, End(True, num_cached_tokens=0))

    thread = threading.Thread(target=producer)
    thread.start()
    try:
        region, _ = recv_streamed(ours, "k", SLOTS, LAYOUT, torch.bfloat16, PieceLog())
    finally:
        thread.join()
        ours.close()
        theirs.close()
    return region


def test_pieces_in_place_and_out_of_order_build_the_region() -> None:
    g0 = torch.randn(2, 4, 6).bfloat16()
    g1 = torch.randn(3, 3, 4).bfloat16()
    pieces = [
        (1, [9, 5], g1[:, [2, 0]]),  # out of order: the scratch copy
        (0, [0, 1], g0[:, 0:2]),  # a run: straight into the region, layer by layer
        (0, [2, 3], g0[:, 2:4]),
        (1, [7], g1[:, 1:2]),
    ]
    assert torch.equal(_pull(pieces), _expected([g0, g1]))


@pytest.mark.parametrize("first", ["run", "scattered"])
def test_a_bad_checksum_fails_the_pull(first: str) -> None:
    g0 = torch.randn(2, 4, 6).bfloat16()
    g1 = torch.randn(3, 3, 4).bfloat16()
    head = (0, [0, 1, 2, 3], g0) if first == "run" else (1, [9, 5, 7], g1[:, [2, 0, 1]])
    rest = (1, [5, 7, 9], g1) if first == "run" else (0, [0, 1, 2, 3], g0)
    with pytest.raises(TransferError, match="failed its checksum"):
        _pull([head, rest], flip=1)


def test_host_buffers_on_a_cpu_only_host():
    """Without CUDA, bytes land in plain CPU memory and CPU tensors go out as they are."""
    buffer = host_empty(12, torch.bfloat16)
    assert buffer.device.type == "cpu" and buffer.numel() == 12
    assert buffer.dtype == torch.bfloat16
    t = torch.arange(6, dtype=torch.float32)
    assert to_host(t) is t


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_buffers_are_pinned_where_cuda_is():
    """Pinned staging: received bytes land in mapped pages, device rows leave through them."""
    assert host_empty(1 << 20, torch.uint8).is_pinned()
    rows = torch.randn(3, 5, 7, device="cuda").bfloat16()
    host = to_host(rows)
    assert host.is_pinned() and host.shape == rows.shape
    assert torch.equal(host, rows.cpu())
