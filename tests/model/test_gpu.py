"""GPU checks (``pytest -m gpu``; never in CI): bf16 on the GPU tracks fp32 on the CPU."""

from __future__ import annotations

import pytest
import torch

from rackserve.model.create import create_checkpoint
from rackserve.model.generate import ContiguousCache
from rackserve.model.loader import load_model
from rackserve.model.presets import tiny_config

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_gpu_logits_track_fp32_cpu(tmp_path):
    path = create_checkpoint(tiny_config(), tmp_path, seed=0)
    ids = torch.randint(2, 4000, (230,), generator=torch.Generator().manual_seed(0))
    logits = {}
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
        model = load_model(path, dtype=dtype, device=device)
        cache = ContiguousCache(model, 1, len(ids))
        with torch.inference_mode():
            hidden, _ = model(ids.to(device), cache.batch([0], [len(ids)], [0]), cache.tensors)
            logits[device] = model.compute_logits(hidden).cpu()
    ref, got = logits["cpu"], logits["cuda"]
    # Per position: bf16 rounding is ~1%, but a rounding difference at an indexer top-k
    # near-tie swaps a compressed entry, so a few positions move further (CPU bf16 vs fp32
    # on this model: median 0.7%, max 23%, argmax agreement 97%).
    rel = (got - ref).abs().max(dim=-1).values / ref.abs().max()
    assert rel.median().item() < 0.02, rel.median().item()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree > 0.9, agree
