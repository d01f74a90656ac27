"""Streaming pulls (``tcp``, ``nccl``): KV leaves the prefill side block by block while it
prefills.

Producer (a server thread, ``send_streamed``): waits on the store for the entry's pieces (the
rows of blocks whose positions the prefill has computed, added by the engine loop after each
chunk), sends the slots the consumer asked for as they appear, then, once the request has
finished, the rest of the asked slots from its final copy (the tail: sliding-window and
compressor-state pages and the last, partial blocks), then ``End``::

    prefill chunks   [c0][c1][c2][c3 last]
    Rows pieces          p0  p1  p2          tail   End
                         (while later chunks compute)

Consumer (a transfer thread, ``recv_streamed``): places each piece's rows by slot into one
buffer per group and returns the region laid out as ``export_blocks`` lays it out, so the
engine loop imports it exactly as a whole-region pull. A piece's arrival is logged
(``PieceLog``): tests read when the decode side had rows.

The control messages (``Rows`` headers, ``Waiting``, ``End``) always go over the TCP
connection. A piece's data follows on it (``tcp``), or as one ``send``/``recv`` on the
pair's two-rank process group (``nccl``; gloo on CPU), device memory to device memory; the
pair is held for the whole pull, so its sends and receives match in order.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rackserve.disagg.store import KVStore
from rackserve.disagg.wire import (
    End,
    Pull,
    PullReply,
    Rows,
    TransferError,
    Waiting,
    as_bytes,
    crc32,
    host_empty,
    recv_into_exact,
    recv_message,
    send_message,
    to_host,
)

UNKNOWN_KEY_WAIT_S = 5.0  # a pull may arrive before the prefill engine has the request


@dataclass(frozen=True)
class PieceRecord:
    key: str
    time: float  # time.monotonic() at arrival
    group: int
    num_slots: int
    nbytes: int


class PieceLog:
    """Arrivals on the consumer (thread-safe; bounded)."""

    def __init__(self, max_records: int = 4096) -> None:
        self._records: list[PieceRecord] = []
        self._lock = threading.Lock()
        self.max_records = max_records

    def add(self, record: PieceRecord) -> None:
        with self._lock:
            if len(self._records) >= self.max_records:
                del self._records[: self.max_records // 2]
            self._records.append(record)

    def records(self, key: str | None = None) -> list[PieceRecord]:
        with self._lock:
            return [r for r in self._records if key is None or r.key == key]


@dataclass
class StreamStats:
    """Producer counters: bytes sent while the prefill ran vs. in the tail."""

    bytes_streamed: int = 0
    bytes_tail: int = 0


def _pair_op(op: Callable[[], Any]) -> Any:
    try:
        return op()
    except TransferError:
        raise
    except Exception as e:  # a broken pair: the caller drops it, it is rebuilt next pull
        raise TransferError(f"pair transfer failed: {e}") from None


def send_streamed(
    conn: socket.socket,
    store: KVStore,
    pull: Pull,
    fault: str,
    delay_s: float,
    stats: StreamStats,
    pair: Callable[[], Any] | None = None,
) -> int:
    """Serve one streaming pull; returns the bytes sent (the caller waits for the Ack).
    ``pair``: the two-rank group the pieces' data go through (built once the consumer has
    the reply); None: on ``conn``."""
    if not store.wait_for(pull.key, min(store.lease_s, UNKNOWN_KEY_WAIT_S)):
        send_message(conn, PullReply(False, f"no KV held for {pull.key} (lease over?)"))
        return -1
    send_message(conn, PullReply(True))
    group = None if pair is None else _pair_op(pair)
    store.watching(pull.key, +1)
    try:
        return _send_pieces(conn, store, pull, fault, delay_s, stats, group)
    finally:
        store.watching(pull.key, -1)


def _send_pieces(
    conn: socket.socket,
    store: KVStore,
    pull: Pull,
    fault: str,
    delay_s: float,
    stats: StreamStats,
    group: Any,
) -> int:
    if delay_s:
        time.sleep(delay_s)
    wanted = [set(s) for s in pull.group_slots]
    sent: list[set[int]] = [set() for _ in wanted]
    num_seen = nbytes = num_pieces = 0

    def send(group_id: int, slots: list[int], rows: list[torch.Tensor], tail: bool) -> None:
        nonlocal nbytes, num_pieces
        flip = 1 if fault == "corrupt_chunk" and num_pieces == 0 else 0
        if group is None:  # the bytes on the connection, a layer after another (no stacking)
            parts = [as_bytes(to_host(t)) for t in rows]
            size, checksum = 0, 0
            for part in parts:
                size, checksum = size + len(part), crc32(part, checksum)
            send_message(conn, Rows(group_id, slots, size, checksum ^ flip))
            for part in parts:
                conn.sendall(part)
        else:  # device to device on the pair (a checksum only for CPU tensors: gloo)
            data = torch.stack(rows).contiguous() if rows else None
            size = 0 if data is None else data.numel() * data.element_size()
            on_cpu = data is not None and data.device.type == "cpu"
            checksum = crc32(as_bytes(data)) if on_cpu else 0
            send_message(conn, Rows(group_id, slots, size, checksum ^ flip))
            if data is not None:
                _pair_op(lambda: group.send([data.view(-1)], 1, 0).wait())
        if fault == "drop_connection" and num_pieces == 0:
            conn.shutdown(socket.SHUT_RDWR)
            raise TransferError("fault injected: connection dropped")
        num_pieces += 1
        nbytes += size
        sent[group_id].update(slots)
        if tail:
            stats.bytes_tail += size
        else:
            stats.bytes_streamed += size

    while True:
        held, pieces, final = store.watch(pull.key, num_seen, store.lease_s / 3)
        if held and not pieces and final is None:
            send_message(conn, Waiting())  # a queued or slow prefill: the consumer waits on
            continue
        if not held:
            send_message(conn, End(False, "the prefill ended without KV (aborted, or lease over)"))
            return -1
        num_seen += len(pieces)
        for piece in pieces:
            if piece.group >= len(wanted):
                continue
            keep = [i for i, s in enumerate(piece.slots) if s in wanted[piece.group]]
            keep = [i for i in keep if piece.slots[i] not in sent[piece.group]]
            if keep:
                index = torch.tensor(keep, dtype=torch.long, device=piece.rows[0].device)
                slots = [piece.slots[i] for i in keep]
                send(piece.group, slots, [t[index] for t in piece.rows], tail=False)
        if final is None:
            continue
        if len(final.slots) != len(wanted):
            send_message(conn, End(False, f"{len(wanted)} groups asked, {len(final.slots)} held"))
            return -1
        for g, slots_asked in enumerate(pull.group_slots):
            rest = [s for s in slots_asked if s not in sent[g]]
            if not rest:
                continue
            position = {s: i for i, s in enumerate(final.slots[g])}
            missing = [s for s in rest if s not in position]
            if missing:
                send_message(conn, End(False, f"the producer lacks group {g} slots {missing[:4]}"))
                return -1
            index = torch.tensor([position[s] for s in rest], dtype=torch.long)
            send(g, rest, [t[index.to(t.device)] for t in final.rows[g]], tail=True)
        send_message(conn, store.end(pull.key))
        return nbytes


def recv_streamed(
    conn: socket.socket,
    key: str,
    group_slots: list[list[int]],
    layout: list[tuple[int, int]],
    dtype: torch.dtype,
    log: PieceLog,
    group: Any = None,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, End]:
    """(the region from Rows pieces, the producer's ``End``: its prefix hit); ``layout[g]``:
    (layers, elements per slot per layer) of group g on this side. ``group``: the pair the
    pieces' data arrive on, into ``device`` memory (None: on ``conn``, into CPU memory).
    TransferError on a bad piece, a checksum or a missing slot."""
    element_size = torch.empty(0, dtype=dtype).element_size()
    device = torch.device("cpu") if group is None or device is None else device
    # the region as export_blocks lays it out, each group's [layers, slots, n] a view of it
    pairs = zip(layout, group_slots, strict=True)
    shapes = [(layers, len(slots), n) for (layers, n), slots in pairs]
    sizes = [math.prod(shape) for shape in shapes]
    if device.type == "cpu":
        region = host_empty(sum(sizes), dtype)
    else:
        region = torch.empty(sum(sizes), dtype=dtype, device=device)
    buffers = [part.view(shape) for part, shape in zip(region.split(sizes), shapes, strict=True)]
    position = [{s: i for i, s in enumerate(slots)} for slots in group_slots]
    filled: list[set[int]] = [set() for _ in group_slots]
    while True:
        message = recv_message(conn)
        if isinstance(message, Waiting):
            continue
        if isinstance(message, End):
            if not message.ok:
                raise TransferError(message.message)
            end = message
            break
        if not isinstance(message, Rows) or not 0 <= message.group < len(buffers):
            raise TransferError("unexpected message in a streamed pull")
        g, slots = message.group, message.slots
        layers, n = layout[g]
        if any(s not in position[g] for s in slots):
            raise TransferError(f"the producer sent group {g} slots that were not asked")
        if message.nbytes != layers * len(slots) * n * element_size:
            raise TransferError(
                f"layout mismatch in group {g}: {message.nbytes} bytes for {len(slots)} slots "
                "(different models or dtypes?)"
            )
        if slots:
            at = [position[g][s] for s in slots]
            if group is None:
                _recv_rows(conn, buffers[g], at, message.crc32, g)
            else:
                rows = torch.empty(message.nbytes // element_size, dtype=dtype, device=device)
                _pair_op(lambda rows=rows: group.recv([rows], 0, 0).wait())
                checked = message.crc32 and device.type == "cpu"
                if checked and crc32(as_bytes(rows)) != message.crc32:
                    raise TransferError(f"a piece of group {g} failed its checksum")
                index = torch.tensor(at, dtype=torch.long, device=device)
                buffers[g][:, index] = rows.view(layers, len(slots), n)
        filled[g].update(slots)
        log.add(PieceRecord(key, time.monotonic(), g, len(slots), message.nbytes))
    for g, slots in enumerate(group_slots):
        if len(filled[g]) != len(slots):
            raise TransferError(f"group {g}: {len(slots) - len(filled[g])} slots never arrived")
    return region, end


def _recv_rows(
    conn: socket.socket, buffer: torch.Tensor, at: list[int], checksum: int, g: int
) -> None:
    """A piece's bytes ([layers, len(at), n], the layers in order) from the connection into
    rows ``at`` of ``buffer`` [layers, slots, n] (CPU). Consecutive rows, the usual case
    (a run of blocks), are received in place, a layer at a time; others through one
    scratch copy. The CRC covers the piece's bytes in the order sent."""
    layers, k = buffer.shape[0], len(at)
    running = 0
    if at == list(range(at[0], at[0] + k)):
        for layer in range(layers):
            view = as_bytes(buffer[layer, at[0] : at[0] + k])
            recv_into_exact(conn, view)
            running = crc32(view, running)
    else:
        rows = torch.empty(layers, k, buffer.shape[2], dtype=buffer.dtype)
        view = as_bytes(rows)
        recv_into_exact(conn, view)
        running = crc32(view)
        buffer[:, torch.tensor(at, dtype=torch.long)] = rows
    if running != checksum:
        raise TransferError(f"a piece of group {g} failed its checksum")
