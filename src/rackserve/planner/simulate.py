"""Step times of prefill and decode instances, and their steady-state throughput.

A DEP instance of ``dep`` GPUs runs attention data-parallel (one batch per GPU) and spreads
the routed experts over the same GPUs. One engine step on the slowest rank takes

    compute(slowest rank) (+) all-to-all  +  CPU overhead

where (+) overlaps the two by ``Efficiency.overlap`` (two-batch overlap), the slowest rank's
attention-side work is the mean plus the expected max over ranks of its fluctuation (DP
imbalance), and MoE compute and all-to-all are divided by the EP balancedness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rackserve.planner.calibration import OpSite
from rackserve.planner.comm import (
    A2AShape,
    all_to_all_time,
    ep_balancedness,
    expected_max_std_normal,
    sum_cv,
)
from rackserve.planner.cost import Efficiency, op_time
from rackserve.planner.counting import (
    ATTENTION,
    INDEXER,
    MOE,
    BatchShape,
    kv_bytes_per_request_fixed,
    kv_bytes_per_token,
    step_ops,
    weight_bytes_per_rank,
)
from rackserve.planner.hardware import GpuSpec
from rackserve.planner.models import MlaConfig, PlannerModel

P90_Z = 1.2816  # standard-normal 90th percentile
STEP_TIME_CV = 0.05  # step-to-step jitter of decode steps (admissions, host noise)
HBM_USABLE = 0.9  # fraction of HBM for weights + KV (the rest: activations, workspace)


@dataclass(frozen=True)
class Workload:
    """Per-request token counts (means) and how much they vary.

    ``input_len`` counts all prompt tokens (cached + uncached); ``length_cv`` is the CV of
    per-request context length (0 for fixed-length benchmarks); ``step_load_cv`` is the CV
    of one rank's per-step prefill token load when ranks are fed independently (0 when
    every rank gets the same stream at the same time, "mirror").
    """

    input_len: int
    output_len: int
    cached_frac: float = 0.0
    turns: int = 1
    length_cv: float = 0.0
    step_load_cv: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.cached_frac < 1.0:
            raise ValueError("cached_frac must be in [0, 1): some input must be computed")
        if self.input_len < 1 or self.output_len < 1 or self.turns < 1:
            raise ValueError("input_len, output_len and turns must be >= 1")

    @property
    def uncached_len(self) -> int:
        return max(1, round(self.input_len * (1 - self.cached_frac)))

    @property
    def cached_len(self) -> int:
        return self.input_len - self.uncached_len

    @property
    def decode_context(self) -> int:
        """Mean context of a decode step over a request's output."""
        return self.input_len + self.output_len // 2


@dataclass(frozen=True)
class StepBreakdown:
    """Where one step's time goes on the slowest rank (seconds)."""

    op_times: tuple[tuple[str, float], ...]
    compute_s: float
    all_to_all_s: float
    cpu_s: float
    total_s: float
    dp_imbalance: float
    ep_balancedness: float
    site: OpSite | None = None  # the target step's batch, as calibration looks it up


@dataclass(frozen=True)
class PrefillPerf:
    dep: int
    tokens_per_rank: int
    step: StepBreakdown
    uncached_tok_s_per_gpu: float
    input_tok_s_per_gpu: float  # cached + uncached
    ttft_s: float  # prefill compute of one request's uncached tokens, no queueing


@dataclass(frozen=True)
class DecodePerf:
    dep: int
    batch_per_rank: int
    draft_depth: int
    step: StepBreakdown
    accepted_per_step: float
    output_tok_s_per_gpu: float
    tok_s_per_user: float
    p90_tok_s_per_user: float
    fits_memory: bool


def _moe_shape(model: PlannerModel, num_tokens: int, dedup: bool) -> A2AShape:
    cfg = model.cfg
    return A2AShape(
        num_tokens,
        cfg.num_experts_per_tok,
        cfg.hidden_size,
        model.formats.dispatch_bytes,
        2.0,
        dedup,
    )


def _num_moe_layers(cfg) -> int:
    return cfg.num_moe_layers if isinstance(cfg, MlaConfig) else cfg.num_hidden_layers


def _step(
    model: PlannerModel,
    cfg,
    gpu: GpuSpec,
    dep: int,
    batch: BatchShape,
    eff: Efficiency,
    routing_eff: float,
    cv_tokens: float,
    cv_attention: float,
    dedup: bool,
    include_cpu: bool = True,
) -> StepBreakdown:
    """One forward of ``cfg`` (target or draft) for ``batch`` on each of ``dep`` ranks."""
    ops = step_ops(cfg, batch, model.formats, ep_size=dep)
    pairs = batch.num_tokens * cfg.num_experts_per_tok
    balance = ep_balancedness(pairs, dep, routing_eff)
    site = OpSite.of(batch, cfg.n_routed_experts, cfg.num_experts_per_tok, dep)
    times = [
        (op.name, op_time(op, gpu, eff, site) / (balance if op.kind == MOE else 1.0)) for op in ops
    ]
    kinds = {op.name: op.kind for op in ops}
    moe = sum(t for name, t in times if kinds[name] == MOE)
    attn = sum(t for name, t in times if kinds[name] in (ATTENTION, INDEXER))
    dp_side = sum(t for _, t in times) - moe
    # Slowest rank: token-count fluctuation scales all DP-side work, context-length
    # fluctuation only attention; independent, so their spreads add in quadrature.
    spread = math.hypot(cv_tokens * dp_side, cv_attention * attn)
    slowest_dp = dp_side + expected_max_std_normal(dep) * spread
    compute = slowest_dp + moe
    a2a = _num_moe_layers(cfg) * all_to_all_time(
        gpu, dep, _moe_shape(model, batch.num_tokens, dedup), eff, balance
    )
    overlapped = max(compute, a2a) + (1 - eff.overlap) * min(compute, a2a)
    cpu = eff.cpu_step_s if include_cpu else 0.0
    return StepBreakdown(
        tuple(times),
        compute,
        a2a,
        cpu,
        overlapped + cpu,
        slowest_dp / dp_side if dp_side else 1.0,
        balance,
        site,
    )


def prefill_perf(
    model: PlannerModel,
    gpu: GpuSpec,
    dep: int,
    tokens_per_rank: int,
    workload: Workload,
    eff: Efficiency,
    routing_eff: float = 0.94,
) -> PrefillPerf:
    """Steady-state prefill throughput with a token budget of ``tokens_per_rank`` per step.

    Requests are packed whole into the budget; a prompt longer than the budget is chunked
    (its chunks see, on average, half of the prompt's uncached part as extra context).
    """
    new = workload.uncached_len
    if new >= tokens_per_rank:
        batch = BatchShape(1, tokens_per_rank, workload.cached_len + (new - tokens_per_rank) // 2)
    else:
        batch = BatchShape(max(1, tokens_per_rank // new), new, workload.cached_len)
    reqs = batch.num_requests
    step = _step(
        model,
        model.cfg,
        gpu,
        dep,
        batch,
        eff,
        routing_eff,
        workload.step_load_cv,
        sum_cv(workload.length_cv, reqs),
        dedup=True,
    )
    uncached = batch.num_tokens / step.total_s
    chunks = math.ceil(new / batch.new_tokens)
    return PrefillPerf(
        dep,
        tokens_per_rank,
        step,
        uncached,
        uncached / (1 - workload.cached_frac),
        chunks * step.total_s,
    )


def decode_perf(
    model: PlannerModel,
    gpu: GpuSpec,
    dep: int,
    batch_per_rank: int,
    workload: Workload,
    eff: Efficiency,
    draft_depth: int = 0,
    routing_eff: float = 0.94,
    acceptance: float | None = None,
) -> DecodePerf:
    """Decode with ``batch_per_rank`` running requests per GPU and ``draft_depth`` draft
    tokens verified per step (0 = no speculative decoding)."""
    context = workload.decode_context
    target = BatchShape(batch_per_rank, 1 + draft_depth, context)
    cv_attn = sum_cv(workload.length_cv, batch_per_rank)
    step = _step(model, model.cfg, gpu, dep, target, eff, routing_eff, 0.0, cv_attn, dedup=False)
    total, a2a, compute = step.total_s, step.all_to_all_s, step.compute_s
    accepted = 1.0
    if draft_depth and model.draft is not None:
        draft = model.draft
        one = BatchShape(batch_per_rank, 1, context)
        d = _step(
            model,
            draft.cfg,
            gpu,
            dep,
            one,
            eff,
            routing_eff,
            0.0,
            cv_attn,
            dedup=False,
            include_cpu=False,
        )
        # The draft runs draft_depth sequential single-token passes of its layers.
        total += draft_depth * d.total_s * draft.num_layers
        compute += draft_depth * d.compute_s * draft.num_layers
        a2a += draft_depth * d.all_to_all_s * draft.num_layers
        a = draft.acceptance if acceptance is None else acceptance
        accepted = (1 - a ** (draft_depth + 1)) / (1 - a) if a < 1 else draft_depth + 1.0
    step = StepBreakdown(
        step.op_times,
        compute,
        a2a,
        step.cpu_s,
        total,
        step.dp_imbalance,
        step.ep_balancedness,
        step.site,
    )
    per_user = accepted / total
    kv = kv_bytes_per_token(model.cfg, model.formats) * (
        workload.input_len + workload.output_len
    ) + kv_bytes_per_request_fixed(model.cfg, model.formats)
    need = weight_bytes_per_rank(model.cfg, model.formats, dep) + batch_per_rank * kv
    return DecodePerf(
        dep,
        batch_per_rank,
        draft_depth,
        step,
        accepted,
        batch_per_rank * per_user,
        per_user,
        per_user / (1 + P90_Z * STEP_TIME_CV),
        need <= HBM_USABLE * gpu.hbm_bytes,
    )


def prefill_fits(model: PlannerModel, gpu: GpuSpec, dep: int) -> bool:
    return weight_bytes_per_rank(model.cfg, model.formats, dep) <= HBM_USABLE * gpu.hbm_bytes
