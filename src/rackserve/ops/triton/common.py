"""Helpers shared by the Triton kernels."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

# Programmatic dependent launch (PDL) between the Triton kernels of a step, opt-in
# ($RACKSERVE_PDL=1): a kernel launched with it is scheduled while the one before it ends and
# waits in ``pdl_wait``. It works inside CUDA graphs on the H200 (torch 2.11, CUDA 13, Triton
# 3.6): 64 one-program kernels in a graph, 1.05 -> 0.68 us a boundary (pdl_probe.py). In the
# decode step it bought nothing (2026-12-03-h200-s16.md, bench forward decode:1@4096,
# alternating processes): with the dependents released at the top of each kernel
# (griddepcontrol.launch_dependents) 1.30-1.36 ms against 1.25 without PDL; released at each
# kernel's end, as here, 1.22-1.29 against 1.26. The step's gaps are 0.44 us a boundary.
PDL_ENV = "RACKSERVE_PDL"
PDL_ON = os.environ.get(PDL_ENV, "0") == "1"  # read once: pdl() runs at every launch


def pdl(device: torch.device) -> dict[str, bool]:
    """A launch's PDL arguments: the kernels' ``PDL`` constexpr and Triton's ``launch_pdl``
    (on a CUDA device when $RACKSERVE_PDL was "1" at import; never under the interpreter)."""
    on = PDL_ON and device.type == "cuda"
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """A PDL kernel's first statement: wait until the kernel before it has finished and its
    writes are visible. Every program runs it before anything else (early returns
    included), so each kernel's body runs after the whole previous kernel, as without PDL:
    what overlaps is launch and scheduling. The next kernel's blocks are released as this
    one's exit."""
    if PDL:
        gdc_wait()


@triton.jit
def round_as(y, dtype: tl.constexpr):
    """y (fp32) rounded to ``dtype`` (nearest even) and returned as fp32.

    bfloat16 is rounded by hand: the Triton interpreter's float32 -> bfloat16 cast truncates
    (CPU tests would see 1-ulp errors); on the GPU this is the same RTNE as the hardware cast.
    """
    if dtype == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        y = tl.where(y == y, rounded.to(tl.float32, bitcast=True), y)  # NaN stays NaN
    return y.to(dtype).to(tl.float32)


# the arrival counters of the kernels whose last program of a group reduces the group's
# partials (one launch where a second would reduce): (op, device) -> int32 zeros
ARRIVALS: dict[tuple[str, torch.device], torch.Tensor] = {}


def arrival_counters(
    op: str, device: torch.device, count: int, minimum: int = 256
) -> torch.Tensor | None:
    """``count`` int32 arrival counters of ``op`` (at least ``minimum`` are made), kept per
    op and device and left at zero by every launch: the program that arrives last at its
    group's counter reduces the group and resets it. None while a CUDA graph is captured
    and no buffer is large enough (allocating there would tie it to the graph's pool): that
    call takes the two-launch path. An op's launches on a device must run on one stream at
    a time (they do: the model's main stream; side-stream work takes no such op)."""
    key = (op, device)
    buf = ARRIVALS.get(key)
    if buf is None or buf.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = torch.zeros(max(minimum, count), dtype=torch.int32, device=device)
        ARRIVALS[key] = buf
    return buf


@triton.jit
def last_to_arrive(counter_ptr, num_splits):
    """After a split stored its partial: whether it is the last of ``num_splits`` at the
    counter (then every other partial is stored and visible to its ``.cg`` loads, and the
    counter is reset to zero for the next launch)."""
    tl.debug_barrier()  # every thread's partial stores before the release below
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == num_splits - 1
    if last:
        tl.store(counter_ptr, 0)
    return last
