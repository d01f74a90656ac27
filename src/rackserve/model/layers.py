"""Small building blocks: RMSNorm, rotary tables, mHC hyper-connections, grouped linear,
fused weights.

Parameter names follow the checkpoint (``save_pretrained``) spelling so a state dict maps
one to one. Parameters the reference keeps in float32 (norm weights, mHC, sinks, biases)
are created float32 and stay so when the model is cast (see ``FP32_PARAM_SUFFIXES``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from rackserve import ops
from rackserve.config import ModelConfig, RopeConfig

# Parameter-name suffixes kept in float32 whatever the model dtype, as the reference does.
FP32_PARAM_SUFFIXES = (
    "norm.weight",
    "hc_attn_fn",
    "hc_attn_base",
    "hc_attn_scale",
    "hc_ffn_fn",
    "hc_ffn_base",
    "hc_ffn_scale",
    "hc_head_fn",
    "hc_head_base",
    "hc_head_scale",
    "hc_head.hc_fn",
    "hc_head.hc_base",
    "hc_head.hc_scale",
    "attn_sink",
    "ape",
    "gate.bias",
    # block scales of quantized weights (model/quant.py, model/moe.py)
    "weight_scale_inv",
    "w13_scale",
    "w2_scale",
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


def rope_inv_freq(rope: RopeConfig, rope_dim: int) -> torch.Tensor:
    """Inverse frequencies [rope_dim / 2] for plain RoPE or YaRN (NTK-by-parts)."""
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    pos_freqs = rope.theta**exponents
    if rope.rope_type == "default":
        return 1.0 / pos_freqs

    def correction_dim(num_rotations: float) -> float:
        return (
            rope_dim
            * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi))
            / (2 * math.log(rope.theta))
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency; 0: interpolate by `factor`
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation


class Rotary(nn.Module):
    """cos/sin tables for one rope setting; positions are absolute token positions."""

    def __init__(self, rope: RopeConfig, rope_dim: int, kernels: ops.Kernels) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(rope, rope_dim), persistent=False)
        self.scale = rope.attention_factor
        self.kernels = kernels

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.rope_cos_sin(positions, self.inv_freq, self.scale, dtype)


def hc_params(cfg: ModelConfig) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
    """mHC parameters around one block: fn [(2+N)N, N*D], base [(2+N)N], scale [3]."""
    n = cfg.hc_mult
    mixes = (2 + n) * n
    return (
        nn.Parameter(torch.zeros(mixes, n * cfg.hidden_size, dtype=torch.float32)),
        nn.Parameter(torch.zeros(mixes, dtype=torch.float32)),
        nn.Parameter(torch.ones(3, dtype=torch.float32)),
    )


class HyperHead(nn.Module):
    """Final collapse of the N streams (sigmoid weights, no Sinkhorn), then the final norm."""

    def __init__(self, cfg: ModelConfig, kernels: ops.Kernels) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.kernels = kernels
        self.hc_fn = nn.Parameter(torch.zeros(n, n * cfg.hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.hc_eps = cfg.hc_eps
        self.norm_eps = cfg.rms_norm_eps

    def forward(
        self, streams: torch.Tensor, norm: RMSNorm, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """streams: [T, N, D] -> the final normed hidden [T, D] (``norm``: the model's);
        ``rows``: of those rows only, [S, D] (the rows that need logits)."""
        if rows is not None:
            streams = streams.index_select(0, rows)
        return self.kernels.hc_head(
            streams, self.hc_fn, self.hc_base, self.hc_scale, self.hc_eps, self.norm_eps,
            norm.weight,
        )  # fmt: skip


def is_plain_linear(module: nn.Module) -> bool:
    """A bias-free ``nn.Linear`` (not a quantized module): the op table computes it."""
    return type(module) is nn.Linear and module.bias is None


def linear(kernels: ops.Kernels, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``: a plain bias-free ``nn.Linear`` through ``kernels.linear`` (on a GPU,
    the split-K GEMV at decode sizes when enabled); other modules (FP8) as they are."""
    if is_plain_linear(module):
        return kernels.linear(x, module.weight)
    return module(x)


def grouped_linear(kernels: ops.Kernels, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` of x [T, G, in]: a ``GroupedLinear`` through ``kernels.grouped_linear``
    (on a GPU, the grouped GEMV at decode sizes); other modules (FP8) as they are."""
    if type(module) is GroupedLinear:
        return kernels.grouped_linear(x, module.weight)
    return module(x)


class GroupedLinear(nn.Module):
    """Block-diagonal projection: G groups of `in_per_group` -> `out_per_group` each.

    weight: [G * out_per_group, in_per_group] (the checkpoint's ``wo_a``).
    """

    def __init__(self, in_per_group: int, out_per_group: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups * out_per_group, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, G, in] -> [T, G * out]
        return ops.reference.grouped_linear(x, self.weight)


class FusedWeights:
    """One tensor built from several Parameters, which then become views into it, so the
    fast path runs one GEMM (or one MoE launch) where the checkpoint has several weights.

    Checkpoint names, ``state_dict`` and ``load_state_dict`` are unchanged (loading copies
    into the views). ``build`` makes the fused tensor from the parameters' tensors, ``split``
    the views of a fused tensor, one per parameter (same shapes). The fusion is made on the
    first :meth:`get` and again whenever a parameter stopped being its view (``.to()``,
    ``cast`` and assigning loads replace ``.data``); never inside a CUDA-graph capture.
    """

    def __init__(
        self,
        params: Sequence[tuple[nn.Module, str]],
        build: Callable[[list[torch.Tensor]], torch.Tensor],
        split: Callable[[torch.Tensor], list[torch.Tensor]],
    ) -> None:
        self.params, self.build, self.split = list(params), build, split
        self.fused: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []

    def _tensors(self) -> list[torch.Tensor]:
        return [getattr(m, name) for m, name in self.params]

    def intact(self) -> bool:
        """Whether every parameter still is its view of the fused tensor."""
        if self.fused is None:
            return False
        return all(
            p.data_ptr() == v.data_ptr()
            and p.shape == v.shape
            and p.stride() == v.stride()
            and p.dtype == v.dtype
            and p.device == v.device
            for p, v in zip(self._tensors(), self.views, strict=True)
        )

    def get(self) -> torch.Tensor:
        if not self.intact():
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("weights are fused on the first eager step, not in a capture")
            with torch.inference_mode(False), torch.no_grad():
                params = self._tensors()
                fused = self.build([p.detach() for p in params])
                views = self.split(fused)
                for (m, name), p, v in zip(self.params, params, views, strict=True):
                    if v.shape != p.shape:
                        raise ValueError(f"fused view {tuple(v.shape)} != {tuple(p.shape)}")
                    # a new Parameter, not ``p.data = v``: a Parameter made under inference
                    # mode keeps its inference-tensor flags through ``.data =`` and then fails
                    # in every op ("Inference tensors do not track version counter")
                    setattr(m, name, nn.Parameter(v, requires_grad=p.requires_grad))
            self.fused, self.views = fused, views
        assert self.fused is not None
        return self.fused
