"""The reference model for parity tests: transformers' DeepseekV4ForCausalLM, random weights."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rackserve.config import ModelConfig


def hf_reference(cfg: ModelConfig, out_dir: Path, seed: int = 0):
    """Build transformers' DeepseekV4ForCausalLM with every parameter random (including the
    ones the reference initialises to constants, so no term can hide), save it to
    ``out_dir`` and return it in eval mode."""
    transformers = pytest.importorskip("transformers")
    d = cfg.to_hf_dict()
    d.pop("architectures")
    d.pop("model_type")
    hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**d)).eval()
    g = torch.Generator().manual_seed(seed)

    def randn(shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=g)

    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") or name.endswith("scale"):
                p.copy_(1 + 0.2 * randn(p.shape))
            elif "position_bias" in name or name.endswith("sinks"):
                p.copy_(randn(p.shape))
            elif name.endswith(("base", "e_score_correction_bias")):
                p.copy_(0.2 * randn(p.shape))
            else:
                p.copy_(randn(p.shape) / math.sqrt(p.shape[-1]))
        for name, b in hf.named_buffers():
            if name.endswith("tid2eid"):  # the reference leaves zeros: use distinct experts
                perm = torch.rand(b.shape[0], cfg.n_routed_experts, generator=g).argsort(-1)
                b.copy_(perm[:, : b.shape[1]])
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * randn(b.shape))
    hf.save_pretrained(out_dir)
    return hf
