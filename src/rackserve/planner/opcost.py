"""Shared pieces of the byte/FLOP counting: batch shape, op cost, GEMM / memory / MoE ops."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from rackserve.planner.models import Formats

# Op kinds: each gets its own efficiency factor in cost.py.
GEMM, MOE, ATTENTION, INDEXER, MEMORY = "gemm", "moe", "attention", "indexer", "memory"


@dataclass(frozen=True)
class BatchShape:
    """One rank's batch: ``num_requests`` requests, each adding ``new_tokens`` tokens on top
    of ``context_len`` tokens already in its KV cache (prefill chunk: n large; decode: n =
    1 + draft tokens)."""

    num_requests: int
    new_tokens: int
    context_len: int

    def __post_init__(self) -> None:
        if self.num_requests < 0 or self.new_tokens < 1 or self.context_len < 0:
            raise ValueError("BatchShape needs num_requests >= 0, new_tokens >= 1, context >= 0")

    @property
    def num_tokens(self) -> int:
        return self.num_requests * self.new_tokens

    @property
    def mean_visible(self) -> float:
        """Mean number of earlier-or-same tokens a new token attends to (causal)."""
        return self.context_len + (self.new_tokens + 1) / 2


@dataclass(frozen=True)
class OpCost:
    """One op summed over the layers it appears in (``launches`` = kernel launches)."""

    name: str
    kind: str
    precision: str
    flops: float
    bytes_read: float
    bytes_written: float
    launches: int = 1

    @property
    def bytes(self) -> float:
        return self.bytes_read + self.bytes_written


def expert_union(num_experts: int, top_k: int, num_tokens: float) -> float:
    """Expected number of distinct experts hit by ``num_tokens`` tokens routing to ``top_k``
    of ``num_experts`` uniformly: E (1 - (1 - K/E)^tokens)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def _gemm(
    name: str, m: float, k: int, n: int, w_bytes: float, act: float, prec: str, kind: str = GEMM
) -> OpCost:
    # y[m, n] = x[m, k] @ w[k, n]: the weight is read once, activations once each way.
    return OpCost(name, kind, prec, 2.0 * m * k * n, k * n * w_bytes + m * k * act, m * n * act)


def _mem(name: str, read: float, written: float, flops: float = 0.0) -> OpCost:
    return OpCost(name, MEMORY, "bf16", flops, read, written)


def _sum_by_name(ops: Iterable[OpCost]) -> list[OpCost]:
    merged: dict[str, OpCost] = {}
    for op in ops:
        if op.flops == 0 and op.bytes == 0:
            continue
        prev = merged.get(op.name)
        merged[op.name] = (
            op
            if prev is None
            else OpCost(
                op.name,
                op.kind,
                op.precision,
                prev.flops + op.flops,
                prev.bytes_read + op.bytes_read,
                prev.bytes_written + op.bytes_written,
                prev.launches + op.launches,
            )
        )
    return list(merged.values())


def _moe_ops(
    T: int, D: int, F: int, E: int, K: int, n_shared: int, f: Formats, ep_size: int
) -> list[OpCost]:
    """Router, shared expert and this rank's routed experts for T local tokens."""
    a = f.act_bytes
    pairs = T * K  # (token, expert) pairs this rank computes, balanced EP average
    local_experts = E / ep_size
    hit = local_experts * (1.0 - (1.0 - K / E) ** (T * ep_size))  # union over the EP group
    expert_w = 3.0 * D * F * f.expert_bytes
    ops = [_gemm("moe.router", T, D, E, 2.0, a, "bf16")]
    if n_shared:
        ops += [
            _gemm("moe.shared_up", T, D, 2 * F * n_shared, f.weight_bytes, a, f.gemm_precision),
            _gemm("moe.shared_down", T, F * n_shared, D, f.weight_bytes, a, f.gemm_precision),
        ]
    ops.append(
        OpCost(
            "moe.experts",
            MOE,
            f.expert_precision,
            2.0 * 3 * D * F * pairs,
            hit * expert_w + pairs * (D * f.dispatch_bytes + 2 * F * a),
            pairs * (F + D) * a,
        )
    )
    # SwiGLU between the two expert GEMMs (BF16 in, FP8 out), then the weighted
    # un-permute back to token order (dispatch writes tokens straight into expert order).
    ops.append(_mem("moe.act", pairs * 2 * F * a, pairs * F * f.dispatch_bytes))
    ops.append(_mem("moe.unpermute", pairs * D * a, T * D * a))
    return ops
