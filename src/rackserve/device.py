"""Where the model runs and in which dtype: the defaults every entry point shares."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_dtype(name: str | None, device: str) -> torch.dtype:
    """CPU defaults to float32, accelerators to bfloat16."""
    if name is None or name == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def resolve(device: str | None, dtype: str | None) -> tuple[torch.device, torch.dtype]:
    """The device ("auto"/None: cuda when available) and dtype ("auto"/None: by device)."""
    name = default_device() if device in (None, "auto") else device
    return torch.device(name), parse_dtype(dtype, torch.device(name).type)


def upload(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host -> device without a stream sync on a GPU (pinned, non-blocking): a copy from
    pageable memory waits for everything queued on the stream, so the engine loop would wait
    for the step in flight (async scheduling, a P/D export)."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class PinnedStaging:
    """Host arrays -> device tensors in one host-to-device copy per call, without a stream
    sync: each array's bytes at an 8-byte aligned offset of a pinned buffer, the tensors
    views of the one device copy. ``upload`` per array costs a pinned allocation and a copy
    each: with the sampling columns staged here instead, a plain decode step's launch at 32
    requests went from 1.99 to 1.19-1.29 ms of host time (H100, 2026-12-07).

    Three buffers take turns; one is refilled only once its fence has passed. The fence is
    an event recorded after the buffer's copy by :meth:`fence`, which the caller calls once
    the work that reads the upload is launched (a graph replay); the next upload records a
    fence still pending itself. Recorded between the copy and the graph, the event's host
    time delayed the graph of an idle device: decode:1's isolated step 1.217 ms against
    1.193 with the fence after the replay (H200, 2026-12-07, results/*-s41.md). Recorded
    after it, the fence passes with the graph, not the copy, and the third buffer keeps the
    host free to stage two steps ahead, as two buffers fenced at the copy did.
    The events are made once and recorded again (a new one a call took 9.9 us against 6.4).
    Uploads and fences of one staging run on one stream (the caller's current stream)."""

    BUFFERS = 3

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._buffers: list[torch.Tensor | None] = [None] * self.BUFFERS
        self._hosts: list[np.ndarray | None] = [None] * self.BUFFERS  # their numpy views
        # each buffer's fence; synchronizing one never recorded returns at once
        self._fences = [torch.cuda.Event() if self._cuda else None for _ in range(self.BUFFERS)]
        self._unfenced: int | None = None  # the buffer whose copy awaits its fence
        self._next = 0
        self._empty: dict[np.dtype, torch.Tensor] = {}  # what arrays of no bytes are views of

    def fence(self) -> None:
        """Record the last upload's fence, if it is still pending: after the work launched
        on its tensors, off the path from the copy to that work."""
        i, self._unfenced = self._unfenced, None
        if i is not None:
            fence = self._fences[i]
            if fence is not None:
                fence.record()

    def upload(
        self,
        arrays: Sequence[np.ndarray],
        into: torch.Tensor | None = None,
        fields: Sequence[np.ndarray] = (),
    ) -> list[torch.Tensor]:
        """The device tensors of ``arrays`` (views of one copy; no copy when all are empty).

        ``fields``: arrays that cast safely to ``into``'s dtype, written back to back from
        the start of the device tensor ``into`` (a graph's static inputs) by a copy of their
        own from the same buffer, so no device kernel moves them.

        Arrays that are all 1-D of one 8-byte dtype (a step's int64 inputs) are packed by one
        concatenate and viewed by one ``split``: a step's twelve took 25.8 us of host time
        against 64.7 with a view per array (CPU, 2026-12-07, benchmarks/results/*-s39.md)."""
        field_bytes = 0
        if fields:
            assert into is not None, "fields go into a device tensor"
            field_dtype = _numpy_dtype(into.dtype)
            field_bytes = sum(f.size for f in fields) * field_dtype.itemsize
        start = -(-field_bytes // 8) * 8
        uniform = _uniform_8_byte(arrays)
        if uniform is not None:  # back to back, aligned already
            offsets = None
            total = start + sum(a.nbytes for a in arrays)
        else:
            arrays = [np.ascontiguousarray(a) for a in arrays]
            offsets, total = [], start
            for a in arrays:
                offsets.append(total)
                total += -(-a.nbytes // 8) * 8
        i, buffer, host = self._host_buffer(total)
        if field_bytes:  # one copy into the buffer for all of them, then one to ``into``
            out = host[:field_bytes].view(field_dtype)
            np.concatenate(fields, out=out, casting="safe")  # widened to into's dtype
            into[: out.size].copy_(buffer[:field_bytes].view(into.dtype), non_blocking=self._cuda)
        if total > start:
            if uniform is not None:
                np.concatenate(arrays, out=host[start:total].view(uniform))
            else:
                for a, at in zip(arrays, offsets, strict=True):
                    host[at : at + a.nbytes] = a.reshape(-1).view(np.uint8)
            dev = buffer[start:total].to(self.device, non_blocking=self._cuda, copy=True)
        if field_bytes or total > start:
            self._unfenced = i
        if total == start:  # nothing but fields (or nothing at all): empty device tensors
            return [self._empty_of(a) for a in arrays]
        if uniform is not None:
            return list(dev.view(_torch_dtype(uniform)).split([a.size for a in arrays]))
        # a 1-D array's view has its shape already: no second view (the sampling columns'
        # gather, 4-6 such arrays, went from 50-75 to 41-62 us; CPU, 2026-12-07)
        views = []
        for a, at in zip(arrays, offsets, strict=True):
            t = dev[at - start : at - start + a.nbytes].view(_torch_dtype(a.dtype))
            views.append(t if a.ndim == 1 else t.view(a.shape))
        return views

    def _host_buffer(self, nbytes: int) -> tuple[int, torch.Tensor, np.ndarray]:
        """The next buffer's index, tensor and bytes (grown to ``nbytes``), once its fence
        passed (the last upload's fence recorded first, if still pending)."""
        self.fence()
        i, self._next = self._next, (self._next + 1) % self.BUFFERS
        fence = self._fences[i]
        if fence is not None:
            fence.synchronize()
        buffer = self._buffers[i]
        if buffer is None or buffer.numel() < nbytes:
            size = max(2 * nbytes, 1 << 12)
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self._cuda)
            self._buffers[i], self._hosts[i] = buffer, buffer.numpy()
        host = self._hosts[i]
        assert host is not None
        return i, buffer, host

    def _empty_of(self, a: np.ndarray) -> torch.Tensor:
        """A device tensor of ``a``'s dtype and (empty) shape, a view of one kept per dtype."""
        empty = self._empty.get(a.dtype)
        if empty is None:
            empty = torch.empty(0, dtype=_torch_dtype(a.dtype), device=self.device)
            self._empty[a.dtype] = empty
        return empty if a.ndim == 1 else empty.view(a.shape)


_TORCH_DTYPES: dict[np.dtype, torch.dtype] = {}


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    found = _TORCH_DTYPES.get(dtype)
    if found is None:
        found = _TORCH_DTYPES[dtype] = torch.from_numpy(np.zeros(0, dtype)).dtype
    return found


_NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {}


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    found = _NUMPY_DTYPES.get(dtype)
    if found is None:
        found = _NUMPY_DTYPES[dtype] = torch.empty(0, dtype=dtype).numpy().dtype
    return found


def _uniform_8_byte(arrays: list[np.ndarray]) -> np.dtype | None:
    """The arrays' dtype when all are 1-D of one 8-byte dtype (a step's int64 inputs: packed
    back to back by one concatenate, viewed by one split), else None."""
    if not arrays:
        return None
    first = arrays[0].dtype
    if first.itemsize == 8 and all(a.dtype == first and a.ndim == 1 for a in arrays):
        return first
    return None
