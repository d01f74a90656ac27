"""Mixture-of-Experts block: router (learned top-k or hash table), routed experts, shared
expert.

Shape legend: T tokens, D hidden, E routed experts, k experts per token, I expert width.
Checkpoint names: ``gate.weight`` [E, D], ``gate.bias`` [E] (score correction, selection
only), ``gate.tid2eid`` [V, k] (hash layers), ``experts.{e}.w1/w3`` [I, D] (gate / up),
``experts.{e}.w2`` [D, I], ``shared_experts.w1/w2/w3``. Experts are stored stacked
(``w13`` [E, 2I, D], ``w2`` [E, D, I]); the loader fills them expert by expert.
"""

from __future__ import annotations

import torch
from torch import nn

from rackserve import ops
from rackserve.config import ModelConfig


class Router(nn.Module):
    """Scores every expert; selects top-k by score + correction bias, or by the token-id
    table on hash layers. Weights are the selected scores, normalised, times the routed
    scaling factor."""

    def __init__(self, cfg: ModelConfig, hashed: bool, kernels: ops.Kernels) -> None:
        super().__init__()
        self.kernels = kernels
        self.top_k, self.scoring_func = cfg.num_experts_per_tok, cfg.scoring_func
        self.scaling = cfg.routed_scaling_factor
        self.hashed = hashed
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            table = torch.zeros(cfg.vocab_size, self.top_k, dtype=torch.int64)
            self.register_buffer("tid2eid", table)
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, D] -> topk_ids [T, k] int64, topk_weights [T, k] float32
        return self.kernels.route(
            x,
            self.weight,
            None if self.hashed else self.bias,
            self.tid2eid if self.hashed else None,
            input_ids,
            self.top_k,
            self.scoring_func,
            self.scaling,
        )


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: ops.Kernels) -> None:
        super().__init__()
        self.kernels = kernels
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, d))
        self.w2 = nn.Parameter(torch.empty(e, d, i))
        self.limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.kernels.moe_experts(x, ids, weights, self.w13, self.w2, self.limit)


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.w1 = nn.Linear(d, i, bias=False)
        self.w2 = nn.Linear(i, d, bias=False)
        self.w3 = nn.Linear(d, i, bias=False)
        self.limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(ops.swiglu(self.w1(x), self.w3(x), self.limit))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, hashed: bool, kernels: ops.Kernels) -> None:
        super().__init__()
        self.gate = Router(cfg, hashed, kernels)
        self.experts = Experts(cfg, kernels)
        self.shared_experts = SharedExpert(cfg) if cfg.n_shared_experts else None

    def forward(
        self,
        x: torch.Tensor,
        input_ids: torch.Tensor,
        expert_counts: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [T, D]; expert_counts: optional [E] accumulator of routed tokens (for EPLB),
        counting only tokens where ``token_mask`` [T] is True (None: all)."""
        ids, weights = self.gate(x, input_ids)
        if expert_counts is not None:  # index_add_, not bincount: no host sync
            ones = torch.ones_like(ids, dtype=expert_counts.dtype)
            if token_mask is not None:
                ones *= token_mask[:, None]
            expert_counts.index_add_(0, ids.flatten(), ones.flatten())
        out = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
