"""What every kernel microbenchmark (``*_bench.py``) times and stamps its records with."""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
import triton.testing


def time_us(fn: Callable[[], object]) -> tuple[float, float | None]:
    """(do_bench median, do_bench_cudagraph median) in microseconds: L2 flushed and launch
    included, then inside a CUDA graph (what decode sees); None for an op that cannot be
    captured (a reference that syncs)."""
    plain = triton.testing.do_bench(fn, return_mode="median") * 1e3
    try:
        graph = triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3
    except Exception:
        graph = None
    return plain, graph


def stamped(records: list[dict], device: torch.device) -> list[dict]:
    """``records`` with the GPU's name and today's date."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    meta = {"gpu": gpu, "date": datetime.date.today().isoformat()}
    return [r | meta for r in records]
