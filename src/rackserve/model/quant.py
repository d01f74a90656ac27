"""Modules on quantized weights: ``Fp8Linear`` (FP8 block-scaled linear or grouped
linear) and the choice of which linears a checkpoint stores in FP8. Formats and the per-op
math are in ``ops/quant.py``; FP4 routed experts live in ``model/moe.py``'s ``Experts``.
"""

from __future__ import annotations

import torch
from torch import nn

from rackserve import ops
from rackserve.config import FP8_BLOCK
from rackserve.model.layers import GroupedLinear
from rackserve.ops.quant import FP8_DTYPE

# Linears DeepSeek-V4-Flash ships in bf16 (transformers' `_keep_in_fp32_modules` list): the
# compressors (also the indexer's) and the indexer's head weights; the LM head too.
BF16_LINEARS = ("compressor.", "indexer.weights_proj", "head")


# ---- modules -------------------------------------------------------------------------------
class Fp8Linear(nn.Module):
    """A linear (or block-diagonal grouped linear) whose weight stays FP8 block-scaled.

    weight: float8 e4m3 [N, K] (grouped: [G * out, in], the checkpoint's ``wo_a``);
    weight_scale_inv: fp32 [cdiv(N, 128), cdiv(K, 128)]. forward: x [..., K] (grouped:
    [T, G, in]) -> [..., N] (grouped: [T, G * out]) in x's dtype.
    """

    def __init__(
        self, out_features: int, in_features: int, kernels: ops.Kernels, groups: int = 0
    ) -> None:
        super().__init__()
        self.kernels = kernels
        self.groups = groups  # 0: a plain linear
        self.in_features, self.out_features = in_features, out_features
        w = torch.empty(out_features, in_features, dtype=FP8_DTYPE)
        self.weight = nn.Parameter(w, requires_grad=False)
        bn, bk = FP8_BLOCK
        s = torch.empty(-(-out_features // bn), -(-in_features // bk), dtype=torch.float32)
        self.weight_scale_inv = nn.Parameter(s, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.fp8_linear(x, self.weight, self.weight_scale_inv, self.groups)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, groups={self.groups}, fp8"


def fp8_linear_names(model: nn.Module) -> list[str]:
    """The linears DeepSeek-V4-Flash stores in FP8: every ``nn.Linear`` / ``GroupedLinear``
    except the compressors, the indexer's head weights and the LM head."""
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, (nn.Linear, GroupedLinear))
        and not any(part in name + "." for part in BF16_LINEARS if part != "head")
        and name != "head"
    ]


def quantize_linears_(model: nn.Module, names: set[str] | list[str], kernels: ops.Kernels) -> None:
    """Replace the named ``nn.Linear`` / ``GroupedLinear`` modules by empty ``Fp8Linear``s
    on the same device (the loader or ``init_fp8_`` fills them)."""
    wanted = set(names)
    for name, module in list(model.named_modules()):
        if name not in wanted:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        device = module.weight.device
        with torch.device(device):
            if isinstance(module, GroupedLinear):
                out, inp = module.weight.shape
                new = Fp8Linear(out, inp, kernels, groups=module.groups)
            elif isinstance(module, nn.Linear):
                new = Fp8Linear(module.out_features, module.in_features, kernels)
            else:
                raise TypeError(f"{name} is a {type(module).__name__}, not a linear")
        setattr(parent, child, new)
        wanted.discard(name)
    if wanted:
        raise KeyError(f"no linear named {sorted(wanted)[:5]} in the model")


def weight_memory(model: nn.Module) -> dict[str, int]:
    """Bytes of the weights as held (works on the meta device): routed experts, FP8
    linears (weights + scales) and the rest (embeddings, head, norms, bf16 linears)."""
    out = {"experts": 0, "fp8_linears": 0, "other": 0}
    for name, p in model.named_parameters():
        kind = "other"
        if ".experts." in name:
            kind = "experts"
        elif p.dtype == FP8_DTYPE or name.endswith("weight_scale_inv"):
            kind = "fp8_linears"
        out[kind] += p.numel() * p.element_size()
    out["total"] = sum(out.values())
    return out
