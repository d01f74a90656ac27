"""P/D configuration search: xPyD counts, DEP sizes, batch per rank and draft depth.

A system is ``x`` prefill instances of ``prefill_dep`` GPUs and ``y`` decode instances of
``decode_dep`` GPUs. In steady state the request rate is the smallest of what prefill can
compute, what decode can emit and what the links can move as KV:

    rate = min(x p * uncached_tok_s_per_gpu / uncached_len,
               y d * output_tok_s_per_gpu / output_len,
               x p * link_bw / kv_bytes_per_request)

Throughput per GPU counts cached + uncached input + output tokens over all GPUs; cost per
million tokens is the GPU-hour price spread over the same tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rackserve.planner.comm import kv_transfer_time
from rackserve.planner.cost import Efficiency
from rackserve.planner.counting import kv_bytes_per_request_fixed, kv_bytes_per_token
from rackserve.planner.hardware import GpuSpec
from rackserve.planner.models import PlannerModel
from rackserve.planner.simulate import (
    DecodePerf,
    PrefillPerf,
    Workload,
    decode_perf,
    prefill_fits,
    prefill_perf,
)

PREFILL_DEPS = (1, 2, 4, 8)
PREFILL_TOKENS = (8192, 16384)
DECODE_DEPS = (1, 2, 4, 8, 16, 32, 64, 72)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
DRAFT_DEPTHS = (0, 1, 2, 3)

_NAME = re.compile(r"^(\d+)xDEP(\d+)\+(\d+)xDEP(\d+)-t(\d+)-b(\d+)-s(\d+)$")


@dataclass(frozen=True)
class SystemConfig:
    num_prefill: int
    prefill_dep: int
    num_decode: int
    decode_dep: int
    tokens_per_rank: int  # prefill token budget per GPU per step
    batch_per_rank: int  # running decode requests per GPU
    draft_depth: int

    @property
    def num_gpus(self) -> int:
        return self.num_prefill * self.prefill_dep + self.num_decode * self.decode_dep

    @property
    def name(self) -> str:
        """e.g. ``3xDEP2+1xDEP16-t16384-b64-s2``: 3 prefill DEP2, 1 decode DEP16."""
        return (
            f"{self.num_prefill}xDEP{self.prefill_dep}+{self.num_decode}xDEP"
            f"{self.decode_dep}-t{self.tokens_per_rank}-b{self.batch_per_rank}"
            f"-s{self.draft_depth}"
        )

    @classmethod
    def parse(cls, name: str) -> SystemConfig:
        m = _NAME.match(name.strip())
        if not m:
            raise ValueError(
                f"bad configuration {name!r}; expected e.g. 3xDEP2+1xDEP16-t16384-b64-s2"
            )
        return cls(*(int(g) for g in m.groups()))


@dataclass(frozen=True)
class SystemResult:
    config: SystemConfig
    tok_s_per_gpu: float  # cached + uncached input + output
    output_tok_s_per_gpu: float
    p90_tok_s_per_user: float
    ttft_s: float
    usd_per_mtok: float
    prefill: PrefillPerf
    decode: DecodePerf
    bound: str  # "prefill" | "decode" | "kv-link"


def kv_bytes_per_request(model: PlannerModel, workload: Workload) -> float:
    return kv_bytes_per_token(
        model.cfg, model.formats
    ) * workload.input_len + kv_bytes_per_request_fixed(model.cfg, model.formats)


def combine(
    model: PlannerModel,
    gpu: GpuSpec,
    workload: Workload,
    config: SystemConfig,
    prefill: PrefillPerf,
    decode: DecodePerf,
    eff: Efficiency,
    gpu_hour_usd: float,
    kv: float | None = None,
) -> SystemResult:
    """Steady state of one xPyD system from its instances' per-GPU performance."""
    prefill_gpus = config.num_prefill * config.prefill_dep
    decode_gpus = config.num_decode * config.decode_dep
    kv = kv_bytes_per_request(model, workload) if kv is None else kv
    same_domain = config.num_gpus <= gpu.nvlink_domain
    link_bw = gpu.nvlink_bw * eff.nvlink if same_domain else gpu.nic_bw * eff.nic
    rates = {
        "prefill": prefill_gpus * prefill.uncached_tok_s_per_gpu / workload.uncached_len,
        "decode": decode_gpus * decode.output_tok_s_per_gpu / workload.output_len,
        "kv-link": prefill_gpus * link_bw / kv,
    }
    bound = min(rates, key=rates.__getitem__)
    rate = rates[bound]  # requests / s
    tokens = rate * (workload.input_len + workload.output_len)
    ttft = prefill.ttft_s + kv_transfer_time(gpu, kv, same_domain, eff)
    usd = gpu_hour_usd * config.num_gpus / 3600 / tokens * 1e6
    return SystemResult(
        config,
        tokens / config.num_gpus,
        rate * workload.output_len / config.num_gpus,
        decode.p90_tok_s_per_user,
        ttft,
        usd,
        prefill,
        decode,
        bound,
    )


def evaluate(
    model: PlannerModel,
    gpu: GpuSpec,
    workload: Workload,
    config: SystemConfig,
    eff: Efficiency,
    gpu_hour_usd: float,
) -> SystemResult:
    prefill = prefill_perf(model, gpu, config.prefill_dep, config.tokens_per_rank, workload, eff)
    decode = decode_perf(
        model, gpu, config.decode_dep, config.batch_per_rank, workload, eff, config.draft_depth
    )
    return combine(model, gpu, workload, config, prefill, decode, eff, gpu_hour_usd)


def search(
    model: PlannerModel,
    gpu: GpuSpec,
    workload: Workload,
    eff: Efficiency,
    gpu_hour_usd: float,
    max_gpus: int,
) -> list[SystemResult]:
    """For every (prefill instance, decode instance) pair that fits in memory, the xPyD
    counts within ``max_gpus`` GPUs with the highest throughput per GPU."""
    prefills = [
        prefill_perf(model, gpu, dep, tokens, workload, eff)
        for dep in PREFILL_DEPS
        if dep < max_gpus and prefill_fits(model, gpu, dep)
        for tokens in PREFILL_TOKENS
    ]
    depths = DRAFT_DEPTHS if model.draft is not None else (0,)
    decodes = [
        d
        for dep in DECODE_DEPS
        if dep < max_gpus
        for batch in BATCHES
        for depth in depths
        if (d := decode_perf(model, gpu, dep, batch, workload, eff, depth)).fits_memory
    ]
    kv = kv_bytes_per_request(model, workload)
    results = []
    for p in prefills:
        per_prefill = p.dep * p.uncached_tok_s_per_gpu / workload.uncached_len  # requests/s
        for d in decodes:
            best: SystemResult | None = None
            for y in _counts((max_gpus - p.dep) // d.dep):
                # The prefill count that matches y decode instances, rounded both ways.
                ideal = y * d.dep * d.output_tok_s_per_gpu / workload.output_len / per_prefill
                for x in {max(1, int(ideal)), int(ideal) + 1}:
                    cfg = SystemConfig(
                        x, p.dep, y, d.dep, p.tokens_per_rank, d.batch_per_rank, d.draft_depth
                    )
                    if cfg.num_gpus > max_gpus:
                        continue
                    r = combine(model, gpu, workload, cfg, p, d, eff, gpu_hour_usd, kv)
                    if best is None or r.tok_s_per_gpu > best.tok_s_per_gpu:
                        best = r
            if best is not None:
                results.append(best)
    return results


def _counts(limit: int) -> list[int]:
    """Instance counts to try: every count up to 8, then powers of two and their 1.5x."""
    counts = {c for c in range(1, min(limit, 8) + 1)}
    c = 8
    while c <= limit:
        counts.update(v for v in (c, c * 3 // 2) if v <= limit)
        c *= 2
    return sorted(counts)


def pareto(results: list[SystemResult]) -> list[SystemResult]:
    """Results no other result beats on both throughput per GPU and P90 interactivity,
    sorted by interactivity (ascending)."""
    ordered = sorted(results, key=lambda r: (-r.p90_tok_s_per_user, -r.tok_s_per_gpu))
    frontier, best = [], -1.0
    for r in ordered:
        if r.tok_s_per_gpu > best:
            frontier.append(r)
            best = r.tok_s_per_gpu
    return frontier[::-1]
