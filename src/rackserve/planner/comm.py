"""Communication and load imbalance: expert all-to-all, P/D KV transfer, max-over-ranks.

All times in seconds, bytes per rank. The all-to-all is modelled as DeepEP does it: each
rank sends its (token, expert) pairs to the ranks owning those experts (FP8 dispatch, BF16
combine). Prefill ("normal" kernels) sends a token once per remote node and forwards it over
NVLink inside the node; decode ("low-latency" kernels) sends every pair directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from rackserve.planner.cost import Efficiency
from rackserve.planner.hardware import GpuSpec, ep_links


@dataclass(frozen=True)
class A2AShape:
    """One MoE layer's all-to-all on one rank: T tokens, K experts each, D hidden."""

    num_tokens: int
    top_k: int
    hidden: int
    dispatch_bytes: float = 1.0  # per value on the wire (FP8 + scales ~ 1)
    combine_bytes: float = 2.0  # BF16
    dedup_per_node: bool = False  # prefill kernels send a token once per remote node


def all_to_all_time(
    gpu: GpuSpec, ep_size: int, shape: A2AShape, eff: Efficiency, balancedness: float = 1.0
) -> float:
    """Dispatch + combine time of one MoE layer.

    The slowest rank receives 1 / balancedness times the mean traffic, so the collective
    takes that much longer than the balanced case.
    """
    if ep_size <= 1 or shape.num_tokens == 0:
        return 0.0
    nvlink, nic, remote_frac = ep_links(gpu, ep_size)
    pairs = shape.num_tokens * shape.top_k * (ep_size - 1) / ep_size  # leave this rank
    per_pair = shape.hidden * (shape.dispatch_bytes + shape.combine_bytes)
    inter_pairs = pairs * remote_frac
    if shape.dedup_per_node and nic is not None:
        nodes = ep_size / gpu.nvlink_domain
        # Distinct nodes hit by K uniform picks, remote ones only.
        distinct = nodes * (1 - (1 - 1 / nodes) ** shape.top_k) * (nodes - 1) / nodes
        inter_pairs = min(inter_pairs, shape.num_tokens * distinct)
    intra_pairs = pairs - pairs * remote_frac + (pairs * remote_frac - inter_pairs)
    t_intra = intra_pairs * per_pair / (nvlink.bandwidth * eff.nvlink)
    t_inter = 0.0 if nic is None else inter_pairs * per_pair / (nic.bandwidth * eff.nic)
    latency = 2 * (nic.latency_s if nic is not None else nvlink.latency_s)
    return latency + max(t_intra, t_inter) / balancedness


def kv_transfer_time(
    gpu: GpuSpec, kv_bytes: float, same_nvlink_domain: bool, eff: Efficiency
) -> float:
    """Push one request's KV from a prefill GPU to a decode GPU."""
    if same_nvlink_domain:
        return 8e-6 + kv_bytes / (gpu.nvlink_bw * eff.nvlink)
    return 20e-6 + kv_bytes / (gpu.nic_bw * eff.nic)


@lru_cache(maxsize=256)
def expected_max_std_normal(num: int) -> float:
    """E[max of ``num`` iid standard normals] (0 for one), by numerical integration."""
    if num <= 1:
        return 0.0
    # E[max] = integral of x * num * phi(x) * Phi(x)^(num-1) dx on a fine grid.
    step, total = 0.01, 0.0
    for i in range(-800, 801):
        x = i * step
        phi = math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        total += x * num * phi * cdf ** (num - 1) * step
    return total


def dp_imbalance(num_ranks: int, load_cv: float) -> float:
    """Expected max over ranks of per-rank load divided by the mean (>= 1).

    ``load_cv`` is the coefficient of variation of one rank's per-step load; a normal
    approximation, floored so the max never falls below the mean.
    """
    return 1.0 + max(load_cv, 0.0) * expected_max_std_normal(num_ranks)


def sum_cv(item_cv: float, num_items: float) -> float:
    """CV of a sum of ``num_items`` iid items with CV ``item_cv``."""
    return item_cv / math.sqrt(max(num_items, 1.0))


def ep_balancedness(num_pairs_per_rank: float, ep_size: int, routing_efficiency: float) -> float:
    """Mean / max rank load of one MoE layer.

    The statistical ceiling is random routing (Poisson counts per rank): the max over
    ``ep_size`` ranks is mean + sqrt(mean) * E[max normal]. Learned routing with EPLB keeps
    ``routing_efficiency`` of that ceiling (published: 0.94 target, 0.89 draft).
    """
    if ep_size <= 1 or num_pairs_per_rank <= 0:
        return 1.0
    mean = num_pairs_per_rank
    ceiling = mean / (mean + math.sqrt(mean) * expected_max_std_normal(ep_size))
    return ceiling * routing_efficiency
