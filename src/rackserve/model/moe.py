"""Mixture-of-Experts block: router (learned top-k or hash table), routed experts, shared
expert.

Shape legend: T tokens, D hidden, E routed experts, k experts per token, I expert width.
Checkpoint names: ``gate.weight`` [E, D], ``gate.bias`` [E] (score correction, selection
only), ``gate.tid2eid`` [V, k] (hash layers), ``experts.{e}.w1/w3`` [I, D] (gate / up),
``experts.{e}.w2`` [D, I], ``shared_experts.w1/w2/w3``. Experts are stored stacked
(``w13`` [E, 2I, D], ``w2`` [E, D, I]); the loader fills them expert by expert.

Expert parallelism (EP size > 1, ``moe/ep.py``): ``Experts`` holds only this rank's S_r
physical slots (``w13`` [S_r, 2I, D]; ``slot_experts`` says which logical expert each
slot starts with, for the loader) and the block sends its tokens through the dispatcher:

    ids, weights = gate(x)                        # [T, k] logical
    routed = dispatch(layer, x, ids, weights)     # rows for this rank's slots: [N, D]
    out = combine(experts(routed), routed)        # [T, D]; + shared expert (local)

One rank keeps the plain path (and its CUDA graphs); EP runs eagerly (dispatch syncs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from rackserve import ops
from rackserve.config import ModelConfig
from rackserve.model.layers import FusedWeights
from rackserve.moe.dispatch import run_local_experts, run_local_experts_fp4

if TYPE_CHECKING:
    from rackserve.moe.ep import ExpertParallel


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
    """Stacked expert weights: every expert (one rank), or this rank's slots (EP), where
    ``slot_experts[s]`` is the logical expert slot s holds at load time."""

    def __init__(
        self, cfg: ModelConfig, kernels: ops.Kernels, slot_experts: list[int] | None = None
    ) -> None:
        super().__init__()
        self.kernels = kernels
        d, i = cfg.hidden_size, cfg.moe_intermediate_size
        if slot_experts is None:
            slot_experts = list(range(cfg.n_routed_experts))
        self.slot_experts = slot_experts
        self.limit = cfg.swiglu_limit
        s, q = len(slot_experts), cfg.quantization
        self.fp4 = q is not None and q.expert_dtype == "fp4"
        if not self.fp4:
            self.w13 = nn.Parameter(torch.empty(s, 2 * i, d))
            self.w2 = nn.Parameter(torch.empty(s, d, i))
            return
        # FP4 (ops/quant.py): packed e2m1 bytes + one scale per 32 inputs (ue8m0 as bytes);
        # never a full-precision copy
        assert q is not None
        sdt = torch.uint8 if q.scale_fmt == "ue8m0" else torch.float32
        for name, n, k in (("w13", 2 * i, d), ("w2", d, i)):
            packed = torch.empty(s, n, k // 2, dtype=torch.uint8)
            setattr(self, name, nn.Parameter(packed, requires_grad=False))
            scale = torch.empty(s, n, k // 32, dtype=sdt)
            setattr(self, f"{name}_scale", nn.Parameter(scale, requires_grad=False))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.fp4:
            return self.kernels.moe_experts_fp4(
                x, ids, weights, self.w13, self.w13_scale, self.w2, self.w2_scale, self.limit
            )
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
    def __init__(
        self,
        cfg: ModelConfig,
        hashed: bool,
        kernels: ops.Kernels,
        layer_id: int = 0,
        expert_parallel: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        # its layer among the EP model's (MTP layers: 0.. of the "mtp" EP model)
        self.layer_id = (
            layer_id if expert_parallel is None else expert_parallel.layer_index(layer_id)
        )
        self.ep = expert_parallel
        self.gate = Router(cfg, hashed, kernels)
        slots = None if expert_parallel is None else expert_parallel.local_experts(self.layer_id)
        self.experts = Experts(cfg, kernels, slots)
        self.shared_experts = SharedExpert(cfg) if cfg.n_shared_experts else None
        self._folded: tuple[FusedWeights, FusedWeights] | None = None

    def _fast_experts(self, x: torch.Tensor) -> bool:
        """Whether the fast path runs the router and experts fused (one rank, 16/32-bit
        experts; FP4 / FP8 experts take their own kernels through ``Experts``)."""
        ex = self.experts
        return (
            self.ep is None
            and self.kernels.fast(x)
            and isinstance(ex, Experts)
            and not ex.fp4
            and ex.w13.element_size() > 1
        )

    def _with_shared(self) -> tuple[FusedWeights, FusedWeights] | None:
        """The shared expert folded in as expert E, or None when there is none or its
        linears are not plain ``nn.Linear`` (FP8); rebuilt when the loader swapped them."""
        sh = self.shared_experts
        if sh is None or not all(type(m) is nn.Linear for m in (sh.w1, sh.w2, sh.w3)):
            return None
        folded = self._folded
        stale = folded is not None and (
            folded[0].params[1][0] is not sh.w1 or folded[1].params[1][0] is not sh.w2
        )
        if folded is None or stale:
            folded = self._folded = self._fold_shared()
        return folded

    def _fold_shared(self) -> tuple[FusedWeights, FusedWeights]:
        """The fast path's expert weights with the shared expert as expert E (one more
        slot, picked by every token with weight 1): w13 [E+1, 2I, D], w2 [E+1, D, I]."""
        ex, sh = self.experts, self.shared_experts
        assert sh is not None
        w13 = FusedWeights(
            [(ex, "w13"), (sh.w1, "weight"), (sh.w3, "weight")],
            lambda p: torch.cat([p[0], torch.cat([p[1], p[2]])[None]]),
            lambda f: [f[:-1], f[-1, : f.shape[1] // 2], f[-1, f.shape[1] // 2 :]],
        )
        w2 = FusedWeights(
            [(ex, "w2"), (sh.w2, "weight")],
            lambda p: torch.cat([p[0], p[1][None]]),
            lambda f: [f[:-1], f[-1]],
        )
        return w13, w2

    def forward(
        self,
        x: torch.Tensor,
        input_ids: torch.Tensor,
        expert_counts: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        defer_sum: bool = False,
    ) -> torch.Tensor | ops.ExpertSlots:
        """x: [T, D]; expert_counts: optional [E] accumulator of routed tokens (for EPLB),
        counting only tokens where ``token_mask`` [T] is True (None: all). ``defer_sum``:
        the fast path may return the unsummed ``ops.ExpertSlots``, for an mHC post."""
        if self._fast_experts(x):
            return self._fast_forward(x, input_ids, expert_counts, token_mask, defer_sum)
        ids, weights = self.gate(x, input_ids)
        if self.ep is not None:
            out = self._expert_parallel(x, ids, weights)
            if self.shared_experts is not None:
                out = out + self.shared_experts(x)
            return out
        if expert_counts is not None:  # index_add_, not bincount: no host sync
            ones = torch.ones_like(ids, dtype=expert_counts.dtype)
            if token_mask is not None:
                ones *= token_mask[:, None]
            expert_counts.index_add_(0, ids.flatten(), ones.flatten())
        out = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def fuse_weights(self) -> None:
        """Build the fast path's expert weights with the shared expert now (no-op on the
        reference path and with expert parallelism)."""
        folded = self._with_shared()
        if folded is not None and self._fast_experts(self.experts.w13):
            for fused in folded:
                fused.get()

    def _fast_forward(
        self,
        x: torch.Tensor,
        input_ids: torch.Tensor,
        expert_counts: torch.Tensor | None,
        token_mask: torch.Tensor | None,
        defer_sum: bool = False,
    ) -> torch.Tensor | ops.ExpertSlots:
        """The router (with the counts and the shared expert's pick) and every expert in
        one fused MoE: the logits GEMM + 4 launches where the reference path takes ~20
        (3 with ``defer_sum``: the slots' sum is left to the consumer)."""
        gate, experts = self.gate, self.experts
        w13, w2, shared = experts.w13, experts.w2, None
        folded = self._with_shared()
        if folded is not None:
            w13, w2 = (f.get() for f in folded)
            shared = w13.shape[0] - 1
        out = self.kernels.moe_routed(
            x,
            gate.weight,
            None if gate.hashed else gate.bias,
            gate.tid2eid if gate.hashed else None,
            input_ids,
            gate.top_k,
            gate.scoring_func,
            gate.scaling,
            shared,
            expert_counts,
            token_mask,
            w13,
            w2,
            experts.limit,
            # an unfolded (FP8) shared expert is added below, to the summed output
            defer_sum=defer_sum and (folded is not None or self.shared_experts is None),
        )
        if folded is None and self.shared_experts is not None:  # an FP8 shared expert
            out = out + self.shared_experts(x)
        return out

    def _expert_parallel(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        # x: [T, D]; ids, weights: [T, k] -> routed experts' output [T, D]. T may be 0 (an
        # idle rank's dummy pass): the collectives still run.
        ep, experts = self.ep, self.experts
        assert ep is not None
        routed = ep.dispatcher.dispatch(self.layer_id, x, ids, weights)
        ep.recorder.record(self.layer_id, ids, routed.slots, ep.placement)
        if experts.fp4:  # packed weights and their scales, sharded by slot alike
            y = run_local_experts_fp4(
                routed, experts.w13, experts.w13_scale, experts.w2, experts.w2_scale,
                experts.limit, experts.kernels.moe_experts_fp4,
            )  # fmt: skip
        else:
            y = run_local_experts(
                routed, experts.w13, experts.w2, experts.limit, experts.kernels.moe_experts
            )
        return ep.dispatcher.combine(y, routed)
