"""Session 39's A/B: ``StepBuffers.upload`` as it was before it staged through
``device.PinnedStaging`` (4529a44: two alternating pinned int64 buffers of its own, no
event), patched in for the "old" arm of ``gpu_s39b.sh``."""

from __future__ import annotations

import torch

from rackserve.runner import step_buffers


def _upload(self, arrays, into=None, fields=()):
    num_fields = sum(len(a) for a in fields)
    sizes = [len(a) for a in arrays]
    total = num_fields + sum(sizes)
    if not hasattr(self, "_old"):
        self._old, self._old_next = [], 0
    i, self._old_next = self._old_next, self._old_next ^ 1
    if len(self._old) <= i:
        self._old.append(torch.empty(0, dtype=torch.int64))
    if self._old[i].numel() < total:
        self._old[i] = torch.empty(max(2 * total, 1 << 16), dtype=torch.int64, pin_memory=True)
    staging = self._old[i]
    host = staging.numpy()
    start = 0
    for a in (*fields, *arrays):
        host[start : start + len(a)] = a
        start += len(a)
    if num_fields:
        into[:num_fields].copy_(staging[:num_fields], non_blocking=True)
    if into is not None and total == num_fields:
        return [into[:0]] * len(arrays)
    dev = staging[num_fields:total].to(self.device, non_blocking=True)
    return list(dev.split(sizes))


step_buffers.StepBuffers.upload = _upload
