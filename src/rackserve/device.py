"""Where the model runs and in which dtype: the defaults every entry point shares."""

from __future__ import annotations

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
